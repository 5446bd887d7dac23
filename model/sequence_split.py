"""What a token mixer needs when its sequence is split across processes (context parallelism).

Everything in the decoder but the token mixers mixes within one token, so a process holding a contiguous
slice of every sequence runs it unchanged. The token mixers reach the rest of the sequence through a
`SequenceSplit` set on them (`KimiDeltaAttention.sequence_split`, `MultiHeadLatentAttention.sequence_split`);
None, the default, means the whole sequence is here. parallel/context.py implements it with collectives;
the model never learns how.
"""
from __future__ import annotations

from typing import Protocol

import torch


class SequenceSplit(Protocol):
    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x (B, T, D), this slice -> (B, n, D): the last n tokens of the slice before it (zeros on the first)."""

    def through_mine(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), this slice -> (B, S, D): every slice from the sequence's start through this one, in
        order (S = T times this slice's index plus one)."""

    def start_state(self, final: torch.Tensor, transition: torch.Tensor) -> torch.Tensor:
        """A linear recurrence's state at this slice's start, from each slice's final state when started
        from zero, final (B, H, K, V), and its transition (B, H, K, K): final state = transition @ start + final."""
