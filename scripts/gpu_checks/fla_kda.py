"""(c) fla's fused `chunk_kda` (what kernels.kda.kda_chunk takes on CUDA when fla imports) against our
chunkwise torch form on the same inputs: with an initial state (outputs, final state and the gradients
of every input and of the state), and with documents packed in one row (fla's cu_seqlens, as document
masking runs it: outputs and the gradients of every input).

fp32 inputs; fla's kernels may run their dots in TF32 (10-bit mantissa), so errors relative to the
largest magnitude up to TOLERANCE pass. A wrong decay or gate convention errs by O(1).

    python -m scripts.gpu_checks.fla_kda out=DIR [rehearse=true]    (rehearsal: on the CPU, our chunk form
                                                                    against the recurrent oracle)
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.kda import fla_available, kda_chunk, kda_recurrent, torch_kda_chunk
from scripts.gpu_checks.result import Result, parse_args

TOLERANCE = 5e-3
SHAPES = {"gpu": (2, 300, 4, 64), "rehearse": (1, 40, 2, 8)}  # (B, T, H, K); T ends in a partial chunk
REHEARSAL_CHUNK = 16
NAMES = ["o", "final_state", "d_q", "d_k", "d_v", "d_g", "d_beta", "d_initial_state"]


def inputs(shape, device) -> list[torch.Tensor]:
    B, T, H, K = shape
    gen = torch.Generator(device=device).manual_seed(0)
    randn = functools.partial(torch.randn, device=device, generator=gen)
    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, K)
    g = -torch.rand(H, 1, device=device, generator=gen) * 4 * F.softplus(randn(B, T, H, K) - 3)  # log decays <= 0
    beta = torch.rand(B, T, H, device=device, generator=gen)
    state = randn(B, H, K, K)
    return [q, k, v, g, beta, state]


def document_resets(shape, device) -> torch.Tensor:
    """(B, T) bool: documents of uneven lengths, some shorter than a chunk, one reset on the last token."""
    B, T = shape[:2]
    resets = torch.zeros(B, T, dtype=torch.bool, device=device)
    resets[:, [T // 7, T // 7 + 3, T // 2, T - 1]] = True
    return resets


def run(kernel, tensors: list[torch.Tensor], resets: torch.Tensor | None) -> list[torch.Tensor]:
    """Outputs (and final state) and the gradients of every input under a random weighting of them."""
    used = [t.clone().requires_grad_() for t in (tensors if resets is None else tensors[:5])]
    q, k, v, g, beta = used[:5]
    state = used[5] if resets is None else None
    o, final = kernel(q, k, v, g, beta, q.shape[-1] ** -0.5, initial_state=state, output_final_state=resets is None,
                      resets=resets)
    gen = torch.Generator(device=q.device).manual_seed(1)
    loss = (o * torch.randn(o.shape, device=q.device, generator=gen)).sum()
    if final is not None:
        loss = loss + (final * torch.randn(final.shape, device=q.device, generator=gen)).sum()
    loss.backward()
    return [o.detach(), *([] if final is None else [final.detach()]), *(leaf.grad for leaf in used)]


def errors(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    return {name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
            for name, a, b in zip(names, got, want)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("fla_chunk_kda")
    shape = SHAPES["rehearse" if args.rehearse else "gpu"]
    if args.rehearse:
        under_test, oracle = functools.partial(torch_kda_chunk, chunk_size=REHEARSAL_CHUNK), kda_recurrent
        result.skip("fla chunk_kda on CUDA vs our chunk form: errors of o, final state and every gradient, "
                    "with an initial state and with cu_seqlens")
    elif not fla_available():
        result.problems.append("flash-linear-attention does not import (is the bundle installed? make gpu-bundle)")
        result.finish(args.out, "")
    else:
        under_test, oracle = functools.partial(kda_chunk, impl="auto"), torch_kda_chunk
    tensors = inputs(shape, args.device)
    resets = document_resets(shape, args.device)
    cases = {"initial_state": errors(run(under_test, tensors, None), run(oracle, tensors, None), NAMES),
             "cu_seqlens": errors(run(under_test, tensors, resets), run(oracle, tensors, resets),
                                  [n for n in NAMES if n not in ("final_state", "d_initial_state")])}
    worst = {}
    for case, errs in cases.items():
        for name, error in errs.items():
            print(f"  {case} {name}: max relative error {error:.2e}")
        worst[case] = max(errs.values())
        if not worst[case] <= TOLERANCE:
            result.problems.append(f"{case}: max relative error {worst[case]:.1e} > {TOLERANCE:.0e}")
    result.figures.update(shape_BTHK=list(shape), tolerance=TOLERANCE, max_rel_error=worst, errors=cases)
    pair = "chunk_vs_recurrent" if args.rehearse else "fla_vs_chunk"
    result.finish(args.out, f"{pair} initial_state={worst['initial_state']:.1e} cu_seqlens={worst['cu_seqlens']:.1e} "
                            f"(<= {TOLERANCE:.0e}) B,T,H,K={','.join(map(str, shape))} fp32")


if __name__ == "__main__":
    main()
