"""The Kimi-Linear MoE decoder with baseline / Full / Block AttnRes residuals."""
from __future__ import annotations

from model.config import ModelConfig


def build_model(config) -> "Decoder":
    """Build the decoder from a root config (as `trainer.config.load_config` returns) or a ModelConfig."""
    from model.decoder import Decoder

    return Decoder(config if isinstance(config, ModelConfig) else config.model)


__all__ = ["ModelConfig", "build_model"]
