"""Depth attention ops for AttnRes, dispatched by `impl = auto | torch | triton` (see kernels.select).

The two-phase read (`phase1`, `phase2`) has fused Triton kernels for the softmax kernel in fp32, bf16
and fp16; the sigmoid kernel and fp64 (the tests' oracle precision) always take the reference. The
per-layer read (`depth_attention`) and the other helpers are the reference only. For a few tokens
(decoding) the reference reads stacked sources (`phase1_stacked`, `depth_attention_stacked`).
"""
from __future__ import annotations

import torch

# Names, not the module: an exported model's flattened copy of this package (inference/hf/bundle.py) keeps
# only imports of the form `from MODULE import NAME`.
from kernels.attnres.reference import depth_attention as reference_depth_attention
from kernels.attnres.reference import (depth_attention_stacked, depth_scores, inverse_rms, merge, phase1_stacked,
                                       source_weights, weighted_sum)
from kernels.attnres.reference import phase1 as reference_phase1
from kernels.attnres.reference import phase2 as reference_phase2
from kernels.select import IMPLS, use_triton

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Up to this many tokens (B*T) the reference stacks the sources and reads them in a few large ops
# (decoding is op-overhead bound); above it, it reads them one by one rather than copy them all.
STACK_MAX_TOKENS = 64


def _few_tokens(source: torch.Tensor) -> bool:
    return source.shape[:-1].numel() <= STACK_MAX_TOKENS


def depth_attention(sources: list[torch.Tensor], query: torch.Tensor, inv_rms: list[torch.Tensor] | None,
                    kernel: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The per-layer read (reference only): h (B, T, d) and alpha (N, B, T, H) as in `reference.depth_attention`."""
    read = depth_attention_stacked if _few_tokens(sources[0]) else reference_depth_attention
    return read(sources, query, inv_rms, kernel)


def fused(impl: str, kernel: str, activations: torch.Tensor) -> bool:
    """Whether the two-phase read of these activations runs the fused kernels."""
    return kernel == "softmax" and activations.dtype in TRITON_DTYPES and use_triton(impl, activations)


def phase1(blocks: list[torch.Tensor], queries: torch.Tensor, eps: float | None, kernel: str = "softmax",
           impl: str = "auto", known_inv_rms: list[torch.Tensor] | None = None):
    """Inter-block read for the S queries of one block: (o, m, l, scores) as in `reference.phase1`.

    eps: the key-norm epsilon, None without key norm (queries already carry the key-norm gain).
    known_inv_rms: the blocks' inverse RMS known so far; the reference path extends it and reuses it
    across calls, the fused kernel computes the key norm itself.
    """
    if fused(impl, kernel, blocks[0]):
        from kernels.attnres import triton as kernels
        return kernels.phase1(blocks, queries, eps)
    inv_rms = None
    if eps is not None:
        known = [] if known_inv_rms is None else known_inv_rms
        for block in blocks[len(known):]:
            known.append(inverse_rms(block, queries.shape[1], eps))
        inv_rms = known[:len(blocks)]
    read = phase1_stacked if _few_tokens(blocks[0]) else reference_phase1
    return read(blocks, queries, inv_rms, kernel)


def phase2(o1: torch.Tensor, m1: torch.Tensor, l1: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
           eps: float | None, kernel: str = "softmax", impl: str = "auto"):
    """One sublayer's read of the partial sum merged with its phase-1 read: (h, scores) as in
    `reference.phase2`; eps as in `phase1`."""
    if fused(impl, kernel, partial):
        from kernels.attnres import triton as kernels
        return kernels.phase2(o1, m1, l1, partial, query, eps)
    inv_rms = None if eps is None else inverse_rms(partial, query.shape[0], eps)
    return reference_phase2(o1, m1, l1, partial, query, inv_rms, kernel)


__all__ = ["IMPLS", "depth_attention", "depth_scores", "fused", "inverse_rms", "merge", "phase1", "phase2",
           "source_weights", "weighted_sum"]
