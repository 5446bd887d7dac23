"""Memory per rank of a training layout, planned from the model's shapes (scripts/plan_memory.py prints it).

Parameters are counted on a meta-device model (nothing is allocated): each parameter goes to the
pipeline rank whose chunk holds it (parallel/pipeline/plan.py's split), routed experts are divided by
ep, the weights parallel/tensor.py's TP_SPLITS names by tp, and whatever a rank then holds by fsdp, times cp
when fsdp > 1 (FSDP shards over fsdp x cp, parallel/dims.py's build_layout); with fsdp = 1 the cp ranks
hold full replicas (DDP over dp x cp).

Bytes per parameter (what the code does):
  DDP / pp / tp / ep (no fsdp): fp32 weights 4, fp32 grads 4, AdamW exp_avg + exp_avg_sq 8; DDP adds its
    fp32 gradient buckets (4, gradient_as_bucket_view is off); in bf16 (train.precision; auto: on CUDA)
    the autocast copies of the weights are kept for backward (2).
  FSDP2 (parallel/fsdp.py): the fp32 sharded weights, grads and AdamW state (16 / (fsdp * cp)); transient:
    the largest unit all-gathered (in the precision: bf16 or fp32) twice (prefetch) plus its unsharded fp32
    gradient before the reduce-scatter. Under ep the routed experts' ep slices stay out of fully_shard
    (16 per parameter, bf16 autocast copies 2). Under pp (each chunk an FSDP root) parameters stay
    gathered from forward to backward and gradients are reduce-scattered once per step: the rank's
    whole stage gathered plus its unsharded fp32 gradients for the step. On CPU, gloo's all-gather and
    reduce-scatter each stage a full-size copy of the collective's large side (measured in
    docs/BENCHMARKS.md, "Memory planner"): one more unit gathered and one of fp32 gradients. NCCL writes
    into FSDP's buffers in place.
  Host memory at start-up: every layout slices/shards on the meta device and draws the initial weights
    one init unit at a time on the host (parallel/fill.py): 4 bytes per parameter of the largest unit.
  The AdamW step (fused=False: foreach on CUDA) needs one fp32 temporary as large as the rank's
    parameters on CUDA and one parameter's on CPU; it runs after backward, when activations are gone.
  train.float8 (parallel/float8.py, torchao's tensorwise recipe): the weights, gradients and optimizer
    state stay as they are, and a float8 Linear saves the same high-precision input for backward as a
    plain one, recasting in backward. What changes: a converted Linear's matmul casts its fp32 master weight
    itself, so autocast keeps no bf16 copy of it (2 bytes per converted weight fewer where the plan counts
    autocast copies: without FSDP; FSDP gathers bf16 weights either way, and no expert is converted).
    Left out: the float8 copies of one Linear's input and weight, 1 byte per element, alive only
    during its matmul.

Activations: elements saved for backward per token, per sublayer kind (`sublayer_elements`), in the
activation dtype (`a`: bf16 under autocast, else fp32) or forced fp32 (`f`). The counts were
taken from the code (which op keeps which output for backward) and checked op by op with
scripts/bench/memory.py's storage tracker at model=m; the CPU column is the reference kernels (KDA's
torch chunk form, SDPA's math path with its T x T probabilities), the CUDA column fla's chunk_kda and
flash attention.

Context parallelism (parallel/context.py): every rank holds T / (tp * cp) tokens of each sequence, so every
token-local activation and the AttnRes block storage shrink by cp as they do by tp. The token mixers add:
- MLA: every rank gathers the normalised latent + shared rope slice and recomputes K and V from them; rank 0
  holds them for all T tokens (its long zigzag piece ends the sequence), and every rank scores T/cp queries
  against (2cp + 1)/(4cp) T keys on average. Planned as an upper bound: T/cp queries against T keys
  (`mla_elements` with queries T/cp, keys T), which overstates the scores about twofold on CPU's math path;
- KDA: one chunk run over the values augmented to V + K columns from an augmented start state, and the
  all-gathered (cp, B, H, K, V+K) fp32 (final state, transition) pairs (`kda_context_elements`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from model.config import ModelConfig
from model.residual.geometry import DepthGeometry, channel_mixer_sublayer, token_mixer_sublayer, transformer_block_of
from parallel.dims import Degrees, resolve_precision
from parallel.float8 import float8_linear_names
from parallel.tensor import tp_split_names

GIB = 2 ** 30
MIB = 2 ** 20
MODES = ("none", "full", "selective")


@dataclass
class ParamCount:
    """Parameters one rank holds (elements), before fsdp: per kind, and the largest fsdp unit."""
    total_model: int
    rank: int
    routed_experts: int       # of `rank`, already divided by ep
    tp_split: int             # of `rank`, already divided by tp
    largest_unit: int         # the biggest fully_shard unit of this rank, unsharded
    stage: int = 0            # parameters of this rank's pipeline stage before any tp/ep slicing
    float8: int = 0           # of `rank`: weights of the Linears train.float8 converts (float8_weights)
    blocks: list[int] = field(default_factory=list)  # transformer blocks this rank runs


def _block_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def stage_blocks(cfg: ModelConfig, pp: int, vp: int) -> list[list[int]]:
    """Transformer blocks of each pipeline rank (its vp chunks), as parallel/pipeline/plan.py splits them."""
    if pp * vp == 1:
        return [list(range(cfg.n_blocks))]
    from parallel.pipeline.plan import PipelinePlan
    plan = PipelinePlan(cfg, pp, vp, cache=True)
    return [[b for c in plan.chunks_of(rank) for b in plan.chunk_blocks[c]] for rank in range(pp)]


def parameter_sizes(cfg: ModelConfig) -> dict[str, int]:
    """name -> elements of every parameter, from the model built on the meta device (allocates nothing)."""
    from model import build_model
    return {name: p.numel() for name, p in build_model(cfg, device="meta").named_parameters()}


def tp_split_weights(cfg: ModelConfig) -> frozenset[str]:
    """Names of the parameters tp splits (parallel/tensor.py's TP_SPLITS)."""
    from model import build_model
    return tp_split_names(build_model(cfg, device="meta"))


def float8_weights(cfg: ModelConfig, tp: int) -> frozenset[str]:
    """Names of the weights whose Linears train.float8 converts at this tp degree."""
    from model import build_model
    return frozenset(f"{name}.weight" for name in float8_linear_names(build_model(cfg, device="meta"), tp))


def count_rank_parameters(cfg: ModelConfig, layout: Degrees, sizes: dict[str, int] | None = None,
                          float8: frozenset[str] = frozenset(),
                          tp_split: frozenset[str] | None = None) -> list[ParamCount]:
    """One ParamCount per pipeline rank (a tp/ep/fsdp rank of it holds the same amounts). `float8`: the
    weight names train.float8 converts (float8_weights), none without it. `sizes` (parameter_sizes) and
    `tp_split` (tp_split_weights): the model's, found here when not given."""
    params = sizes or parameter_sizes(cfg)
    if tp_split is None:
        tp_split = tp_split_weights(cfg) if layout.tp > 1 else frozenset()
    total = sum(params.values())
    per_rank = stage_blocks(cfg, layout.pp, layout.vp)
    counts = []
    for rank, blocks in enumerate(per_rank):
        first, last = rank == 0, rank == layout.pp - 1
        held = experts = split = whole = converted = 0
        units: dict[object, int] = {}
        for name, numel in params.items():
            block = _block_of(name)
            if block is None:
                keep = (name.startswith("embed.") and first) or (not name.startswith("embed.") and last)
            else:
                keep = block in blocks
            if not keep:
                continue
            n = numel
            whole += n
            if ".mlp.w_" in name:
                n //= layout.ep
                experts += n
            elif layout.tp > 1 and name in tp_split:
                n //= layout.tp
                split += n
            held += n
            converted += n if name in float8 else 0
            if not (".mlp.w_" in name and layout.ep > 1):  # fully_shard ignores the ep slices
                unit = "root" if block is None else block
                units[unit] = units.get(unit, 0) + n
        counts.append(ParamCount(total, held, experts, split, _largest_unit(cfg, units), blocks=blocks, stage=whole,
                                 float8=converted))
    return counts


def _largest_unit(cfg: ModelConfig, per_block: dict) -> int:
    """parallel/fsdp.py's units: consecutive transformer blocks cut where DepthGeometry.units allows (never
    inside a depth block of the two-phase read), then the root (embedding, final read, norm, head)."""
    blocks = sorted(b for b in per_block if b != "root")
    units = DepthGeometry.of(cfg).units(blocks)
    return max([per_block.get("root", 0)] + [sum(per_block[b] for b in unit) for unit in units])


# -- activations -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Elements:
    """Elements per token: `a` in the activation dtype, `f` forced fp32."""
    a: float = 0.0
    f: float = 0.0

    def __add__(self, other: "Elements") -> "Elements":
        return Elements(self.a + other.a, self.f + other.f)

    def scale(self, factor: float) -> "Elements":
        return Elements(self.a * factor, self.f * factor)

    def bytes(self, act_bytes: int) -> float:
        return self.a * act_bytes + self.f * 4


def kda_elements(cfg: ModelConfig, mode: str, cuda: bool, cp: int = 1, seq_len: int = 0) -> Elements:
    """KDA, H heads of K, HK = H*K, chunk C (none = saved for backward; selective = matmul outputs).
    none: input d; q/k/v padded conv inputs 3HK, conv outputs 3HK, SiLU of q, k 2HK; decay input and
    softplus 2HK (fp32; the lower-bounded gate's input and sigmoid alike); gate sigmoid, o_norm products,
    reshape 4HK; low-rank mids 2K (K with the full-rank output gate); norms, beta 6H.
    Chunk form, CPU reference: 16HK + 4HC (grams, the triangular system) + HK^2/C (per-chunk states);
    CUDA fla chunk_kda: q, k casts and v 3HK, g HK and its two C x C matrices 2HC in fp32.
    selective: q/k/v/b/f/g projections 5HK + mids + H, o_proj d; CPU chunk matmuls 3HK + 2HC + HK^2/C.
    cp > 1 adds `kda_context_elements` (seq_len: the whole sequence's tokens)."""
    d, H, K, C = cfg.d_model, cfg.n_heads, cfg.kda.head_dim, cfg.kda.chunk_size
    HK = H * K
    mids = K if cfg.kda.full_rank_output_gate else 2 * K  # the low-rank projections' outputs of width K
    if mode == "selective":
        base = Elements(a=5 * HK + mids + H + d)
        chunk = Elements() if cuda else Elements(a=3 * HK + 2 * H * C + HK * K / C)
    else:
        base = Elements(a=d + 8 * HK + 4 * HK + mids, f=2 * HK + 6 * H)
        chunk = Elements(a=3 * HK, f=HK + 2 * H * C) if cuda else Elements(f=16 * HK + 4 * H * C + HK * K / C)
    return base + chunk + (kda_context_elements(cfg, mode, cuda, cp, seq_len) if cp > 1 else Elements())


def kda_context_elements(cfg: ModelConfig, mode: str, cuda: bool, cp: int, seq_len: int) -> Elements:
    """What KDA keeps on top of `kda_elements` on the last of cp ranks (kda_chunk_from_unknown_start): the
    chunk run sees values [v, 0] of width V + K (V = K = head_dim) from the start [0, I]. Assumed, from the
    code (the CPU column checked with scripts/bench/memory.py's tracker, tests/scripts/test_plan_memory.py):
    - CPU reference chunk: its V-wide saved tensors, the value columns of the triangular system's right side
      and of its solution and the updates u (3HV), and the per-chunk states (HKV/C), grow to V + K; its
      (V+K)-wide fp32 output stays alive as the einsum's start-read operand H(V+K);
    - CUDA fla: q, k reach it uncast in fp32 (the values are fp32), so its 2HK saved copies turn fp32, and its
      bf16 v HV becomes the fp32 values H(V+K); its output is kept like the CPU's (an upper bound: autocast may
      keep a bf16 copy of the start reads, HK, instead);
    - selective: the chunk's V-wide matmul outputs grow to V + K (CPU) and the start read's einsum adds HV;
    - every mode but full: the all-gathered (cp, B, H, K, V+K) fp32 pairs and the cp - 1 chained fp32 starts
      (B, H, K, V) of the last rank, per sequence: over its T/cp tokens that is cp^2 HK(V+K)/T and
      (cp - 1) cp HKV/T per token."""
    H, K, C = cfg.n_heads, cfg.kda.head_dim, cfg.kda.chunk_size
    V = K
    gathered = Elements(f=cp * cp * H * K * (V + K) / seq_len + (cp - 1) * cp * H * K * V / seq_len)
    if mode == "selective":
        chunk = Elements() if cuda else Elements(a=(3 * H + H * K / C) * K)
        return gathered + chunk + Elements(f=H * V)
    if cuda:
        chunk = Elements(a=-2 * H * K - H * V, f=2 * H * K + H * (V + K))
    else:
        chunk = Elements(f=(3 * H + H * K / C) * K)
    return gathered + chunk + Elements(f=H * (V + K))


def mla_elements(cfg: ModelConfig, mode: str, cuda: bool, queries: int, keys: int | None = None) -> Elements:
    """MLA, H heads, rank r, nope n, rope p, v, per query token of `queries` attending over `keys` (default:
    as many; under cp a bound: T/cp queries over all T keys). Per query: input d, kv_a r+p, the
    normalised latent 2r + 1, q H(n+p), the output copy Hv; per key: k H(n+p), and v Hv on CPU, the kv_b
    output H(n+v) on CUDA; CPU math SDPA keeps its causal probabilities H*keys per query, CUDA flash the
    log-sum-exp H. Keys beyond the queries' own slice came through cp's all-gather: per key its latent
    + rope r+p (kv_b_proj's input; the selective policy saves the gather's output, the same size).
    Options: a query LoRA of rank r_q adds its latent, normalised like the kv latent, 3r_q + 1; the output
    gate its sigmoid and the gated heads 2Hv.
    selective: projections H(n+p) + r+p + H(n+v) per key + o_proj d, attention output Hv (+ H*keys scores
    on CPU); q_a_proj's r_q and g_proj's Hv where present."""
    m, d, H = cfg.mla, cfg.d_model, cfg.n_heads
    n, p, r, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    q_rank, gated = m.q_lora_rank or 0, H * v if m.output_gate else 0
    keys = queries if keys is None else keys
    per_query = keys / queries  # a key-side tensor's elements per query token
    gathered = r + p if keys > queries else 0
    if mode == "selective":
        return Elements(a=H * (n + p) + r + p + per_query * (H * (n + v) + gathered) + H * v + d + q_rank + gated
                        + (0 if cuda else H * keys), f=H if cuda else 0)
    query_side = Elements(a=d + r + p + 2 * r + H * (n + p) + H * v + 3 * q_rank + 2 * gated,
                          f=1 + (1 if q_rank else 0))
    if cuda:
        return query_side + Elements(a=per_query * (H * (n + p) + H * (n + v) + gathered), f=H)
    return query_side + Elements(a=per_query * (H * (n + p) + H * v + gathered) + H * keys)


def gated_product_elements(cfg: ModelConfig, inter: int) -> Elements:
    """What a gated MLP's activation (model.moe.activation) keeps for backward per token, `inter` wide.
    swiglu: the gate and up projections' outputs, the SiLU and the product, 4I. situ, in fp32 from the
    projections' outputs (which it does not keep): tanh(gate / beta) and its beta multiple, sigmoid(gate),
    the gate factor, tanh(up / linear_beta) and the up factor, 6I fp32 (5I with linear_beta null: the up
    output cast to fp32 instead of the last two), and the product I."""
    moe = cfg.moe
    if moe.activation == "swiglu":
        return Elements(a=4 * inter)
    return Elements(a=inter, f=(5 if moe.situ_linear_beta is None else 6) * inter)


def gated_mlp_elements(cfg: ModelConfig, inter: int, mode: str) -> Elements:
    """Dense gated MLP: none: input d and the activation's (gated_product_elements); selective: gate, up 2I,
    down d."""
    d = cfg.d_model
    return Elements(a=2 * inter + d) if mode == "selective" else Elements(a=d) + gated_product_elements(cfg, inter)


def moe_elements(cfg: ModelConfig, mode: str, capacity: float) -> Elements:
    """MoE, E experts, top k, expert width I_e, shared width I_s, the experts' rows w wide (d, or LatentMoE's
    latent_dim: what expert parallelism's all-to-alls carry) (dropless; `capacity` scales the routed
    rows a rank computes under ep: the load above the mean). none: input d, router scores E and routing
    indices (fp32/int64, ~8k), per assignment the gathered input, the concatenated and weighted outputs
    3w and the activation's (gated_product_elements of I_e: 4I_e for SwiGLU), the shared expert's of I_s;
    LatentMoE: the up projection's input w, and with latent_norm the norm's input w and inverse RMS (fp32).
    selective: router E, per assignment 2I_e + w, shared 2I_s + d; LatentMoE: its projections' outputs w + d."""
    moe, d = cfg.moe, cfg.d_model
    k, shared = moe.top_k, moe.n_shared_experts * moe.moe_inter
    latent = moe.latent_dim is not None
    w = moe.latent_dim if latent else d
    if mode == "selective":
        return Elements(a=k * capacity * (2 * moe.moe_inter + w) + (2 * shared + d if shared else 0)
                        + (w + d if latent else 0), f=moe.n_routed_experts)
    routed, shared_act = gated_product_elements(cfg, moe.moe_inter), gated_product_elements(cfg, shared)
    latent_a = (2 * w if moe.latent_norm else w) if latent else 0
    latent_f = 1 if latent and moe.latent_norm else 0
    return Elements(a=d + k * capacity * (routed.a + 3 * w) + shared_act.a + latent_a,
                    f=moe.n_routed_experts + 8 * k + 1 + k * capacity * routed.f + shared_act.f + latent_f)


def _reads(cfg: ModelConfig, blocks: list[int]) -> tuple[float, float]:
    """(d-vectors per token saved by the depth reads and writes inside `blocks` under `none`,
    d-vectors per token of the depth state that crosses block boundaries, kept under every mode).
    Inside: each read's output 1 (the PreNorm's input); a read that merges a partial sum (position > 0
    in its depth block) 3 more (the two scaled halves and the numerator) and the write's running sum
    1 unless it is stored as a block or crosses a boundary; a phase-1 read (S, B, T, d) that stays inside
    one transformer block, S. Boundaries: the completed depth blocks b_0..b_n (the block storage),
    the open partial sum after each transformer block, and the phase-1 read of every depth block
    that straddles two transformer blocks (S: alive until its last member has read). The per-layer read
    (variant.two_phase=false) runs no phase 1."""
    geometry = DepthGeometry.of(cfg)
    if not geometry.attends:
        return 2.0 * len(blocks), float(len(blocks))  # baseline: the running sum and the PreNorm input
    S = geometry.size
    inside = boundary = 0.0
    for block in blocks:
        first, last = token_mixer_sublayer(block), channel_mixer_sublayer(block)
        for sublayer in (first, last):
            position = geometry.position(sublayer)
            inside += 1
            if position > 0:
                inside += 3 + int(position < S - 1 and sublayer != last)
            if position == 0 and S > 1 and geometry.two_phase:  # this sublayer runs the depth block's phase 1
                if transformer_block_of(geometry.depth_block_end(sublayer)) == block:
                    inside += S
                else:
                    boundary += S
        boundary += int(geometry.partial_open(last))
    return inside, boundary + geometry.blocks_done(channel_mixer_sublayer(max(blocks)) if blocks else 0)


def block_elements(cfg: ModelConfig, block: int, mode: str, cuda: bool, seq_len: int, capacity: float,
                   cp: int = 1) -> Elements:
    """Saved inside one transformer block (norms and reads excluded) under none/selective, per token of the
    busiest cp rank, bounded by T/cp queries seeing all T keys."""
    if cfg.is_mla(block):
        attn = mla_elements(cfg, mode, cuda, seq_len // cp, seq_len)
    else:
        attn = kda_elements(cfg, mode, cuda, cp, seq_len)
    mlp = moe_elements(cfg, mode, capacity) if cfg.is_moe(block) else gated_mlp_elements(cfg, cfg.dense_inter, mode)
    norms = Elements(f=2) if mode == "none" else Elements()
    return attn + mlp + norms


def activation_elements(cfg: ModelConfig, blocks: list[int], mode: str, *, last: bool, cuda: bool,
                        seq_len: int, capacity: float = 1.0, cp: int = 1) -> dict[str, Elements]:
    """Per token of one microbatch (of the busiest cp rank under cp), for the transformer blocks a rank runs:
    {'blocks', 'depth_state', 'head'}. 'blocks': inside the blocks (nothing under full); 'depth_state': the
    AttnRes block storage and what crosses block boundaries, kept in every mode (b_0, the embedding, is one of
    the blocks);
    'head' (last stage): the final read and norm 3d and the loss's fp32 log-softmax V."""
    d = cfg.d_model
    inner = Elements()
    if mode != "full":
        for block in blocks:
            inner = inner + block_elements(cfg, block, mode, cuda, seq_len, capacity, cp)
    inside, boundary = _reads(cfg, blocks)
    if mode == "none":
        inner = inner + Elements(a=inside * d)
    head = Elements(a=3 * d, f=cfg.vocab_size) if last else Elements()
    return {"blocks": inner, "depth_state": Elements(a=boundary * d), "head": head}


# -- the plan ----------------------------------------------------------------------------------------

@dataclass
class Plan:
    layout: Degrees
    mode: str
    device: str
    params: int = 0
    param_bytes: float = 0
    grad_bytes: float = 0
    optimizer_bytes: float = 0
    ddp_bucket_bytes: float = 0
    autocast_copy_bytes: float = 0
    activation_bytes: float = 0        # all microbatches in flight
    activation_per_microbatch: float = 0
    depth_state_bytes: float = 0       # AttnRes block storage, all microbatches in flight (within activation_bytes)
    in_flight: int = 1
    transient_bytes: float = 0         # fsdp gathered unit(s) + unsharded grads; a recomputed block
    optimizer_step_bytes: float = 0    # AdamW temporaries (after backward)
    runtime_bytes: float = 0           # CPU: the Python/torch process itself
    stage: int = 0                     # the pipeline rank planned (the largest)
    host_start_bytes: float = 0        # host RAM per rank at start-up: one init unit drawn in fp32 (bounded by the largest unit)
    activations_by_mode: dict = field(default_factory=dict)

    @property
    def static_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.ddp_bucket_bytes + self.runtime_bytes)

    @property
    def total_bytes(self) -> float:
        backward = self.autocast_copy_bytes + self.activation_bytes + self.transient_bytes
        return self.static_bytes + max(backward, self.optimizer_step_bytes)


def in_flight_microbatches(layout: Degrees, microbatches: int) -> float:
    """Microbatches whose activations pipeline rank 0 holds at once, in units of its whole stage.
    1F1B: pp. Interleaved 1F1B: (vp - 1) * pp + 2 * (pp - 1) + 1 chunk-microbatches warm up before the
    first backward, each 1/vp of the stage (torch.distributed.pipelining, as Megatron)."""
    if layout.pp == 1:
        return 1
    if layout.vp == 1:
        return min(layout.pp, microbatches)
    chunks = min((layout.vp - 1) * layout.pp + 2 * (layout.pp - 1) + 1, microbatches * layout.vp)
    return chunks / layout.vp


def plan(cfg: ModelConfig, layout: Degrees, *, seq_len: int, micro_batch: int, microbatches: int, mode: str,
         device: str = "cuda", capacity: float = 1.25, runtime_bytes: float = 0,
         counts: list[ParamCount] | None = None, stage: int | None = None, precision: str = "auto",
         float8: bool = False) -> Plan:
    """The memory of pipeline rank `stage`, or of the largest one (most parameters + activations).
    `device` picks the kernels (and gloo's staging copies on CPU), `precision` (train.precision) the dtypes,
    `float8` (train.float8) the counts' converted weights when `counts` is not given (given: theirs)."""
    cuda = device == "cuda"
    bf16 = resolve_precision(precision, torch.device(device)) == torch.bfloat16
    act = 2 if bf16 else 4
    if counts is None:
        counts = count_rank_parameters(cfg, layout, float8=float8_weights(cfg, layout.tp) if float8 else frozenset())
    tokens = micro_batch * seq_len / layout.sequence_ranks  # cp slices, each cut tp ways by sequence parallelism
    ep_capacity = capacity if layout.ep > 1 else 1.0
    best = None
    for rank, count in enumerate(counts):
        if stage is not None and rank != stage:
            continue
        per_mode = {}
        for m in MODES:
            parts = activation_elements(cfg, count.blocks, m, last=rank == layout.pp - 1,
                                        cuda=cuda, seq_len=seq_len, capacity=ep_capacity, cp=layout.cp)
            per_mode[m] = {k: v.bytes(act) * tokens for k, v in parts.items()}
        flight = in_flight_microbatches(layout, microbatches) if rank == 0 else \
            max(1.0, in_flight_microbatches(layout, microbatches) - rank / layout.vp)
        p = Plan(layout, mode, device, params=count.rank, in_flight=flight, stage=rank, runtime_bytes=runtime_bytes)
        shard = layout.fsdp * layout.cp if layout.fsdp > 1 else 1  # FSDP shards over fsdp x cp
        plain = count.routed_experts if layout.ep > 1 and shard > 1 else 0  # ep slices fully_shard leaves out
        sharded = count.rank - plain
        state = sharded / shard + plain
        p.param_bytes, p.grad_bytes, p.optimizer_bytes = 4 * state, 4 * state, 8 * state
        if shard > 1:
            gathered = 2 if bf16 else 4
            if layout.pp > 1:  # reshard_after_forward=False and one reduce-scatter per step: all of it, all step
                p.transient_bytes = (gathered + 4) * sharded
            else:
                p.transient_bytes = (2 * gathered + 4) * count.largest_unit
            if not cuda:  # gloo stages a full-size copy of an all-gather's output and a reduce-scatter's input
                p.transient_bytes += (gathered + 4) * count.largest_unit
            p.autocast_copy_bytes = 2 * plain if bf16 else 0
        else:
            if layout.dp * layout.cp > 1:
                # DDP (over dp x cp) ignores expert slices under ep (they average over their own ranks)
                p.ddp_bucket_bytes = 4 * (count.rank - (count.routed_experts if layout.ep > 1 else 0))
            if bf16:
                p.autocast_copy_bytes = 2 * (count.rank - count.float8)
        p.optimizer_step_bytes = 4 * state if cuda else 0
        p.host_start_bytes = 4 * count.largest_unit  # parallel.fill: one init unit at a time, every layout
        p.activations_by_mode = {m: sum(v.values()) * flight for m, v in per_mode.items()}
        p.activation_per_microbatch = sum(per_mode[mode].values())
        p.activation_bytes = p.activation_per_microbatch * flight
        if mode != "none":  # backward recomputes one block at a time: its `none` activations live briefly
            recomputed = (block_elements(cfg, b, "none", cuda, seq_len, ep_capacity, layout.cp) for b in count.blocks)
            p.transient_bytes += max(e.bytes(act) for e in recomputed) * tokens
        p.depth_state_bytes = per_mode[mode]["depth_state"] * flight
        if best is None or p.total_bytes > best.total_bytes:
            best = p
    return best


# -- the search -------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(cfg: ModelConfig, gpus: int, seq_len: int, max_tp: int = 8, micro_batch: int | None = None,
                      global_batch: int | None = None) -> list[Degrees]:
    """Every (dp, fsdp, cp, pp, vp, tp, ep) with dp*fsdp*cp*pp*tp = gpus, tp at most `max_tp` (one node) and
    vp in {1, 2}, that the layout's rules allow (`Degrees.problems`; the batch's where it is given)."""
    out = []
    for tp, cp, pp in itertools.product(_divisors(gpus), repeat=3):
        if tp > max_tp or gpus % (tp * cp * pp):
            continue
        rest = gpus // (tp * cp * pp)
        for fsdp in _divisors(rest):
            dp = rest // fsdp
            for ep in _divisors(dp):
                for vp in (1, 2) if pp > 1 else (1,):
                    layout = Degrees(dp=dp, fsdp=fsdp, pp=pp, vp=vp, tp=tp, ep=ep, cp=cp)
                    if not layout.problems(cfg, seq_len, micro_batch, global_batch):
                        out.append(layout)
    return out


