"""The grouped-GEMM expert path (torch._grouped_mm, bf16 on CUDA) against the per-expert loop.

Outputs and the gradients of the rows and all three weight stacks, on uneven groups with idle
experts, at model=m's MoE sizes; then a whole MoE layer's forward and backward under
torch.cuda.set_sync_debug_mode("error"), which raises on any host sync; then the time of both paths.
Errors are relative to the loop's largest magnitude: both run in bf16, so TOLERANCE allows a few
bf16 ulps (2^-8 each) of accumulated rounding.

    python -m scripts.gpu_checks.grouped_mm    (last line: PASS|FAIL grouped_mm ...)
"""
from __future__ import annotations

import sys

import torch

from model.moe import MoE, grouped_experts
from scripts.cli import NoKeys, parse
from trainer.config import load_config

TOLERANCE = 2e-2
ROWS, D, INTER = 8192 * 2, 512, 512  # a model=m micro-batch of 8192 tokens at top_k=2
COUNTS = [0, 3000, 1, 17, 0, 2500, 999, 5000, 0, 1200, 7, 1, 2000, 1000, 659, 0]  # 16 experts, 4 idle


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


def outputs_and_grads(impl: str, x, counts, weights) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, *weights)]
    y = grouped_experts(leaves[0], counts, *leaves[1:], impl=impl)
    y.backward(torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y).to(y.dtype))
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def time_ms(impl: str, x, counts, weights, reps: int = 10) -> float:
    for _ in range(2):
        outputs_and_grads(impl, x, counts, weights)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        outputs_and_grads(impl, x, counts, weights)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def moe_layer_syncs() -> str | None:
    """Run a model=m MoE layer forward and backward with the grouped path; the error of the first host sync."""
    cfg = load_config(["model=m"]).model
    moe = MoE(cfg, expert_impl="grouped").cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.nn.init.zeros_(moe.expert_bias)
    x = torch.randn(4, 2048, cfg.d_model, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().square().mean().backward()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def main(argv: list[str] | None = None) -> None:
    parse(NoKeys, __doc__, argv)
    if not torch.cuda.is_available():
        print("FAIL grouped_mm no CUDA device")
        sys.exit(1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor(COUNTS, device="cuda")
    assert int(counts.sum()) == ROWS
    E = counts.shape[0]
    x = torch.randn(ROWS, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights = [(torch.randn(E, D, INTER, device="cuda", generator=gen) * D ** -0.5).bfloat16(),
               (torch.randn(E, D, INTER, device="cuda", generator=gen) * D ** -0.5).bfloat16(),
               (torch.randn(E, INTER, D, device="cuda", generator=gen) * INTER ** -0.5).bfloat16()]
    loop = outputs_and_grads("loop", x, counts, weights)
    grouped = outputs_and_grads("grouped", x, counts, weights)
    errors = {name: relative_error(g, w) for name, g, w in zip(["y", "d_x", "d_gate", "d_up", "d_down"], grouped, loop)}
    for name, error in errors.items():
        print(f"  {name}: max relative error {error:.2e}")
    sync = moe_layer_syncs()
    print(f"  MoE layer forward+backward with expert_impl=grouped: {sync or 'no host sync'}")
    loop_ms, grouped_ms = (time_ms(impl, x, counts, weights) for impl in ("loop", "grouped"))
    worst = max(errors.values())
    passed = worst <= TOLERANCE and sync is None
    print(f"{'PASS' if passed else 'FAIL'} grouped_mm max_rel_error={worst:.1e} (<= {TOLERANCE:.0e}) "
          f"host_sync={'none' if sync is None else 'yes'} fwd+bwd loop={loop_ms:.2f}ms grouped={grouped_ms:.2f}ms "
          f"speedup={loop_ms / grouped_ms:.2f}x")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
