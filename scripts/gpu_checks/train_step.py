"""(d) A bf16 training step of model=m for baseline, Block and Full in one process: forward (autocast bf16,
as train.precision=auto does on CUDA), loss with the MoE balance term, backward, AdamW. The variants'
steps are interleaved round by round, so a change of clocks or load hits all three alike, and the
Block/baseline and Full/baseline ratios of the median step times are read side by side. Each variant's
peak memory is what it allocates beyond what was held before it was built (its weights, gradients,
optimizer state and activations); MFU is model/flops.py's FLOPs per token over trainer/mfu.py's peak.

    python -m scripts.gpu_checks.train_step out=DIR [rehearse=true]    (rehearsal: model=xs, fp32, on the CPU)
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch
import torch.nn.functional as F

from model import build_model
from model.flops import training_flops_per_token
from scripts.gpu_checks.result import Result, parse_args
from trainer.config import load_config
from trainer.mfu import achieved, device_peak_tflops

VARIANTS = ("baseline", "block", "full")
# (model size, micro-batch, sequence length, warm-up steps, timed rounds)
SETTINGS = {"gpu": ("m", 8, 1024, 3, 10), "rehearse": ("xs", 2, 32, 1, 2)}


def synchronized_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("train_step_bf16")
    size, batch, seq, warmup, rounds = SETTINGS["rehearse" if args.rehearse else "gpu"]
    device, on_cuda = args.device, args.device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else contextlib.nullcontext
    cfg = load_config([f"model={size}"]).model
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def step(model, optimizer) -> float:
        start = synchronized_now(device)
        with autocast():
            logits = model(tokens[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss().to(device)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        return synchronized_now(device) - start

    runs, peak_mb = {}, {}
    for variant in VARIANTS:
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        model = build_model(load_config([f"model={size}", f"variant={variant}"]), seed=0).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(warmup):  # the first step compiles the Triton kernels (and fla's) for these shapes
            step(model, optimizer)
        if on_cuda:
            peak_mb[variant] = (torch.cuda.max_memory_allocated() - held) / 2**20
        runs[variant] = (model, optimizer)
    times = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        for variant, (model, optimizer) in runs.items():
            times[variant].append(step(model, optimizer))

    median_ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    ratios = {v: median_ms[v] / median_ms["baseline"] for v in VARIANTS if v != "baseline"}
    flops_per_token = training_flops_per_token(cfg, seq)["total"]
    peak_tflops = device_peak_tflops(device)
    mfu = {v: achieved(flops_per_token, batch * seq, median_ms[v] / 1e3, peak_tflops)[1] for v in VARIANTS}
    result.figures.update(model=size, micro_batch=batch, seq_len=seq, rounds=rounds, step_ms=median_ms,
                          ratio_to_baseline=ratios, mfu=mfu, peak_tflops=peak_tflops, peak_mem_mb=peak_mb or None)
    for v in VARIANTS:
        print(f"  {v}: median step {median_ms[v]:.1f} ms over {rounds} rounds"
              + (f", peak {peak_mb[v]:.0f} MB" if on_cuda else "") + (f", MFU {mfu[v]:.1%}" if mfu[v] else ""))
    if args.rehearse:
        result.skip("MFU against the GPU's bf16 peak (trainer/mfu.py)")
        result.skip("peak CUDA memory per variant")
    elif peak_tflops is None:
        result.problems.append(f"MFU unknown: '{torch.cuda.get_device_name()}' is not in trainer/mfu.py's table")
    memory = " ".join(f"{v}={peak_mb[v]:.0f}MB" for v in VARIANTS) if peak_mb else ""
    efficiency = " ".join(f"{v}={mfu[v]:.1%}" for v in VARIANTS) if all(mfu.values()) else ""
    result.finish(args.out, f"model={size} B={batch} T={seq} baseline={median_ms['baseline']:.1f}ms "
                            f"block/baseline={ratios['block']:.3f}x full/baseline={ratios['full']:.3f}x"
                            + (f" mfu {efficiency}" if efficiency else "") + (f" peak {memory}" if memory else ""))


if __name__ == "__main__":
    main()
