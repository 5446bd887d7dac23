"""Multi-head latent attention as in Kimi Linear: NoPE (nothing is rotated), no query compression,
and a decode cache that holds only the normalised kv latent plus the shared "rope" slice. With
document_starts (model/documents.py) the causal mask is block-diagonal: a query sees its own document. With a
`sequence_split` (model/sequence_split.py) x is one slice of the sequence, and its queries also attend to the
kv latents of the slices before it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes  # private: pinned torch (setup.py)

from model.config import ModelConfig
from model.documents import check_document_starts, same_document_causal_mask
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

        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(cfg.d_model, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, cfg.norm_eps, cfg.kernel_impl)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.d_model, bias=False)
        self.sequence_split: SequenceSplit | None = None

    def init_weights(self, stds: InitStds) -> None:
        for proj in (self.q_proj, self.kv_a_proj, self.kv_b_proj):
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
        q = self.q_proj(x).view(B, T, H, self.nope_dim + self.rope_dim)  # (B, T, H, nope+rope)
        kv_a = self.kv_a_proj(x)  # (B, T, rank + rope)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, T, rank), (B, T, rope)
        latent = self.kv_a_norm(latent)

        past = 0
        if cache is not None:
            past = cache.length
            latent, k_rope = cache.append(latent, k_rope)  # (B, S, rank), (B, S, rope); S = past + T
        elif split is not None:  # the earlier slices' tokens are this slice's past, gradients included
            latent, k_rope = split.through_mine(torch.cat([latent, k_rope], dim=-1)).split(
                [self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, S, rank), (B, S, rope)
            past = latent.shape[1] - T
        S = latent.shape[1]

        kv = self.kv_b_proj(latent).view(B, S, H, self.nope_dim + self.v_dim)  # (B, S, H, nope+v)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        k_rope = k_rope.unsqueeze(2).expand(B, S, H, self.rope_dim)  # (B, S, H, rope): one slice for all heads
        k = torch.cat([k_nope, k_rope], dim=-1)  # (B, S, H, nope+rope)

        # With a past (cached or on earlier slices), is_causal would align the triangle top-left; query i sits
        # at absolute position past + i. On earlier slices causal_lower_right says so without a (T, S) mask in
        # memory (flash and memory-efficient attention take it as is; 16K x 128K bools would be 2 GiB); a
        # decode step's mask is one row, and compiled decode keeps one graph with a plain tensor.
        mask = None
        if document_starts is not None:
            key_starts = document_starts
            if split is not None:  # the documents of the earlier slices' keys
                key_starts = split.through_mine(document_starts.unsqueeze(-1).float()).squeeze(-1).bool()  # (B, S)
            mask = same_document_causal_mask(key_starts, T)  # (B, 1, T, S)
        elif split is not None and past > 0:
            # A tensor subclass: made outside any dispatch mode (selective checkpointing, memory tracking),
            # which would hand it a plain tensor's storage; SDPA's ops on it still run under the mode.
            with _disable_current_modes():
                mask = causal_lower_right(T, S)
        elif past > 0:
            mask = torch.arange(S, device=x.device) <= (past + torch.arange(T, device=x.device)).unsqueeze(1)  # (T, S)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, H, T|S, D)
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )  # (B, H, T, v)
        out = out.transpose(1, 2).reshape(B, T, H * self.v_dim)  # (B, T, H*v)
        return self.o_proj(out)
