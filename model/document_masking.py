"""Document masking: where the documents of packed training windows start, and the masks that keep the
token mixers inside one document.

A training window is a slice of the token stream trainer/data writes, where every document is followed by
the end-of-text token. That token belongs to the document it ends (as Megatron and fla's cu_seqlens count
it): the token after it starts the next document. With document masking no token sees an earlier document
of its window: MLA attends within its document, and KDA's state and short convolution restart at every
document start. The rest of the decoder (norms, MLPs, MoE routing, the AttnRes depth reads) mixes within one
token and needs nothing.

The layout travels as `document_starts`: (B, T) bool, True at every token that starts a document after the
first of its row. The first token of a window has nothing before it, so whether a document starts there
does not matter.
"""
from __future__ import annotations

import torch


def document_starts(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """tokens (B, T) -> (B, T) bool: True at each token right after an end-of-text token `eot_id`."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eot_id
    return starts


def refuse_with_cache(starts: torch.Tensor | None, cache: object | None, where: str) -> None:
    """Document masking is for training on packed windows; a decoding cache continues one sequence."""
    if starts is not None and cache is not None:
        raise ValueError(f"{where}: document_starts was given with a decoding cache; document masking is a "
                         "training feature (packed windows from scratch), so decode with document_starts=None")


def check_document_starts(starts: torch.Tensor, batch: int, length: int, cache: object | None, where: str) -> None:
    """What a token mixer checks before it masks its input (B = batch, T = length) by document."""
    refuse_with_cache(starts, cache, where)
    if starts.dtype != torch.bool or tuple(starts.shape) != (batch, length):
        raise ValueError(f"{where}: document_starts must be a bool tensor of the token mixer's input shape "
                         f"({batch}, {length}); got {starts.dtype} of shape {tuple(starts.shape)}")


def document_index(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, T) long: each token's document, counted from 0 within its row."""
    return starts.long().cumsum(1)


def same_document_causal_mask(starts: torch.Tensor, queries: int | None = None) -> torch.Tensor:
    """(B, S) bool starts of the keys -> (B, 1, T, S) bool attention mask for the last T = `queries` of them
    (default all): query t, at key position S - T + t, sees key j <= S - T + t of its own document."""
    index = document_index(starts)  # (B, S)
    S = starts.shape[1]
    T = S if queries is None else queries
    causal = torch.ones(T, S, dtype=torch.bool, device=starts.device).tril(S - T)  # (T, S)
    return ((index[:, S - T:].unsqueeze(2) == index.unsqueeze(1)) & causal).unsqueeze(1)  # (B, 1, T, S)


def same_document_window(starts: torch.Tensor, width: int, previous: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool -> (B, T, width) bool: [b, t, i] says whether input t - (width - 1) + i of a causal
    window is in token t's document. previous (B, width - 1) bool: the starts of the width - 1 tokens before
    these (a sequence split across processes); None: the sequence starts here, and the positions before it
    (the convolution's zero padding) count as the first token's document: their inputs are zero either way."""
    if previous is None:
        index = document_index(starts)  # (B, T)
        padded = torch.cat([index[:, :1].expand(-1, width - 1), index], dim=1)  # (B, width-1+T)
    else:
        padded = document_index(torch.cat([previous, starts], dim=1))  # (B, width-1+T)
    return padded.unfold(1, width, 1) == padded[:, width - 1:].unsqueeze(-1)  # (B, T, width)
