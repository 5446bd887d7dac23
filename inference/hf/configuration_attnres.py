"""transformers config of an exported AttnRes decoder: our ModelConfig as a JSON object, plus the fields
transformers' tools read (vocab_size, hidden_size, num_hidden_layers, max_position_embeddings)."""
from __future__ import annotations

import dataclasses

from transformers import PreTrainedConfig

from model.config import ModelConfig, model_config_from_dict

# The exported code carries only the plain-torch reference kernels (no Triton, no fla).
EXPORTED_KERNEL_IMPL = "torch"


class AttnResConfig(PreTrainedConfig):
    model_type = "attnres"

    attnres_model: dict | None = None        # dataclasses.asdict(ModelConfig)
    max_position_embeddings: int = 2048      # the trained context (train.seq_len)
    use_cache: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.attnres_model is None:
            self.attnres_model = dataclasses.asdict(ModelConfig())
        model_cfg = self.model_config()
        self.vocab_size = model_cfg.vocab_size
        self.hidden_size = model_cfg.d_model
        self.num_hidden_layers = model_cfg.n_blocks
        self.num_attention_heads = model_cfg.n_heads
        super().__post_init__(**kwargs)

    def model_config(self) -> ModelConfig:
        try:
            model_cfg = model_config_from_dict(self.attnres_model)
        except TypeError as error:
            raise ValueError(f"config.json's attnres_model is not an AttnRes model config ({error})") from None
        return dataclasses.replace(model_cfg, kernel_impl=EXPORTED_KERNEL_IMPL)
