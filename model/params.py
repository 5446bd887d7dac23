"""Parameter counts: total, and activated per token (routed experts count top_k / E).

`count_parameters` counts a built model; `config_counts` counts the model a config would build, in plain
integer arithmetic and in time independent of its depth, so that a config (a command line, a checkpoint's
meta.json, an export's config.json) can be sized, and checked against the weights it claims to describe,
before anything is built. Each term mirrors the module that holds it; tests/model/test_params.py compares
the two over every model, variant and option.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model.config import ModelConfig
from model.moe import MoE
from model.residual.geometry import DepthGeometry


def count_parameters(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoE):
            routed = sum(p.numel() for name, p in module.named_parameters(recurse=False) if name.startswith("w_"))
            inactive += routed - routed * module.top_k // module.n_experts
    return {"total": total, "active": total - inactive}


@dataclass(frozen=True)
class ConfigCounts:
    """Elements of the model a ModelConfig builds."""
    total: int      # parameters, as count_parameters(...)["total"]
    active: int     # as count_parameters(...)["active"]
    routed: int     # of total: the routed experts' weight stacks (what expert parallelism splits)
    buffers: int    # persistent buffers (the MoE expert bias), saved in the state dict with the parameters

    @property
    def state(self) -> int:
        """Elements of the model's state dict: what a checkpoint's or an export's model weights hold."""
        return self.total + self.buffers


def _kda(cfg: ModelConfig) -> int:
    d, H, K, W = cfg.d_model, cfg.n_heads, cfg.kda.head_dim, cfg.kda.conv_kernel
    HK = H * K
    projections = 3 * d * HK + d * H + HK * d              # q, k, v, b (beta), o
    convolutions = 3 * HK * W                              # depthwise: one kernel per channel
    decay = d * K + K * HK + H + HK                        # f_proj (two Linears), A_log, dt_bias
    gate = d * HK if cfg.kda.full_rank_output_gate else d * K + K * HK  # g_proj: one Linear or two through K
    gate_bias = HK if cfg.kda.output_gate_bias else 0      # on g_proj's last Linear
    return projections + convolutions + decay + gate + gate_bias + K  # o_norm


def _mla(cfg: ModelConfig) -> int:
    d, H, m = cfg.d_model, cfg.n_heads, cfg.mla
    queries = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    # q_proj, or q_a_proj, q_a_layernorm and q_b_proj
    query = d * queries if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * queries
    gate = d * H * m.v_head_dim if m.output_gate else 0    # g_proj
    return (query + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + gate + H * m.v_head_dim * d)


def _reads(cfg: ModelConfig) -> int:
    """The residual mixer's parameters: every sublayer's read and the final one (model/residual/)."""
    d, r, L = cfg.d_model, cfg.residual, cfg.n_sublayers
    if r.kind == "baseline":
        return 0
    if r.kind == "highway":
        width = d if r.gate == "elementwise" else 1
        return L * (d * width + width)                     # one gated Linear per sublayer, none at the end
    if r.kind == "x0":
        return (L + 1) * 2                                 # (lambda, mu) per read, the final one included
    if r.kind in ("mhc", "hc"):
        m = r.streams
        return L * (2 * m + m * m + d * (2 * m + m * m) + 3)  # the final read is the parameter-free mean
    geometry = DepthGeometry.of(cfg)
    if r.mixing in ("static", "scalars"):
        return geometry.sources_read()                     # one scalar per source of every read
    query = d if r.query == "learned" else d + d * d       # the query, or its norm and projection
    return (L + 1) * (query + (d if r.key_norm else 0))


def config_counts(cfg: ModelConfig) -> ConfigCounts:
    d, n, moe = cfg.d_model, cfg.n_blocks, cfg.moe
    n_mla = cfg.n_mla_blocks
    n_moe = n - cfg.n_dense_layers
    E, inter = moe.n_routed_experts, moe.moe_inter
    width = d if moe.latent_dim is None else moe.latent_dim  # the routed experts' (LatentMoE: the latent)
    routed_per_layer = 3 * E * width * inter
    shared = 3 * d * moe.n_shared_experts * inter
    # LatentMoE's down and up projections and its latent norm
    latent = 0 if moe.latent_dim is None else 2 * d * width + (width if moe.latent_norm else 0)
    per_moe = d * E + routed_per_layer + shared + latent   # router, experts, shared expert, latent
    blocks = (n * 2 * d + n_mla * _mla(cfg) + (n - n_mla) * _kda(cfg)
              + cfg.n_dense_layers * 3 * d * cfg.dense_inter + n_moe * per_moe)
    total = 2 * cfg.vocab_size * d + d + blocks + _reads(cfg)  # embedding, head, final norm
    routed = n_moe * routed_per_layer
    inactive = n_moe * (routed_per_layer - routed_per_layer * moe.top_k // E)
    return ConfigCounts(total=total, active=total - inactive, routed=routed, buffers=n_moe * E)
