"""Training FLOPs per token of a model configuration (forward + backward = 3 x forward).

Terms, each per token of a training sequence of length T:
  matmul  6 * N_active: every activated weight does one multiply-add forward and two backward.
          N_active excludes the embedding table (a lookup) and counts routed experts as top_k / E (in
          LatentMoE's latent width, whose down and up projections every token runs).
  mla     causal softmax attention: QK^T and AV over T/2 keys on average, per head
          2 * (qk_dim + v_dim) * T / 2 forward.
  kda     the delta-rule state of K x K per head: decay, read k^T S, write k v^T and output S^T q are
          4 multiply-adds of K^2 (8 K^2 forward); the chunkwise form adds intra-chunk attention over
          C/2 positions on average, 2 * 2 * K * C / 2 forward.
  depth   the residual read: AttnRes scores and mixes n sources of width d (2d + 2d forward each, the
          key norms are per block and counted once); mHC reads m streams, mixes m x m and writes m
          streams ((4m + 2m^2) d forward). The baseline's add is O(d) and counted as 0.
Element-wise work (norms, activations, SiTU's tanh and sigmoids included, softmax exponentials) is left
out, as in 6ND.
"""
from __future__ import annotations

from model.config import ModelConfig
from model.params import count_parameters
from model.residual.geometry import DepthGeometry


def active_matmul_params(cfg: ModelConfig) -> int:
    from model import build_model

    model = build_model(cfg, device="meta")
    return count_parameters(model)["active"] - model.embed.weight.numel()


def depth_read_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of all residual reads and writes."""
    r, d = cfg.residual, cfg.d_model
    if r.kind in ("mhc", "hc"):
        m = r.streams
        return cfg.n_sublayers * (4 * m + 2 * m * m) * d
    if r.kind == "baseline":
        return 0.0
    if r.kind == "x0":  # lambda h + mu v_0 at every read, the final one included
        return (cfg.n_sublayers + 1) * 3 * d
    if r.kind == "highway":  # the gate's projection (d -> 1 or d), then (1 - g) h + g v
        width = d if r.gate == "elementwise" else 1
        return cfg.n_sublayers * (2 * d * width + 3 * d)
    geometry = DepthGeometry.of(cfg)
    sources = sum(geometry.n_sources(sublayer) for sublayer in range(1, cfg.n_sublayers + 2))
    return 4 * d * sources


def token_mixer_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs per token of MLA attention and of the KDA recurrence (beyond their projections)."""
    mla_layers = sum(cfg.is_mla(block) for block in range(cfg.n_blocks))
    kda_layers = cfg.n_blocks - mla_layers
    qk_dim = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    mla = mla_layers * cfg.n_heads * (qk_dim + cfg.mla.v_head_dim) * seq_len
    k, chunk = cfg.kda.head_dim, min(cfg.kda.chunk_size, seq_len)
    kda = kda_layers * cfg.n_heads * (8 * k * k + 2 * k * chunk)
    return float(mla), float(kda)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """{'matmul', 'mla', 'kda', 'depth', 'total'}: training FLOPs per token."""
    mla, kda = token_mixer_flops(cfg, seq_len)
    terms = {"matmul": 6.0 * active_matmul_params(cfg), "mla": 3 * mla, "kda": 3 * kda,
             "depth": 3 * depth_read_flops(cfg)}
    terms["total"] = sum(terms.values())
    return terms
