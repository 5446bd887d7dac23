"""Kimi Delta Attention kernels: chunkwise for training and prefill, recurrent for decode.

Our chunkwise torch code is the reference and the CPU path. On CUDA tensors, `impl` auto or triton
uses fla-core's fused `chunk_kda` when that optional package imports (it has no CPU path, not even
under the Triton interpreter); `reference` always runs ours.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from kernels.kda.chunk import kda_chunk as torch_kda_chunk
from kernels.kda.recurrent import kda_recurrent


@functools.cache
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
              chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as kernels.kda.chunk.kda_chunk (q, k, g (B, T, H, K); v (B, T, H, V); beta (B, T, H);
    state (B, H, K, V)). fla's chunk length is its own; the recurrence computed is the same."""
    if impl != "reference" and q.is_cuda and fla_available():
        from fla.ops.kda import chunk_kda
        # fla wants q, k and v in one dtype; ours arrive with q, k in fp32 after their L2 norm.
        return chunk_kda(q.to(v.dtype), k.to(v.dtype), v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state)
    return torch_kda_chunk(q, k, v, g, beta, scale, chunk_size, initial_state, output_final_state)


__all__ = ["fla_available", "kda_chunk", "kda_recurrent", "torch_kda_chunk"]