def search(cfg: ModelConfig, *, gpus: int, gpu_bytes: float, headroom: float, seq_len: int, micro_batch: int,
           global_batch: int, device: str = "cuda", capacity: float = 1.25,
           precision: str = "auto", float8: bool = False) -> list[Plan]:
    """Layouts x checkpointing modes that fit in gpu_bytes * (1 - headroom), best first: fewest pipeline
    stages (bubble and message traffic), then least recomputation (none < selective < full), then least
    tensor parallelism, then least context parallelism (its gathers and all-to-alls), then the most memory
    left."""
    budget = gpu_bytes * (1 - headroom)
    fitting = []
    counted: dict[tuple, list[ParamCount]] = {}  # by the degrees that shape a rank's parameters
    sizes, tp_split = parameter_sizes(cfg), tp_split_weights(cfg)
    for layout in candidate_layouts(cfg, gpus, seq_len, micro_batch=micro_batch, global_batch=global_batch):
        microbatches = global_batch // (micro_batch * layout.data_ranks)
        key = (layout.pp, layout.vp, layout.tp, layout.ep)
        if key not in counted:
            converted = float8_weights(cfg, layout.tp) if float8 else frozenset()
            counted[key] = count_rank_parameters(cfg, replace(layout, dp=1, fsdp=1), sizes, converted, tp_split)
        for mode in MODES:
            p = plan(cfg, layout, seq_len=seq_len, micro_batch=micro_batch, microbatches=microbatches, mode=mode,
                     device=device, capacity=capacity, counts=counted[key], precision=precision)
            if p.total_bytes <= budget:
                fitting.append(p)
    order = {"none": 0, "selective": 1, "full": 2}
    fitting.sort(key=lambda p: (p.layout.pp * p.layout.vp, order[p.mode], p.layout.tp, p.layout.cp,
                                p.total_bytes))
    return fitting
