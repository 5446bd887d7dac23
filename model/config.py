"""Typed model configuration. Plain dataclasses: the model never sees Hydra or OmegaConf."""
from __future__ import annotations

from dataclasses import dataclass, field

from model.init import InitStds, init_stds


@dataclass
class KDAConfig:
    head_dim: int = 64          # d_k = d_v per head
    conv_kernel: int = 4        # depthwise causal short convolution on q, k, v
    chunk_size: int = 64        # chunkwise (WY/UT) training form
    gate_lower_bound: float | None = None  # forget gate (log decay) g = lb * sigmoid(exp(A_log) * (f + dt_bias)),
                                           # in (lb, 0), as K3 (fla's lower-bounded gate); None: Kimi Linear's
                                           # unbounded -exp(A_log) * softplus(f + dt_bias)
    full_rank_output_gate: bool = False    # output gate g_proj: one d -> H*K Linear (K3's use_full_rank_gate);
                                           # false: low rank through head_dim. The forget gate stays low rank
    output_gate_bias: bool = True          # a bias on the output gate's last Linear (the released models have none)


@dataclass
class MLAConfig:
    kv_lora_rank: int = 128     # compressed kv width (what decode caches, with the rope slice)
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # shared across heads, never rotated (NoPE)
    v_head_dim: int = 32
    q_lora_rank: int | None = None  # queries through a normalised rank-r latent (q_a_proj, q_a_layernorm, q_b_proj),
                                    # as K3; None: one q_proj, as Kimi Linear
    output_gate: bool = False       # attention output * sigmoid(g_proj(x)) per head channel before o_proj (K3)
    latent_norm_eps: float | None = None  # eps of the kv (and q) latent norms; None: model.norm_eps. The release's
                                          # HF code uses 1e-6 there, vLLM the config's rms_norm_eps


@dataclass
class MoEConfig:
    n_routed_experts: int = 8
    top_k: int = 2
    moe_inter: int = 256        # hidden width of one routed expert
    n_shared_experts: int = 1   # shared gated MLP of width n_shared * moe_inter, added unweighted
    routed_scaling_factor: float = 1.0
    renormalize: bool = True        # the top-k combine weights divided by their sum (+ 1e-20, as the release)
    bias_in_weights: bool = False   # the combine weights read the biased scores (Kimi Linear's released code);
                                    # false: the unbiased ones, the bias steers only the choice (K3, DeepSeek-V3)
    n_expert_groups: int = 1        # grouped top-k (num_expert_group): experts in this many consecutive groups
    topk_groups: int = 1            # topk_group: the groups (by their two best biased scores) a token may use
    activation: str = "swiglu"      # swiglu | situ (K3): the gated activation of every MLP, routed, shared and dense
    situ_beta: float = 4.0          # SiTU gate: beta * tanh(gate / beta) * sigmoid(gate)
    situ_linear_beta: float | None = 25.0  # SiTU up: linear_beta * tanh(up / linear_beta); None: up as it is
    latent_dim: int | None = None   # LatentMoE (K3's routed_expert_hidden_size): the routed experts' width, between
                                    # a down projection before dispatch and an up projection after; None: d_model
    latent_norm: bool = False       # LatentMoE: RMSNorm of the latent top-k sum before the up projection
    bias_update_rate: float = 1e-2  # aux-loss-free balancing step size (1e-3 left experts 2-3x imbalanced at step 100)
    aux_loss_coef: float = 0.0      # optional sequence-level balance loss


VARIANTS = ("baseline", "highway", "x0", "full", "block", "mhc", "hc")
STREAM_VARIANTS = ("mhc", "hc")  # m parallel residual streams: a pipeline cut carries m tensors (B, T, d)


@dataclass
class ResidualConfig:
    """One residual mixer; the paper's ablations are options of it, never new classes."""
    kind: str = "block"             # the residual mixer, one of VARIANTS
    block_size: int | None = None   # sublayers per block (attention and MLP count 1 each); None: ~8 blocks
    query: str = "learned"          # learned | input_dependent
    kernel: str = "softmax"         # softmax | sigmoid
    key_norm: bool = True
    mixing: str = "attention"       # attention | static (softmax of learned scalars) | scalars (raw, DenseFormer)
    heads: int = 1                  # multi-head depth attention
    window: int | None = None       # attend over the last `window` sources plus the embedding
    two_phase: bool | None = None   # Block: Algorithm 1's batched read; None: where its fused kernels run
    streams: int = 4                # mhc, hc: parallel residual streams
    gate: str = "scalar"            # highway: scalar | elementwise (one gate per channel)


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    d_model: int = 256
    n_blocks: int = 8               # transformer blocks; sublayers L = 2 * n_blocks
    n_heads: int = 4
    dense_inter: int = 1024         # SwiGLU width of the dense layer(s)
    n_dense_layers: int = 1         # first blocks use dense SwiGLU instead of MoE
    mla_every: int = 4              # 3 KDA : 1 MLA; the last block is always MLA
    mla_layers: list[int] | None = None  # the MLA blocks, 0-based (the HF config's full_attn_layers less one);
                                         # the others are KDA. None: mla_every decides
    norm_eps: float = 1e-5
    init: str = "scaled"            # scaled (embedding std 1, output projections / sqrt(L), head d^-0.5) | flat (all
                                    # init_std; model/init.py)
    init_std: float = 0.02          # input-side projections; the scheme derives the other stds from it
    kernel_impl: str = "auto"       # auto (Triton on CUDA, plain torch elsewhere) | torch | triton: fused kernels
                                    # (AttnRes two-phase read, PreNorms)
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_blocks

    @property
    def init_stds(self) -> InitStds:
        return init_stds(self.init, self.init_std, self.d_model, self.n_sublayers)

    def is_mla(self, block: int) -> bool:
        if self.mla_layers is not None:
            return block in self.mla_layers
        return block == self.n_blocks - 1 or (block + 1) % self.mla_every == 0

    @property
    def n_mla_blocks(self) -> int:
        if self.mla_layers is not None:
            return len(self.mla_layers)
        return -(-self.n_blocks // self.mla_every)  # every mla_every-th block, and the last one

    def is_moe(self, block: int) -> bool:
        return block >= self.n_dense_layers


NESTED_CONFIGS = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "residual": ResidualConfig}


def model_config_from_dict(values: dict) -> ModelConfig:
    """The inverse of dataclasses.asdict(ModelConfig): the model config an export wrote as JSON. An unknown key
    raises TypeError naming it."""
    return ModelConfig(**{key: NESTED_CONFIGS[key](**value) if key in NESTED_CONFIGS else value
                          for key, value in values.items()})
