"""fla's fused `chunk_kda` (what kernels.kda.kda_chunk takes on CUDA when fla imports) against our
chunkwise torch form, on the same CUDA inputs: outputs, final state and the gradients of every input.

fp32 inputs; fla's kernels may run their dots in TF32 (10-bit mantissa), so errors relative to the
largest magnitude up to TOLERANCE pass. A wrong decay or gate convention errs by O(1).

    python -m scripts.gpu_checks.fla_kda    (last line: PASS|FAIL|SKIP fla_chunk_kda ...)
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernels.kda import fla_available, kda_chunk, torch_kda_chunk

TOLERANCE = 5e-3
B, T, H, K = 2, 300, 4, 64  # T spans several chunks and ends in a partial one


def inputs() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, device="cuda", generator=gen)
    g = -torch.rand(H, 1, device="cuda", generator=gen) * 4 * F.softplus(
        torch.randn(B, T, H, K, device="cuda", generator=gen) - 3)  # log decays <= 0, like the layer's
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    state = torch.randn(B, H, K, K, device="cuda", generator=gen)
    return [q, k, v, g, beta, state]


def run(kernel, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    q, k, v, g, beta, state = leaves
    o, final = kernel(q, k, v, g, beta, K ** -0.5, initial_state=state, output_final_state=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    (o * torch.randn(o.shape, device="cuda", generator=gen)).sum().add(
        (final * torch.randn(final.shape, device="cuda", generator=gen)).sum()).backward()
    return [o.detach(), final.detach(), *(leaf.grad for leaf in leaves)]


def main() -> None:
    if not torch.cuda.is_available():
        print("FAIL fla_chunk_kda no CUDA device")
        sys.exit(1)
    if not fla_available():
        print("SKIP fla_chunk_kda flash-linear-attention is not installed")
        return
    tensors = inputs()
    fla = run(lambda *a, **kw: kda_chunk(*a, **kw, impl="auto"), tensors)
    ours = run(torch_kda_chunk, tensors)
    names = ["o", "final_state", "d_q", "d_k", "d_v", "d_g", "d_beta", "d_initial_state"]
    errors = {}
    for name, got, want in zip(names, fla, ours):
        errors[name] = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
        print(f"  {name}: max relative error {errors[name]:.2e}")
    worst_name = max(errors, key=errors.get)
    passed = errors[worst_name] <= TOLERANCE
    print(f"{'PASS' if passed else 'FAIL'} fla_chunk_kda max_rel_error={errors[worst_name]:.1e} ({worst_name}; "
          f"<= {TOLERANCE:.0e}) B={B} T={T} H={H} K={K} fp32")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
