"""One transformer block: [token mixer, channel mixer], each a sublayer of the residual mixer."""
from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention
from model.mlp import GatedActivation, GatedMLP
from model.moe import MoE
from model.norms import RMSNorm
from model.residual import DepthState, ResidualMixer
from model.residual.geometry import channel_mixer_sublayer, token_mixer_sublayer


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, mixer: ResidualMixer):
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernel_impl)
        self.attn = MultiHeadLatentAttention(cfg) if cfg.is_mla(index) else KimiDeltaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernel_impl)
        self.mlp = (MoE(cfg) if cfg.is_moe(index)
                    else GatedMLP(cfg.d_model, cfg.dense_inter, GatedActivation.of(cfg.moe)))
        self.attn_res = mixer.make_read(self.attn_sublayer)
        self.mlp_res = mixer.make_read(channel_mixer_sublayer(index))

    @property
    def attn_sublayer(self) -> int:
        return token_mixer_sublayer(self.index)

    def new_cache(self, batch: int, device, dtype):
        """This block's decoding cache: the KDA recurrent state or the MLA compressed KV."""
        return self.attn.new_cache(batch, device, dtype)

    def forward(self, state: DepthState, mixer: ResidualMixer, cache=None,
                document_starts: torch.Tensor | None = None) -> DepthState:
        """`cache` (from new_cache) continues a sequence: the token mixer reads and extends it.
        `document_starts` (model/document_masking.py): the token mixer keeps each token inside its document."""
        if state.next_sublayer != self.attn_sublayer:
            raise RuntimeError(f"block {self.index} expects sublayer {self.attn_sublayer}, "
                               f"the depth state is at {state.next_sublayer}")
        for res, norm, run in ((self.attn_res, self.attn_norm, lambda x: self.attn(x, cache, document_starts)),
                               (self.mlp_res, self.mlp_norm, self.mlp)):
            if state.next_sublayer in state.skipped:
                mixer.skip(state)
            else:
                mixer.write(state, run(norm(mixer.read(state, res))))
        return state
