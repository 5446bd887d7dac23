"""float8 against bf16: a training step of model=m built as the trainer builds it (build_engine, with and
without train.float8), and one Linear at the 48B model's dense-MLP shape, forward and backward, both eager.
The two steps are interleaved round by round, as train_step's variants are. Figures: each median step, the
throughput ratio float8 / bf16 (> 1: float8 is faster), each one's MFU (float8 against the peak of its
float8/bf16 FLOP mix, trainer/mfu.py), the first step's losses (the same weights and tokens: float8 moves
the loss by about 1e-3 relative, tests/parallel/test_float8.py) and the one-Linear ratio. Eager: torchao
casts each operand in separate kernels, which torch.compile would fuse, so these ratios are float8's floor;
and model=m's matmuls (d_model 512) are small for float8, so the 48B-shaped Linear says more.

    python -m scripts.gpu_checks.float8_step out=DIR [rehearse=true]    (rehearsal: model=xs, fp32 matmuls on
                                                                         float8-rounded operands, on the CPU)
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import torch
from torch import nn

from model import build_model
from model.flops import training_flops_per_token
from parallel.dims import Degrees, DistInfo, Layout
from parallel.engine import build_engine
from scripts.gpu_checks.result import Result, parse_args
from trainer.config import ParallelConfig, load_config
from trainer.mfu import achieved, device_peak_tflops, float8_flop_share

# (model size, micro-batch, sequence length, warm-up steps, timed rounds, Linear tokens, in, out features)
# model=m (Block, the default variant) at train_step's batch: its bf16 step reads against train_step_bf16's block.
SETTINGS = {"gpu": ("m", 8, 1024, 3, 10, 8192, 2304, 9216), "rehearse": ("xs", 2, 32, 1, 2, 64, 96, 256)}


def synchronized_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def median_ms(run, device: torch.device, warmup: int, rounds: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(rounds):
        start = synchronized_now(device)
        run()
        times.append(synchronized_now(device) - start)
    return statistics.median(times) * 1e3


def linear_ratio(device: torch.device, autocast, tokens: int, features_in: int, features_out: int,
                 warmup: int, rounds: int) -> dict:
    """One Linear's forward + backward, bf16 vs float8 (the same weights): the matmul-level gain."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    plain = nn.Linear(features_in, features_out, bias=False, device=device)
    # The recipe parallel/float8.py converts with (torchao's default), on the same weights.
    converted = Float8Linear.from_float(copy.deepcopy(plain), Float8LinearConfig(emulate=device.type != "cuda"))
    x = torch.randn(tokens, features_in, device=device, requires_grad=True)  # (M, K)

    def run(linear):
        def once():
            with autocast():
                out = linear(x)  # (M, N)
            out.float().sum().backward()
        return once
    ms = {name: median_ms(run(linear), device, warmup, rounds)
          for name, linear in (("bf16", plain), ("float8", converted))}
    return {"tokens": tokens, "in": features_in, "out": features_out, "ms": ms, "ratio": ms["bf16"] / ms["float8"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("float8_step")
    size, batch, seq, warmup, rounds, tokens_lin, lin_in, lin_out = SETTINGS["rehearse" if args.rehearse else "gpu"]
    device, on_cuda = args.device, args.device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else contextlib.nullcontext
    cfg = load_config([f"model={size}"])
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    batches = [(tokens[:, :-1].to(device), tokens[:, 1:].to(device))]  # (B, T) inputs and targets
    info = DistInfo(0, 1, 0, device, None)

    runs, first_loss = {}, {}
    for float8 in (False, True):
        engine = build_engine(build_model(cfg, device="meta"), info, Layout(degrees=Degrees()), ParallelConfig(),
                              batch, seq, 1, seed=0, precision=torch.bfloat16 if on_cuda else torch.float32,
                              float8=float8)
        optimizer = torch.optim.AdamW(engine.model.parameters(), lr=1e-4)

        def step(engine=engine, optimizer=optimizer) -> float:
            loss = engine.forward_backward(batches, autocast, None).item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss}")
            return loss
        first_loss["float8" if float8 else "bf16"] = step()
        for _ in range(warmup - 1):
            step()
        runs["float8" if float8 else "bf16"] = step
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            start = synchronized_now(device)
            step()
            times[name].append(synchronized_now(device) - start)
    step_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratio = step_ms["bf16"] / step_ms["float8"]

    flops = training_flops_per_token(cfg.model, seq)["total"]
    share = float8_flop_share(cfg.model, 1, flops)
    peaks = {"bf16": device_peak_tflops(device), "float8": device_peak_tflops(device, float8_share=share)}
    mfu = {name: achieved(flops, batch * seq, step_ms[name] / 1e3, peaks[name])[1] for name in runs}
    linear = linear_ratio(device, autocast, tokens_lin, lin_in, lin_out, warmup, rounds)
    loss_gap = abs(first_loss["float8"] - first_loss["bf16"]) / first_loss["bf16"]
    result.figures.update(model=size, micro_batch=batch, seq_len=seq, rounds=rounds, step_ms=step_ms,
                          throughput_ratio=ratio, float8_flop_share=share, peak_tflops=peaks, mfu=mfu,
                          first_loss=first_loss, linear=linear)
    if loss_gap > 1e-2:
        result.problems.append(f"float8's first loss {first_loss['float8']:.4f} is {loss_gap:.1%} off bf16's "
                               f"{first_loss['bf16']:.4f} (expected about 0.1%)")
    if args.rehearse:
        result.skip("float8 tensor-core throughput (emulated on the CPU: fp32 matmuls)")
    efficiency = " ".join(f"{n}={m:.1%}" for n, m in mfu.items()) if all(mfu.values()) else ""
    result.finish(args.out, f"model={size} B={batch} T={seq} bf16={step_ms['bf16']:.1f}ms "
                            f"float8={step_ms['float8']:.1f}ms float8/bf16 throughput={ratio:.3f}x "
                            f"linear {lin_in}->{lin_out} x{tokens_lin}={linear['ratio']:.3f}x"
                            + (f" mfu {efficiency}" if efficiency else ""))


if __name__ == "__main__":
    main()
