"""The Kimi-Linear-style decoder with a pluggable residual mixer.

Any part may be None (a pipeline stage is this module with the other parts deleted): `embed` only on
the first stage, `norm`/`lm_head`/`final_res` only on the last; `layers` is a ModuleDict keyed by the
global block index so parameter names stay the same in every layout.

Constructing a Decoder does not initialise it (on the meta device it allocates nothing either):
`model.build_model` does, or `model.init.materialise` allocates and initialises the parts a rank keeps.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from model.config import ModelConfig
from model.document_masking import refuse_with_cache
from model.init import InitStds
from model.layer import TransformerBlock
from model.moe import MoE
from model.norms import RMSNorm
from model.residual import DepthState, DepthTrace, build_mixer
from model.residual.geometry import channel_mixer_sublayer


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that initialises itself, so a stage without the head draws the same embedding."""

    def init_weights(self, stds: InitStds) -> None:
        nn.init.normal_(self.weight, std=stds.embedding)


class LMHead(nn.Linear):
    """nn.Linear that initialises itself, so a stage without the embedding draws the same head."""

    def init_weights(self, stds: InitStds) -> None:
        nn.init.normal_(self.weight, std=stds.head)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.mixer = build_mixer(cfg)
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, self.mixer) for i in range(cfg.n_blocks)})
        self.final_res = self.mixer.make_read(cfg.n_sublayers + 1)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernel_impl)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, diagnostics: dict | None = None,
                cache: dict[int, object] | None = None, trace: DepthTrace | None = None,
                skip: frozenset[int] = frozenset(), document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). Pass a dict as `diagnostics` to have it filled with
        per-sublayer output RMS and mean depth-attention weights; pass `cache` (new_inference_cache)
        to continue a sequence token by token or chunk by chunk; pass a DepthTrace to have it filled
        with the depth-mixing matrix M per token; `skip`: sublayers (1..L) that do not run (ReSkip);
        `document_starts` (B, T) bool (model.document_masking.document_starts), training only: no token sees an
        earlier document of its window. Under sequence parallelism it covers the whole sequence the token
        mixers see, not this rank's slice of `tokens`."""
        if skip and trace is not None:
            raise ValueError("a depth trace of a model with skipped sublayers is not defined")
        refuse_with_cache(document_starts, cache, "Decoder.forward")
        embedding = self.embed(tokens)
        state = self.mixer.start(embedding)
        state.diagnostics, state.skipped = diagnostics, set(skip)
        if trace is not None:
            self.mixer.start_trace(state, trace, embedding)
        state = self.forward_layers(state, cache, document_starts=document_starts)
        return self.read_out(state)

    def forward_layers(self, state: DepthState, cache: dict[int, object] | None = None,
                       blocks: Iterable[TransformerBlock] | None = None,
                       document_starts: torch.Tensor | None = None) -> DepthState:
        """Run `blocks` (default: all of this module's) in order over the depth state: the whole model, or
        the consecutive blocks of one pipeline chunk (parallel/pipeline/stage.py runs its chunks here).
        `document_starts`: as in forward, for the microbatch the state belongs to."""
        blocks = list(self.layers.values() if blocks is None else blocks)
        state.reads = self.depth_reads(blocks)
        for block in blocks:
            decoding_cache = None if cache is None else cache[block.index]
            state = block(state, self.mixer, decoding_cache, document_starts)
        return state

    def read_out(self, state: DepthState) -> torch.Tensor:
        """The final depth read, norm and head: logits (B, T, vocab)."""
        return self.lm_head(self.norm(self.mixer.final(state, self.final_res)))

    def new_inference_cache(self, batch: int, device, dtype) -> dict[int, object]:
        """Per-block decoding caches. Depth attention mixes within one token, so nothing else is kept."""
        return {block.index: block.new_cache(batch, device, dtype) for block in self.layers.values()}

    @staticmethod
    def depth_reads(blocks: list[TransformerBlock]) -> dict[int, nn.Module]:
        """Sublayer -> depth-read parameters of `blocks`."""
        reads = {}
        for block in blocks:
            reads[block.attn_sublayer] = block.attn_res
            reads[channel_mixer_sublayer(block.index)] = block.mlp_res
        return reads

    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.layers.values() if isinstance(block.mlp, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE sequence-level balance losses of the last forward (0 when disabled)."""
        losses = [moe.aux_loss for moe in self.moe_layers()]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    @torch.no_grad()
    def update_moe_bias(self) -> None:
        """Aux-loss-free balancing: the trainer calls this once per optimizer step."""
        for moe in self.moe_layers():
            moe.update_bias()
