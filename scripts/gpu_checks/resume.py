"""(e) Resume on the device: Block at model=s trains 6 steps through the trainer (NCCL, bf16 on CUDA), its
last two steps profiled; a second run stops after step 3, and a third continues it from its checkpoint
(CUDA RNG state and all) to step 6. Steps 4-6 must have the uninterrupted run's losses: bitwise on the
CPU; on CUDA within TOLERANCE (relative), as atomics in backward kernels may reorder sums. The trainer's
own figures must be there on the device: MFU (the device is in trainer/mfu.py's table), peak memory, and
CUDA kernel events in the profiler's trace. The device may have no network, so the text is generated
here (seeded pseudo-words) and prepared with its own BPE.

    python -m scripts.gpu_checks.resume out=DIR [rehearse=true]    (rehearsal: model=xs, fp32, on the CPU)
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from parallel.dims import init_distributed
from scripts.gpu_checks.result import Result, parse_args
from trainer.config import load_config
from trainer.data import prepare_text_corpus
from trainer.trainer import Trainer

TOLERANCE = 5e-3
STEPS, STOP = 6, 3
# (model size, micro-batch, sequence length, corpus files, lines per file)
SETTINGS = {"gpu": ("s", 8, 512, 40, 400), "rehearse": ("xs", 2, 32, 30, 40)}


def write_corpus(texts: Path, files: int, lines: int) -> None:
    """Seeded pseudo-English: 4000 random words, enough distinct pairs for an 8192-token BPE."""
    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(2, 9))) for _ in range(4000)]
    texts.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        body = (" ".join(rng.choices(words, k=rng.randint(6, 16))).capitalize() + "." for _ in range(lines))
        (texts / f"doc{i:02d}.txt").write_text("\n".join(body) + "\n")


def step_records(run_dir: Path) -> dict[int, dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in records if "loss" in r}


def has_cuda_kernels(trace: Path) -> bool:
    """Whether the profiler recorded device activity (StepProfiler adds CUDA on a CUDA device)."""
    if not trace.is_file():
        return False
    return any(event.get("cat") == "kernel" for event in json.loads(trace.read_text()).get("traceEvents", []))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("resume")
    size, batch, seq, files, lines = SETTINGS["rehearse" if args.rehearse else "gpu"]
    write_corpus(args.out / "texts", files, lines)
    vocab = load_config([f"model={size}"]).model.vocab_size
    dataset = prepare_text_corpus([args.out / "texts"], args.out / "prepared", vocab)

    def train(name: str, *extra: str) -> Path:
        run_dir = args.out / name
        overrides = [f"model={size}", "variant=block", f"run.dir={run_dir}", f"data.path={dataset}",
                     f"train.steps={STEPS}", f"train.seq_len={seq}", f"train.micro_batch={batch}",
                     f"train.global_batch={batch}", "train.log_every=1", f"train.eval_every={STEPS}",
                     "train.eval_batches=1", f"train.ckpt_every={STOP}", f"train.diag_every={10 * STEPS}",
                     "train.warmup_steps=2", "logging.wandb.mode=disabled", *extra]
        Trainer(load_config(overrides), init_distributed()).fit()
        return run_dir

    for name in ("straight", "resumed"):
        shutil.rmtree(args.out / name, ignore_errors=True)
    straight_dir = train("straight", f"debug.profile_steps=[{STEPS - 1},{STEPS}]")
    train("resumed", f"train.stop_after={STOP}")
    records, resumed_records = step_records(straight_dir), step_records(train("resumed", "resume=auto"))
    straight = {step: r["loss"] for step, r in records.items()}
    resumed = {step: r["loss"] for step, r in resumed_records.items()}
    continued = range(STOP + 1, STEPS + 1)
    if sorted(resumed) != sorted(straight) or any(s not in resumed for s in continued):
        result.problems.append(f"steps logged: straight {sorted(straight)}, resumed {sorted(resumed)}")
        result.finish(args.out, "")
    difference = max(abs(resumed[s] / straight[s] - 1) for s in continued)
    bitwise = all(resumed[s] == straight[s] for s in continued)
    last = records[STEPS]
    result.figures.update(model=size, steps=STEPS, stopped_after=STOP, max_rel_loss_difference=difference,
                          bitwise=bitwise, losses={"straight": straight, "resumed": resumed},
                          mfu=last.get("mfu"), peak_mem_mb=last.get("peak_mem_mb"))
    trace = straight_dir / "profile" / f"rank0_steps{STEPS - 1}-{STEPS}.json"
    if not trace.is_file():
        result.problems.append(f"no profiler trace at {trace}")
    if args.rehearse:
        result.skip("the trainer's MFU on the GPU and CUDA kernel events in its profiler trace")
    else:
        if last.get("mfu") is None:
            result.problems.append("the trainer logged mfu null (the device's name is not in trainer/mfu.py's table)")
        if not has_cuda_kernels(trace):
            result.problems.append(f"the profiler trace {trace} holds no CUDA kernel events")
    allowed = 0.0 if args.rehearse else TOLERANCE
    if difference > allowed:
        result.problems.append(f"steps {STOP + 1}-{STEPS} after resuming differ from the uninterrupted run by "
                               f"{difference:.1e} relative (allowed {allowed:.0e})")
    result.finish(args.out, f"model={size} steps {STOP + 1}-{STEPS} after resume: max relative loss difference "
                            f"{difference:.1e} ({'bitwise' if bitwise else f'<= {allowed:.0e}'})")


if __name__ == "__main__":
    main()
