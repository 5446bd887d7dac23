"""Peak host memory of exporting a checkpoint (native, hf, kimi) and of importing a Kimi-format directory.

A synthetic checkpoint of the model (Block AttnRes, without the KDA output gate's bias, so the Kimi format can
hold it: K3's layout) is written once, and one of model=xs to warm up with; then each measurement is a fresh
process (ru_maxrss is a per-process high-water mark) that first does the same on model=xs (so one-time costs,
imports and the allocator's start, are paid before the RSS baseline is read), with MALLOC_MMAP_THRESHOLD_
fixed so freed blocks leave the RSS:
  whole          what export did before it streamed: the checkpoint loaded into a built model, one save_file
  native, hf, kimi   python -m inference.export's formats, reading the checkpoint a max_shard_size at a time
  import         inference.load_model of the kimi export: the model built, then filled tensor by tensor
  import_fsdp2   each of 2 gloo ranks (torchrun): the model on meta, sharded by FSDP2 and filled with this
                 rank's shards (materialise_parallel), then every rank reading only its rows of the kimi
                 export (trainer/kimi/load.py's read_into, as init_from does)
`growth` is the peak RSS minus the RSS once the imports are done; `model` is the state's bytes.

    python -m scripts.bench export_import [model=l] [max_shard_size=256MB]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.bench.common import in_fresh_process, peak_rss_bytes, rss_bytes
from scripts.cli import key, parse

MODES = ("whole", "native", "hf", "kimi", "import")
FSDP_IMPORT = "import_fsdp2"  # per rank, under torchrun
KIMI_EXPORTABLE = ("variant=block", "variant.block_size=4", "model.kda.output_gate_bias=false")


@dataclass
class Args:
    model: str = key("l", "configs/model/ size")
    max_shard_size: str = key("256MB", "the exports' max_shard_size (also how much they read at a time)")
    one: str | None = key(None, "internal: measure this mode in this process",
                          choices=(None, "setup", *MODES, FSDP_IMPORT))
    root: str | None = key(None, "internal: the directory holding the checkpoint and the exports")


def setup(model_name: str, root: Path) -> dict:
    """Checkpoints of the model and of model=xs, freshly initialised, as the trainer saves one (without
    optimizer state)."""
    from model import build_model
    from model.params import config_counts
    from trainer.config import load_config
    from trainer.run_dir.checkpoint import model_fingerprint, save_checkpoint

    for name, size in (("warm", "xs"), ("run", model_name)):
        cfg = load_config([f"model={size}", *KIMI_EXPORTABLE])
        meta = {"model_fingerprint": f"{model_fingerprint(cfg.model)} optim={cfg.optim.name}", "config": asdict(cfg)}
        save_checkpoint(root / name, 0, build_model(cfg), [], None, extra={}, meta=meta, keep_last=1)
    return {"model_mb": 4 * config_counts(cfg.model).state / 1e6}


def run_mode(mode: str, run: Path, out: Path, max_shard_size: str) -> None:
    from safetensors.torch import save_file

    from inference import load_model
    from inference.export import export, safetensors_ready
    from trainer.trained import load_trained

    if mode == "whole":
        out.mkdir()
        save_file(safetensors_ready(load_trained(run).model.state_dict()), out / "model.safetensors")
    elif mode == "import":
        load_model(out)
    else:
        export(str(run), str(out), format=mode, max_shard_size=max_shard_size)


def measure(mode: str, root: Path, max_shard_size: str) -> dict:
    """One measurement, in this process (run by main in a fresh one): model=xs first, then the model."""
    source = "kimi" if mode == "import" else mode
    run_mode(mode, root / "warm", root / f"{source}-warm", max_shard_size)
    before = rss_bytes()
    run_mode(mode, root / "run", root / source, max_shard_size)
    return {"mode": mode, "growth_mb": (peak_rss_bytes() - before) / 1e6}


def import_fsdp2(root: Path) -> dict:
    """One rank of 2 (under torchrun): the kimi export into an FSDP2-sharded model, model=xs's first."""
    import torch

    from model import build_model
    from parallel.dims import Degrees, build_layout, init_distributed
    from parallel.parallelize import materialise_parallel
    from trainer.kimi.load import open_release, read_into

    info = init_distributed()
    layout = build_layout(info, Degrees(fsdp=2))
    before = None
    for name in ("kimi-warm", "kimi"):
        release = open_release(root / name)
        before = rss_bytes()
        model = build_model(release.model_config, device="meta")
        materialise_parallel(model, info, layout, 0, torch.float32)
        read_into(model, release)
        del model
    return {"mode": FSDP_IMPORT, "rank": info.rank, "growth_mb": (peak_rss_bytes() - before) / 1e6}


def fsdp_import_growth(root: Path, env: dict[str, str]) -> list[float]:
    """Each rank's growth in import_fsdp2, from a 2-rank torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "scripts.bench",
               "export_import", f"one={FSDP_IMPORT}", f"root={root}"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or len(lines) != 2:
        sys.exit(f"the {FSDP_IMPORT} measurement failed: {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return [line["growth_mb"] for line in sorted(lines, key=lambda line: line["rank"])]


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if args.one == "setup":
        print(json.dumps(setup(args.model, Path(args.root))))
        return
    if args.one == FSDP_IMPORT:
        print(json.dumps(import_fsdp2(Path(args.root))))
        return
    if args.one:
        print(json.dumps(measure(args.one, Path(args.root), args.max_shard_size)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    root = Path(tempfile.mkdtemp(prefix="bench-export-"))
    try:
        size = in_fresh_process(["-m", "scripts.bench", "export_import", "one=setup", f"model={args.model}",
                                 f"root={root}"], env, "writing the checkpoint")["model_mb"]
        results = {}
        for mode in MODES:
            command = ["-m", "scripts.bench", "export_import", f"one={mode}", f"root={root}",
                       f"max_shard_size={args.max_shard_size}"]
            results[mode] = in_fresh_process(command, env, f"the {mode} measurement")["growth_mb"]
            print(f"{mode}: {results[mode]:.0f} MB", file=sys.stderr)
            if mode != "kimi":  # the imports read the kimi export
                shutil.rmtree(root / mode, ignore_errors=True)
        per_rank = fsdp_import_growth(root, env)
        print(f"{FSDP_IMPORT}: {' / '.join(f'{growth:.0f}' for growth in per_rank)} MB", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"model={args.model} ({size:.0f} MB of fp32 state), max_shard_size={args.max_shard_size}: peak host memory "
          "growth " + ", ".join(f"{mode} {results[mode]:.0f} MB" for mode in MODES)
          + f", {FSDP_IMPORT} per rank " + " / ".join(f"{growth:.0f} MB" for growth in per_rank))
