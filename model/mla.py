"""Multi-head latent attention as in Kimi Linear: NoPE (nothing is rotated), no query compression,
and a decode cache that holds only the normalised kv latent plus the shared "rope" slice. K3's options:
the queries through a normalised latent of rank mla.q_lora_rank (q_a_proj, q_a_layernorm, q_b_proj) and an
output gate (mla.output_gate: the heads' outputs times sigmoid(g_proj(x)), x the layer's input). With
document_starts (model/document_masking.py) the causal mask is block-diagonal: a query sees its own document. With a
`sequence_split` (model/sequence_split.py) x is one slice of the sequence: queries are scored in pieces that
balance the causal work across the slices' processes, over keys recomputed from every slice's kv latent."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes  # private: pinned torch (setup.py)

from model.config import ModelConfig
from model.document_masking import check_document_starts, same_document_causal_mask
from model.init import InitStds
from model.norms import RMSNorm
from model.sequence_split import SequenceSplit


@dataclass
class MLACache:
    """Per past token: the kv latent after kv_a_norm and the key slice shared by all heads."""
    latent: torch.Tensor  # (B, T_past, kv_lora_rank)
    rope: torch.Tensor    # (B, T_past, qk_rope_head_dim)

    @property
    def length(self) -> int:
        return self.latent.shape[1]

    def append(self, latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens in place and return the whole history."""
        self.latent = torch.cat([self.latent, latent], dim=1)
        self.rope = torch.cat([self.rope, rope], dim=1)
        return self.latent, self.rope


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mla = cfg.mla
        self.n_heads = cfg.n_heads
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim = mla.qk_nope_head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.v_dim = mla.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim ** -0.5

        latent_eps = cfg.norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.d_model, self.n_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.d_model, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, latent_eps, cfg.kernel_impl)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.n_heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(cfg.d_model, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, latent_eps, cfg.kernel_impl)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(cfg.d_model, self.n_heads * self.v_dim, bias=False) if mla.output_gate else None
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.d_model, bias=False)
        self.sequence_split: SequenceSplit | None = None

    def init_weights(self, stds: InitStds) -> None:
        queries = (self.q_proj,) if self.q_lora_rank is None else (self.q_a_proj, self.q_b_proj)
        gate = () if self.g_proj is None else (self.g_proj,)
        for proj in (*queries, self.kv_a_proj, self.kv_b_proj, *gate):
            nn.init.normal_(proj.weight, std=stds.hidden)
        nn.init.normal_(self.o_proj.weight, std=stds.output)

    def new_cache(self, batch: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> MLACache:
        return MLACache(
            latent=torch.zeros(batch, 0, self.kv_lora_rank, device=device, dtype=dtype),
            rope=torch.zeros(batch, 0, self.rope_dim, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor, cache: MLACache | None = None,
                document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, d). With a cache, x holds the tokens that follow the cached ones; the cache is extended.
        document_starts (B, T) bool, training only: no query sees an earlier document."""
        B, T, _ = x.shape
        H = self.n_heads
        split = self.sequence_split
        if split is not None and cache is not None:
            raise ValueError("MultiHeadLatentAttention: a sequence_split (context parallelism) trains whole slices; "
                             "it takes no decoding cache")
        if document_starts is not None:
            check_document_starts(document_starts, B, T, cache, "MultiHeadLatentAttention")
        q = self._queries(x).view(B, T, H, self.nope_dim + self.rope_dim)  # (B, T, H, nope+rope)
        kv_a = self.kv_a_proj(x)  # (B, T, rank + rope)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, T, rank), (B, T, rope)
        latent = self.kv_a_norm(latent)

        if split is not None:
            return self._output(x, self._split_attention(split, q, latent, k_rope, document_starts))
        past = 0
        if cache is not None:
            past = cache.length
            latent, k_rope = cache.append(latent, k_rope)  # (B, S, rank), (B, S, rope); S = past + T
        k, v = self._keys_values(latent, k_rope)  # (B, S, H, nope+rope), (B, S, H, v)
        S = k.shape[1]
        # With a past, is_causal would align the triangle top-left; query i sits at absolute position past + i.
        mask = None
        if document_starts is not None:
            mask = same_document_causal_mask(document_starts)  # (B, 1, T, T)
        elif past > 0:
            mask = torch.arange(S, device=x.device) <= (past + torch.arange(T, device=x.device)).unsqueeze(1)  # (T, S)
        return self._output(x, self._attend(q, k, v, mask))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) -> the queries (B, T, H*(nope+rope))."""
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _output(self, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, T, H*v), gated by the layer's input x (B, T, d) where mla.output_gate is on,
        -> (B, T, d)."""
        if self.g_proj is not None:
            heads = heads * torch.sigmoid(self.g_proj(x))
        return self.o_proj(heads)

    def _keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised latents (B, S, rank) and shared slices (B, S, rope) -> keys (B, S, H, nope+rope) and
        values (B, S, H, v)."""
        B, S, _ = latent.shape
        kv = self.kv_b_proj(latent).view(B, S, -1, self.nope_dim + self.v_dim)  # (B, S, H, nope+v)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        k_rope = k_rope.unsqueeze(2).expand(B, S, k_nope.shape[2], self.rope_dim)  # (B, S, H, rope): one for all heads
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """q (B, T, H, D) over k, v (B, S, H, .) -> (B, T, H*v); mask None: causal from the first key."""
        B, T = q.shape[:2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, H, T|S, D)
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )  # (B, H, T, v)
        return out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*v)

    def _split_attention(self, split: SequenceSplit, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                         starts: torch.Tensor | None) -> torch.Tensor:
        """One slice of a sequence split across processes -> (B, T, H*v). The queries move to the pieces this
        process scores (equal causal work everywhere), each piece attends over the sequence's keys up to its
        own end, recomputed from every slice's latents (the gathered kv latent and shared slice: small next to
        keys and values), and the outputs move back."""
        pieces = split.scored_pieces(q.shape[1])
        end = max(start + length for start, length in pieces)
        latent, k_rope = split.through(torch.cat([latent, k_rope], dim=-1), end).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, end, rank), (B, end, rope)
        if starts is not None:  # every key's document
            starts = split.through(starts.unsqueeze(-1).float(), end).squeeze(-1).bool()  # (B, end)
        k, v = self._keys_values(latent, k_rope)  # (B, end, H, nope+rope), (B, end, H, v)
        outputs = []
        for (start, length), q_piece in zip(pieces, split.balance(q).split([n for _, n in pieces], dim=1)):
            stop = start + length  # the piece's queries are the last `length` of keys [0, stop)
            if starts is not None:
                mask = same_document_causal_mask(starts[:, :stop], length)  # (B, 1, length, stop)
            else:
                # causal_lower_right aligns the queries with the last keys without a mask in memory (flash and
                # memory-efficient attention take it as is; 16K x 128K bools would be 2 GiB). A tensor subclass:
                # made outside any dispatch mode (selective checkpointing, memory tracking), which would hand
                # it a plain tensor's storage; SDPA's ops on it still run under the mode.
                with _disable_current_modes():
                    mask = causal_lower_right(length, stop)
            outputs.append(self._attend(q_piece, k[:, :stop], v[:, :stop], mask))  # (B, length, H*v)
        return split.unbalance(torch.cat(outputs, dim=1))  # (B, T, H*v)
