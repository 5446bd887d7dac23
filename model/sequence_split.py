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

    def through(self, x: torch.Tensor, end: int) -> torch.Tensor:
        """x (B, T, D), this slice -> (B, end, D): the sequence's x from its start to position `end`, from
        every slice (`end` at most the sequence's end; gradients flow back to the slices)."""

    def scored_pieces(self, length: int) -> list[tuple[int, int]]:
        """(start, length) in the whole sequence of each piece of queries this process scores, in the order
        `balance` lays them out, for a slice of `length` tokens: pieces chosen so that every process does the
        same causal attention work."""

    def balance(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, ...), this slice's queries -> (B, T, ...), the queries of `scored_pieces`, in order."""

    def unbalance(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `balance`: (B, T, ...) per scored piece -> (B, T, ...) in this slice's order."""

    def start_state(self, final: torch.Tensor, transition: torch.Tensor) -> torch.Tensor:
        """A linear recurrence's state at this slice's start, from each slice's final state when started
        from zero, final (B, H, K, V), and its transition (B, H, K, K): final state = transition @ start + final."""
