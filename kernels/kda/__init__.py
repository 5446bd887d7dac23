"""Kimi Delta Attention kernels: chunkwise for training and prefill, recurrent for decode.

The oracle is `reference.py`'s token-by-token recurrence (also the one-token decode step); every other
form is tested against it. `chunk.py` is the chunkwise-parallel form in plain torch: the CPU path, and
what `impl="torch"` runs (no fused kernel). On CUDA tensors, `impl` auto or triton
uses fla-core's fused `chunk_kda` when that optional package imports (it has no CPU path, not even
under the Triton interpreter); `torch` always runs ours. With resets (document masking) fla runs
its varlen form: the batch flattened to one row cut into documents at `varlen_offsets`. `kda_chunk_from_unknown_start`
runs one piece of a sequence split across processes (context parallelism) before its start state is known.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch

from kernels.kda.chunk import kda_chunk as torch_kda_chunk
from kernels.kda.reference import kda_recurrent


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
    if impl != "torch" and q.is_cuda and fla_available():
        from fla.ops.kda import chunk_kda
        # fla wants q, k and v in one dtype; ours arrive with q, k in fp32 after their L2 norm.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if resets is None:
            return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)
        if initial_state is not None or output_final_state:
            raise ValueError("kda_chunk: resets with initial_state or output_final_state run on impl='torch' "
                             "only; fla's varlen form keeps one state per document, not per row")
        B, T = resets.shape
        o, _ = chunk_kda(*(t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)), scale=scale,
                         cu_seqlens=varlen_offsets(resets))
        return o.view(B, T, *o.shape[2:]), None
    return torch_kda_chunk(q, k, v, g, beta, scale, chunk_size, initial_state, output_final_state, resets)


def kda_chunk_from_unknown_start(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
        chunk_size: int, start_state: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        impl: str = "auto", resets: torch.Tensor | None = None) -> torch.Tensor:
    """kda_chunk of a piece of a sequence whose state at the piece's start, S_0, comes from earlier pieces
    held elsewhere. The recurrence is linear in (S_0, v) jointly and acts on each state column alone, so one
    run over the augmented values [v, 0] from the augmented state [0, I] (B, H, K, V+K) yields both
    - from the v columns: the outputs and final state F of a zero start;
    - from the I columns: the transition M (final state = M S_0 + F) and per token q_t's read of the
      decayed start, r_t = scale * M_t^T q_t, with which a start S_0 adds S_0^T r_t to output t.
    start_state(F, M) -> S_0 (B, H, K, V) (fp32; chains the pieces' (F, M) in order). Same shapes and
    output dtype as kda_chunk; gradients reach the inputs through both runs' paths and through start_state.
    With resets (document starts) the decomposition still holds (a reset zeroes both parts of the state), but
    fla's varlen form takes no start state per row, so the torch chunk form runs, on CUDA too."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    values = torch.cat([v.to(torch.float32), v.new_zeros(B, T, H, K, dtype=torch.float32)], dim=-1)  # (B, T, H, V+K)
    identity = torch.eye(K, device=q.device).expand(B, H, K, K)  # (B, H, K, K)
    augmented_start = torch.cat([q.new_zeros(B, H, K, V, dtype=torch.float32), identity], dim=-1)  # (B, H, K, V+K)
    o, final = kda_chunk(q, k, values, g, beta, scale, chunk_size, augmented_start, True,
                         impl=impl if resets is None else "torch", resets=resets)
    o_from_zero, start_reads = o.float().split([V, K], dim=-1)  # (B, T, H, V), (B, T, H, K)
    final_from_zero, transition = final.float().split([V, K], dim=-1)  # (B, H, K, V), (B, H, K, K)
    start = start_state(final_from_zero, transition)  # (B, H, K, V)
    return (o_from_zero + torch.einsum("bthk,bhkv->bthv", start_reads, start)).to(q.dtype)


__all__ = ["fla_available", "kda_chunk", "kda_chunk_from_unknown_start", "kda_recurrent", "torch_kda_chunk",
           "varlen_offsets"]
