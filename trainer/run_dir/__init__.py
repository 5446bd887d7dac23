"""Run storage: everything written to and read back from `run.dir`, and the rules that keep it safe.

`checkpoint.py` (the checkpoint format: DCP shards, per-rank extra JSON, meta.json with checksums, the
`latest` choice, pruning and pinning), `async_checkpoint.py` (`checkpoint.async_mode`: the write overlaps
training, published only once complete), `safe_dcp.py` (DCP reading without pickle), `lock.py` (one run per
directory, room for a checkpoint), `finished.py` (the step a run finished at, kept when its checkpoints are
deleted). Its writes go through trainer/files/safe_io.py, which refuses links and lands them whole.
"""
