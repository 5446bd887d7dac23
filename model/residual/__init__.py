"""Residual mixers, registered by variant name."""
from __future__ import annotations

from model.config import ModelConfig
from model.residual.attnres import AttnResidual
from model.residual.base import DepthState, ResidualMixer
from model.residual.baseline import BaselineResidual
from model.residual.mhc import HyperConnectionResidual

VARIANTS = ("baseline", "full", "block", "mhc")


def build_mixer(cfg: ModelConfig) -> ResidualMixer:
    variant = cfg.residual.variant
    if variant == "baseline":
        return BaselineResidual(cfg.d_model, cfg.n_sublayers, cfg.norm_eps)
    if variant in ("full", "block"):
        return AttnResidual(cfg.d_model, cfg.n_sublayers, cfg.norm_eps, cfg.residual, cfg.block_size,
                            cfg.kernel_impl)
    if variant == "mhc":
        return HyperConnectionResidual(cfg.d_model, cfg.n_sublayers, cfg.norm_eps, cfg.residual.streams)
    raise ValueError(f"residual.variant={variant!r} is not one of {', '.join(VARIANTS)}")


__all__ = ["VARIANTS", "DepthState", "ResidualMixer", "build_mixer"]
