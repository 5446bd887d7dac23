"""Writing files safely and running out of room: what every part of trainer/ that writes (the run directory,
the data preparation, the hang watchdog, the metrics) and inference/ share. It imports nothing of the
project, so the parts that write sit above it and never loop back through one another.

`safe_io.py` (writes that refuse links and land whole), `disk_space.py` (free space, and telling a full disk
from another failure).
"""
