"""The Kimi-Linear MoE decoder with baseline / Full / Block AttnRes residuals."""
from __future__ import annotations

import torch

from model.config import ModelConfig


def build_model(config, device: torch.device | str | None = None, seed: int | None = None) -> "Decoder":
    """Build the decoder from a root config (as `trainer.config.load_config` returns) or a ModelConfig.

    On `device="meta"` nothing is allocated or initialised: `model.init.materialise(model, device,
    model.cfg.init_stds, seed)` does both later, for the parts a rank keeps. On any other device
    (default: torch's default device) the weights are initialised from `seed` (default: the root
    config's `seed`, 0 for a bare ModelConfig), the values materialise gives for the same seed; the
    global RNG is neither used nor advanced.
    """
    from model.decoder import Decoder
    from model.init import materialise

    model_cfg = config if isinstance(config, ModelConfig) else config.model
    if seed is None:
        seed = 0 if isinstance(config, ModelConfig) else config.seed
    with torch.device("meta"):
        model = Decoder(model_cfg)
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type == "meta":
        return model
    return materialise(model, device, model_cfg.init_stds, seed)


__all__ = ["ModelConfig", "build_model"]
