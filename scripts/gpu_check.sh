#!/usr/bin/env bash
# The one-GPU check (docs/GPU.md): one command of at most 9 minutes on an H100, first compiles included,
# on a machine that reaches no package index. It installs the wheels `make gpu-bundle` put in .gpu/wheels
# (what such a machine lacks) into .gpu/site without an index, puts the repo and that folder on PYTHONPATH,
# and runs the checks in order (scripts/gpu_checks/run.py: each under its own limit, a timed-out check
# does not stop the rest): (a) every Triton kernel vs its reference, (b) copy bandwidth and each fused
# kernel's fraction of it, (c) fla chunk_kda vs our KDA, (d) a bf16 training step of baseline, Block and
# Full, (e) resume on the device, (f) compiled decode.
#
#   bash scripts/gpu_check.sh              on the CUDA device
#   bash scripts/gpu_check.sh --rehearse   every check on the CPU with tiny shapes (the suite runs this);
#                                          only CUDA-only steps SKIP, each naming what it would have measured
#
# PYTHON picks the interpreter (default: the repository's .venv/bin/python, which `make setup` builds, where it
# exists, else python3); GPU_CHECK_OUT the output folder (default
# runs/gpu_check/<time>): gpu_check.json holds every figure, summary.txt the one-screen summary, and each
# check's folder its log.
set -u
cd "$(dirname "$0")/.."

# After `make setup` torch lives only in .venv; a lent machine has no .venv and its python3 holds torch.
# Relative (the script runs from the repository root): $PYTHON is word-split, a repository path may hold spaces.
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then
  PYTHON=.venv/bin/python
fi
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}
REPO=$PWD
case "${1:-}" in
  "") MODE=() ;;
  --rehearse) MODE=(rehearse=true) ;;
  *) echo "gpu_check: unknown argument '$1'; the only option is --rehearse" >&2; exit 2 ;;
esac
if [[ $# -gt 1 ]]; then
  echo "gpu_check: one argument at most, got $#: $*" >&2
  exit 2
fi

if [[ ${#MODE[@]} -eq 0 ]] && ! $PYTHON -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False); --rehearse runs every check on the CPU, PYTHON=INTERPRETER picks another" >&2
  exit 2
fi

SITE=$REPO/.gpu/site
wheels=(.gpu/wheels/*.whl)
if [[ ${#MODE[@]} -eq 0 && -e "${wheels[0]}" ]]; then
  # --no-index: the lent machine reaches no index; --no-deps: the bundle names every missing dependency.
  rm -rf "$SITE"
  if ! $PYTHON -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}"; then
    echo "gpu_check: installing the ${#wheels[@]} wheels of .gpu/wheels into $SITE failed" >&2
    exit 2
  fi
  echo "gpu_check: ${#wheels[@]} wheels from .gpu/wheels installed into $SITE"
elif [[ ${#MODE[@]} -eq 0 ]]; then
  echo "gpu_check: no wheels in .gpu/wheels (make gpu-bundle); using what $PYTHON already has"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec $PYTHON -m scripts.gpu_checks.run out="$OUT" "${MODE[@]}"
