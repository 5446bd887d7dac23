"""Kimi Delta Attention kernels: chunkwise for training and prefill, recurrent for decode.

Our chunkwise torch code is the reference and the CPU path. On CUDA tensors, `impl` auto or triton
uses fla-core's fused `chunk_kda` when that optional package imports (it has no CPU path, not even
under the Triton interpreter); `reference` always runs ours. With resets (document masking) fla runs
its varlen form: the batch flattened to one row cut into documents at `varlen_offsets`.
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


def varlen_offsets(resets: torch.Tensor) -> torch.Tensor:
    """resets (B, T) bool -> cu_seqlens (N + 1,) long: where each of the N documents of the batch, flattened
    to B*T tokens, begins, then B*T. Every row's first token begins one, reset or not."""
    B, T = resets.shape
    begins = resets.clone()
    begins[:, 0] = True
    positions = begins.flatten().nonzero().squeeze(1)  # (N,)
    return torch.cat([positions, positions.new_tensor([B * T])])


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
              chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              impl: str = "auto", resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as kernels.kda.chunk.kda_chunk (q, k, g (B, T, H, K); v (B, T, H, V); beta (B, T, H);
    state (B, H, K, V); resets (B, T) bool). fla's chunk length is its own; the recurrence computed is the same."""
    if impl != "reference" and q.is_cuda and fla_available():
        from fla.ops.kda import chunk_kda
        # fla wants q, k and v in one dtype; ours arrive with q, k in fp32 after their L2 norm.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if resets is None:
            return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)
        if initial_state is not None or output_final_state:
            raise ValueError("kda_chunk: resets with initial_state or output_final_state run on impl='reference' "
                             "only; fla's varlen form keeps one state per document, not per row")
        B, T = resets.shape
        o, _ = chunk_kda(*(t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)), scale=scale,
                         cu_seqlens=varlen_offsets(resets))
        return o.view(B, T, *o.shape[2:]), None
    return torch_kda_chunk(q, k, v, g, beta, scale, chunk_size, initial_state, output_final_state, resets)


__all__ = ["fla_available", "kda_chunk", "kda_recurrent", "torch_kda_chunk", "varlen_offsets"]
