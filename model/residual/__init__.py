"""Residual mixers, registered by variant name."""
from __future__ import annotations

from model.config import VARIANTS, ModelConfig
from model.residual.attnres import AttnResidual
from model.residual.base import CarryLayout, DepthState, ResidualMixer
from model.residual.geometry import DepthGeometry
from model.residual.baseline import RunningSumResidual
from model.residual.mhc import HyperConnectionResidual
from model.residual.trace import DepthTrace


def build_mixer(cfg: ModelConfig) -> ResidualMixer:
    r = cfg.residual
    if r.kind in ("baseline", "highway", "x0"):
        return RunningSumResidual(cfg.d_model, cfg.n_sublayers, cfg.norm_eps,
                                  gate=r.gate if r.kind == "highway" else None, embedding_skip=r.kind == "x0")
    if r.kind in ("full", "block"):
        return AttnResidual(cfg.d_model, cfg.norm_eps, r, DepthGeometry.of(cfg), cfg.kernel_impl)
    if r.kind in ("mhc", "hc"):
        return HyperConnectionResidual(cfg.d_model, cfg.n_sublayers, cfg.norm_eps, r.streams,
                                       constrained=r.kind == "mhc")
    raise ValueError(f"residual.kind={r.kind!r} is not one of {', '.join(VARIANTS)}")


__all__ = ["VARIANTS", "CarryLayout", "DepthGeometry", "DepthState", "DepthTrace", "ResidualMixer", "build_mixer"]
