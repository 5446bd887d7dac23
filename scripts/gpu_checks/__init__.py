"""The checks of scripts/gpu_check.sh that need a few lines of Python; each ends with one summary line."""
