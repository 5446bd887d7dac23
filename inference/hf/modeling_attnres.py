"""transformers model of an exported AttnRes decoder: our Decoder, unchanged, behind PreTrainedModel and
GenerationMixin, so that from_pretrained, generate and the Trainer-style `labels=` loss work.

Decoding keeps our own cache (the KDA recurrent state and the MLA compressed KV per block; depth attention
mixes within one token, so nothing else is kept): it is created by the first forward with use_cache and
handed back in the output, which generate() passes to the next step. It cannot be cropped or reordered, so
assisted generation and beam search are refused. Neither KDA nor MLA uses positions, and a pad token would
enter KDA's state: an attention_mask that masks anything is refused rather than silently ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from model.decoder import Decoder
from model.init import initialise
from inference.hf.configuration_attnres import AttnResConfig

# The output's cache field: `cache` from transformers 5.2x, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class DecodingCache:
    """Our per-block inference caches for one batch, and how many tokens they have seen."""

    is_compileable = False  # generate() must not build a static-cache compiled step around it

    def __init__(self, blocks: dict[int, object]):
        self.blocks = blocks
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens


class AttnResForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnResConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _is_stateful = True  # the cache cannot roll back: no assisted generation

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = Decoder(config.model_config())
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own DecodingCache, as transformers' state-space models do

    def _init_weights(self, module: torch.nn.Module) -> None:
        """A model built from a config (not from weights) draws our own initialisation, seed 0."""
        if module is self.model:
            initialise(self.model, self.model.cfg.init_stds, seed=0)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def new_cache(self, batch: int) -> DecodingCache:
        weight = self.model.lm_head.weight
        return DecodingCache(self.model.new_inference_cache(batch, weight.device, weight.dtype))

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: DecodingCache | None = None, past_key_values: DecodingCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                logits_to_keep: int = 0, **unused) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T, vocab) (the last logits_to_keep positions when > 0); with labels
        (B, T), the mean next-token cross-entropy over labels != -100."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("attention_mask masks some tokens: this model has no padding (a pad token would enter "
                             "KDA's state); generate prompts of one length together, or one at a time")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = self.new_cache(input_ids.shape[0])
        logits = self.model(input_ids, cache=cache.blocks if use_cache else None)  # (B, T, vocab)
        if use_cache:
            cache.seen_tokens += input_ids.shape[1]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
