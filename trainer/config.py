"""Typed, validated configuration composed from the Hydra configs in `configs/`.

`load_config(overrides)` is what tests and scripts call; `trainer.main` gets the same typed object
from its @hydra.main config through `to_typed`. Every error is one line naming the key, the bad value
and what is allowed, raised before any work starts.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kernels.select import IMPLS, triton_refusal
from model.config import VARIANTS, ModelConfig, ResidualConfig
from model.init import INIT_SCHEMES
from model.mlp import ACTIVATIONS
from model.params import config_counts
from parallel.compat import context_parallel_refusal
from parallel.dims import PRECISIONS, Degrees

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line."""


@dataclass
class RunConfig:
    dir: str = "runs/default"


@dataclass
class TrainConfig:
    """The defaults are a CPU-sized run of model=s (`make train`: a few minutes on 2 cores); scale steps, seq_len
    and the batches up on GPUs."""
    steps: int = 100
    stop_after: int | None = None     # stop cleanly (with a checkpoint) after this many steps of this launch
    seq_len: int = 128
    micro_batch: int = 8              # sequences per forward on one rank
    global_batch: int = 16            # sequences per optimizer step over all ranks (accumulation fills the gap)
    log_every: int = 5
    eval_every: int = 25
    eval_batches: int = 8
    ckpt_every: int = 50
    keep_last: int = 3
    diag_every: int = 50
    grad_clip: float = 1.0
    max_bad_steps: int = 5            # consecutive non-finite steps before the run stops
    schedule: str = "wsd"             # wsd | cosine
    warmup_steps: int = 10
    decay_fraction: float = 0.2       # wsd: the last 20% of steps decay linearly
    min_lr_ratio: float = 0.1
    allow_lr_change: bool = False     # resume even if the new schedule's LR differs from the checkpoint's
    activation_checkpointing: str = "none"  # none | full | selective, per transformer block (parallel/activation_checkpoint.py)
    compile: bool = False             # torch.compile each transformer block (parallel/compile.py)
    precision: str = "auto"           # auto (bf16 on CUDA, fp32 elsewhere) | bf16 | fp32; parallel/dims.py
    float8: bool = False              # token mixers' and MLPs' matmuls in float8 (torchao; parallel/float8.py)
    peak_tflops: float | None = None  # the device's peak for mfu; null: trainer/mfu.py's table (unknown on CPU)
    trainable: str = "all"            # all | residual (depth reads only) | norms (RMSNorm gains only); trainer/retrofit.py
    unfreeze_after: int | None = None  # every parameter trains after this many steps; null: never
    hang_after_s: float | None = None  # a step running longer dumps every thread's stack (trainer/hang.py); null: 10x the median step, >= 300 s
    eval_tasks: list[str] = field(default_factory=list)  # lm_eval tasks run on the live model (trainer/downstream.py)
    eval_tasks_every: int | None = None  # steps between them (and at the last step); null: train.eval_every
    eval_tasks_limit: float | None = None  # examples per task (a fraction below 1: that share); null: all


@dataclass
class OptimConfig:
    name: str = "adamw"               # adamw | muon (Muon for 2-D weight matrices, AdamW at lr for the rest)
    # Tuned for the baseline (configs/experiment/lr_sweep.yaml, model=s, seeds 0 and 1, docs/RESULTS.md): mean
    # final loss 2e-3: 5.3357, 3e-3: 5.3376, 4e-3: 5.3357 (flat within 0.002; seed std ~0.03), 1e-3 and 8e-3
    # worse; a parabola in log lr through the best three has its minimum at 2.4e-3. 3e-3 is kept; every
    # variant reuses it unchanged (the paper's protocol), and each AttnRes variant's own best of
    # {1.5e-3, 3e-3, 6e-3} is 3e-3 as well.
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    muon_lr: float = 0.02
    muon_momentum: float = 0.95


@dataclass
class DataConfig:
    path: str | None = None           # null: Shakespeare; text files (.txt/.jsonl[.gz|.zst]/.parquet, a directory or
                                      # glob), a prepared dataset, a Megatron prefix
    blend: list[Any] | None = None    # Megatron's --data-path: [0.3, PATH_A, 0.7, PATH_B] or [{weight, path}, ...]
    split: str = "98,2,0"             # train, valid, test shares of each source's documents (Megatron's --split)
    cache_dir: str | None = None      # prepared datasets and megatron-core's sample indices (indices/); null:
                                      # $ATTNRES_DATA_CACHE or ~/.cache/attnres/data
    tokenizer: str | None = None      # a tokenizers tokenizer.json to use instead of training a BPE
    document_masking: bool = False    # no token sees an earlier document of its window (model/document_masking.py)
    prepare_workers: int = 1          # processes tokenising input files at once
    bad_inputs: str = "stop"          # an unreadable input file: stop the preparation, or skip it


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "attnres"
    name: str | None = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ParallelConfig:
    dp: int | None = None             # data-parallel replicas; null: world size / (fsdp * cp * pp * tp)
    fsdp: int = 1                     # ranks sharding parameters, gradients and optimizer state (FSDP2) per replica
    pp: int = 1                       # pipeline ranks
    vp: int = 1                       # virtual stages (chunks) per pipeline rank
    schedule: str = "interleaved_1f1b"
    pp_cache: bool = True             # cross-stage caching of block representations
    tp: int = 1                       # tensor + sequence parallel ranks (heads, MLP channels, sequence)
    ep: int = 1                       # expert-parallel ranks, carved out of dp: routed experts split ep ways
    cp: int = 1                       # context-parallel ranks: each holds a contiguous slice of every sequence
    init_timeout_s: float = 600.0     # the process group's timeout from its start through the first step
    collective_timeout_s: float = 1800.0  # every group's timeout after the first step: a collective waiting longer fails


@dataclass
class CheckpointConfig:
    async_mode: str = "off"           # off | async | async_pinned: the write overlaps training (trainer/run_dir/async_checkpoint.py)


@dataclass
class DebugConfig:
    """Fault injection for reliability tests, and profiling."""
    crash_at_step: int | None = None                              # the process is SIGKILLed once at this step
    crash_rank: int | None = None                                 # only this rank; null: every rank
    nan_loss_steps: list[int] = field(default_factory=list)      # these steps get a NaN loss
    profile_steps: list[int] | None = None                        # [a, b]: a torch.profiler trace of steps a..b
    sleep_at_step: int | None = None                              # rank debug.sleep_rank sleeps inside this step
    sleep_s: float = 0.0                                          # for this long (a planted hang)
    sleep_rank: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    seed: int = 1234
    resume: str = "auto"              # auto: the newest complete checkpoint in run.dir; never; or a checkpoint path
    init_from: str | None = None      # a run or checkpoint whose weights start a fresh run (trainer/retrofit.py)


# The config groups whose presets set part of a schema. Each gets its schema as the first entry of
# configs/config.yaml's defaults, so every key of the schema exists whichever preset was picked:
# `parallel=single parallel.cp=2` overrides a key that single.yaml does not list.
GROUP_SCHEMAS = {"model": ModelConfig, "variant": ResidualConfig, "optim": OptimConfig, "parallel": ParallelConfig}


@functools.cache  # Hydra's ConfigStore lives as long as the process: once is enough
def register_schemas() -> None:
    """Store in Hydra's ConfigStore what configs/config.yaml's defaults list starts with, the one place every
    default is written: each group's schema as `schema/<group>: <group>`, and `schema/settings`, the defaults of
    every setting outside the groups. Every loader calls it before composing (load_config, trainer.main)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=f"schema/{group}", name=group, node=schema, package=group)
    # Untyped, as a YAML file's values are: to_typed checks their types, so a bad value is one line naming its key.
    settings = OmegaConf.to_container(OmegaConf.structured(Config))
    store.store(group="schema", name="settings", package="_global_",
                node={key: value for key, value in settings.items() if key not in GROUP_SCHEMAS})


CHOICES = {
    "variant.kind": VARIANTS,
    "variant.gate": ("scalar", "elementwise"),
    "variant.query": ("learned", "input_dependent"),
    "variant.kernel": ("softmax", "sigmoid"),
    "variant.mixing": ("attention", "static", "scalars"),
    "model.kernel_impl": IMPLS,
    "model.init": INIT_SCHEMES,
    "model.moe.activation": ACTIVATIONS,
    "optim.name": ("adamw", "muon"),
    "train.schedule": ("wsd", "cosine"),
    "train.activation_checkpointing": ("none", "full", "selective"),
    "train.precision": PRECISIONS,
    "train.trainable": ("all", "residual", "norms"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
    "parallel.schedule": ("interleaved_1f1b", "1f1b", "gpipe", "zero_bubble"),
    "checkpoint.async_mode": ("off", "async", "async_pinned"),
}

# Transformer blocks: 8x the deepest released LLMs (about 128). Each block is Python modules built one by one
# (3.6 ms a block even on the meta device), so a forged count of a million would build for an hour before
# any size check (a checkpoint's or export's weights, the host's memory) could run.
MAX_BLOCKS = 1024
# KDA's chunk (tokens): its chunkwise form holds chunk_size x chunk_size matrices per chunk, and a chunk longer
# than the sequence only pads it; fla's fused kernel fixes its own at 64, the default.
MAX_KDA_CHUNK = 1024
# The largest seed: the int64 every integer of the config keeps (check_numbers); torch.manual_seed takes it.
MAX_SEED = 2 ** 63 - 1
# The longest duration of any *_s key: 7 days, beyond any step or collective worth waiting for and well within
# what timedelta (the process groups' timeouts; 1e15 s overflowed it), time.sleep and the watchdog's waits take.
MAX_DURATION_S = 7 * 24 * 3600
INT64 = (-2 ** 63, 2 ** 63 - 1)

# Every numeric setting's range, as (keys, test, what is allowed). NaN fails every test; inf fails
# the finite ones. Bounds of the same kind share a row so the error wording stays uniform. `check_numbers`
# then bounds every number of the config, listed here or not.
RANGES = (
    (("model.n_blocks",),
     lambda v: 0 < v <= MAX_BLOCKS, f"must be in [1, {MAX_BLOCKS}] (transformer blocks; the deepest released models "
                                    "have about 128)"),
    (("model.kda.chunk_size",),
     lambda v: 0 < v <= MAX_KDA_CHUNK, f"must be in [1, {MAX_KDA_CHUNK}] tokens (KDA's chunkwise form holds "
                                       "chunk_size^2 matrices per chunk; 64 is the default and fla's own)"),
    (("seed",),
     lambda v: 0 <= v <= MAX_SEED, f"must be an integer in [0, 2**63 - 1 = {MAX_SEED}]"),
    (("model.vocab_size", "model.d_model", "model.n_heads", "model.dense_inter",
      "model.mla_every", "model.kda.head_dim", "model.kda.conv_kernel",
      "model.mla.kv_lora_rank", "model.mla.qk_nope_head_dim", "model.mla.v_head_dim",
      "model.moe.n_routed_experts", "model.moe.top_k", "model.moe.moe_inter", "variant.heads",
      "variant.streams", "train.steps", "train.seq_len", "train.micro_batch", "train.global_batch",
      "train.log_every", "train.eval_every", "train.eval_batches", "train.ckpt_every", "train.keep_last",
      "train.diag_every", "train.max_bad_steps", "parallel.pp", "parallel.vp", "parallel.tp", "parallel.ep",
      "parallel.fsdp"),
     lambda v: v > 0, "must be positive"),
    (("model.init_std", "model.norm_eps", "model.moe.routed_scaling_factor", "optim.lr", "optim.eps",
      "optim.muon_lr"),
     lambda v: 0 < v < math.inf, "must be a positive finite number"),
    (("parallel.init_timeout_s", "parallel.collective_timeout_s"),
     lambda v: 0 < v < math.inf, "must be a positive finite number of seconds"),
    (("debug.sleep_s",),
     lambda v: 0 <= v < math.inf, "must be a finite number of seconds >= 0"),
    (("model.n_dense_layers", "model.mla.qk_rope_head_dim", "model.moe.n_shared_experts",
      "train.warmup_steps"),
     lambda v: v >= 0, "must be >= 0"),
    (("model.moe.bias_update_rate", "model.moe.aux_loss_coef", "optim.weight_decay"),
     lambda v: 0 <= v < math.inf, "must be a finite number >= 0"),
    (("train.grad_clip",),
     lambda v: 0 <= v < math.inf, "must be a finite number >= 0 (the max gradient norm; 0 turns clipping off)"),
    (("train.min_lr_ratio", "train.decay_fraction"),
     lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    (("optim.muon_momentum", "optim.betas.0", "optim.betas.1"),
     lambda v: 0 <= v < 1, "must be in [0, 1)"),
)


def _get(cfg: Config, dotted: str):
    # Users set residual options under `variant.`; they live on model.residual.
    value = cfg.model.residual if dotted.startswith("variant.") else cfg
    for part in dotted.split(".")[1:] if dotted.startswith("variant.") else dotted.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return value


# Settings that name a file or directory, with what null means where null is allowed. An empty string
# would be the current directory (run.dir= trained there; data.path= read every text file under it).
PATH_KEYS = {
    "run.dir": None,
    "data.path": "the built-in Shakespeare corpus",
    "data.cache_dir": "the default cache",
    "data.tokenizer": "a BPE trained on the corpus",
    "init_from": "a fresh initialisation",
    "resume": None,
}


def _validate_paths(cfg: Config) -> None:
    for key, null_means in PATH_KEYS.items():
        value = _get(cfg, key)
        if value is not None and not value.strip():
            instead = f", or null for {null_means}" if null_means else ""
            raise ConfigError(f"{key}={value!r} is empty, which would mean the current directory; give a path{instead}")


def validate(cfg: Config) -> Config:
    """Every check of a config to run with: its values (check_values), then what this machine and the
    file system must offer (Triton on CUDA for kernel_impl=triton, torchao and float8 tensor cores or
    none for train.float8, an existing resume= path)."""
    check_values(cfg)
    if cfg.model.kernel_impl == "triton":
        import torch

        refusal = triton_refusal(on_cuda=torch.cuda.is_available())
        if refusal is not None:
            raise ConfigError(f"model.kernel_impl=triton: {refusal}; use model.kernel_impl=auto or torch")
    if cfg.train.float8:
        import torch

        from parallel.float8 import float8_refusal

        refusal = float8_refusal(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
        if refusal is not None:
            raise ConfigError(refusal)
    if cfg.checkpoint.async_mode == "async_pinned":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("checkpoint.async_mode=async_pinned stages into pinned host memory, which needs a CUDA "
                              "device; this machine has none: use checkpoint.async_mode=async")
    if cfg.train.eval_tasks:
        _resolve_eval_tasks(cfg.train.eval_tasks)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise ConfigError(f"resume={cfg.resume!r} is neither auto, never nor an existing checkpoint path")
    return cfg


# Keys and values renamed after runs had saved them (a checkpoint's meta.json, an export's config.json, a run
# directory's config.yaml): read back, a saved config takes their current names. On a command line or in a
# config file the old ones are refused like any unknown key or value.
RENAMED_KEYS = {"model.residual.variant": "model.residual.kind"}
RENAMED_VALUES = {"model.kernel_impl": {"reference": "torch"}}


def _holder(tree: object, dotted: str) -> tuple[dict | None, str]:
    """The mapping that holds `dotted`'s last part in nested mappings (None where a part is missing), and
    that part."""
    *path, name = dotted.split(".")
    for part in path:
        tree = tree.get(part) if isinstance(tree, dict) else None
    return (tree if isinstance(tree, dict) else None), name


def with_current_names(saved: object) -> object:
    """A saved config (nested mappings) with the keys and values renamed since it was saved under their
    current names (RENAMED_KEYS, RENAMED_VALUES); a copy, anything else as it is."""
    saved = copy.deepcopy(saved)
    for old, new in RENAMED_KEYS.items():
        holder, name = _holder(saved, old)
        if holder is not None and name in holder:
            holder.setdefault(new.rsplit(".", 1)[1], holder.pop(name))
    for key, renamed in RENAMED_VALUES.items():
        holder, name = _holder(saved, key)
        if holder is not None and isinstance(holder.get(name), str):
            holder[name] = renamed.get(holder[name], holder[name])
    return saved


def config_from_saved(saved: object) -> Config:
    """A config a run wrote (a checkpoint's meta.json, an export's config.json: dataclasses.asdict form),
    typed and value-checked like a command line's, under the current names (with_current_names); ConfigError
    names the first bad key. The machine checks of `validate` are left out: a run trained with Triton on a GPU
    is still read on a CPU."""
    if not isinstance(saved, dict):
        raise ConfigError(f"the config is a {type(saved).__name__}, not a mapping of settings")
    try:
        return check_values(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config),
                                                                with_current_names(saved))))
    except OmegaConfBaseException as error:
        raise ConfigError(_one_line(error)) from None


def _validate_data(cfg: Config) -> None:
    """data.blend, data.split and the preparation options, with the data layer's own one-line messages."""
    from trainer.data import DataError, PrepareOptions, check_split, parse_blend

    d = cfg.data
    try:
        for entry in parse_blend(d.blend, d.path):
            if entry.path is not None and not entry.path.strip():
                raise DataError(f"data.blend: path {entry.path!r} is empty, which would mean the current directory")
        check_split(d.split)
        PrepareOptions(d.prepare_workers, d.bad_inputs)
    except DataError as error:
        raise ConfigError(str(error)) from None


def _validate_moe_options(moe) -> None:
    """The MoE's release options (model.moe.*): grouped top-k, SiTU's betas, LatentMoE's width."""
    experts, groups = moe.n_routed_experts, moe.n_expert_groups
    if groups < 1 or experts % groups:
        raise ConfigError(f"model.moe.n_expert_groups={groups} must be a positive divisor of "
                          f"model.moe.n_routed_experts={experts}")
    if not 1 <= moe.topk_groups <= groups:
        raise ConfigError(f"model.moe.topk_groups={moe.topk_groups} must be in [1, model.moe.n_expert_groups={groups}]")
    per_group = experts // groups
    if moe.topk_groups < groups and per_group < 2:
        raise ConfigError(f"model.moe.n_expert_groups={groups} leaves {per_group} expert per group; a group scores "
                          f"its two best experts, so give it at least 2 (a divisor of {experts} up to {experts // 2})")
    if moe.top_k > moe.topk_groups * per_group:
        raise ConfigError(f"model.moe.top_k={moe.top_k} exceeds the {moe.topk_groups * per_group} experts of "
                          f"model.moe.topk_groups={moe.topk_groups} groups of {per_group}")
    if not 0 < moe.situ_beta < math.inf:
        raise ConfigError(f"model.moe.situ_beta={moe.situ_beta!r} must be a positive finite number")
    if moe.situ_linear_beta is not None and not 0 < moe.situ_linear_beta < math.inf:
        raise ConfigError(f"model.moe.situ_linear_beta={moe.situ_linear_beta!r} must be a positive finite number or "
                          "null (SiTU's up projection left unbounded)")
    if moe.latent_dim is not None and moe.latent_dim < 1:
        raise ConfigError(f"model.moe.latent_dim={moe.latent_dim} must be a positive width or null (the routed "
                          "experts in model.d_model)")
    if moe.latent_norm and moe.latent_dim is None:
        raise ConfigError("model.moe.latent_norm=true normalises LatentMoE's latent; set model.moe.latent_dim too")


def check_values(cfg: Config) -> Config:
    """The checks of a config that need only its values: choices, ranges, and settings that must agree."""
    _validate_paths(cfg)
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not valid; allowed: {' | '.join(allowed)}")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={cfg.optim.betas} must be two numbers [beta1, beta2]")
    for keys, in_range, allowed in RANGES:
        for key in keys:
            value = _get(cfg, key)
            # A typed list's element can still arrive as a mapping from a saved config (OmegaConf lets it in).
            if not isinstance(value, (int, float)) or not in_range(value):
                raise ConfigError(f"{key}={value!r} {allowed}")
    _validate_data(cfg)
    m, r = cfg.model, cfg.model.residual
    if m.d_model % r.heads:
        raise ConfigError(f"variant.heads={r.heads} must divide model.d_model={m.d_model}")
    if r.block_size is not None and r.block_size < 1:
        raise ConfigError(f"variant.block_size={r.block_size} must be a positive number of sublayers or null")
    if r.window is not None and r.window < 1:
        raise ConfigError(f"variant.window={r.window} must be a positive number of sources or null")
    if r.kind == "block" and r.two_phase and (r.query != "learned" or r.mixing != "attention" or r.window):
        raise ConfigError(
            "variant.two_phase=true needs query=learned, mixing=attention and window=null "
            f"(got query={r.query}, mixing={r.mixing}, window={r.window}); set variant.two_phase=false")
    if m.moe.top_k > m.moe.n_routed_experts:
        raise ConfigError(f"model.moe.top_k={m.moe.top_k} exceeds model.moe.n_routed_experts={m.moe.n_routed_experts}")
    _validate_moe_options(m.moe)
    if not 0 <= m.n_dense_layers <= m.n_blocks:
        raise ConfigError(f"model.n_dense_layers={m.n_dense_layers} must be in [0, model.n_blocks={m.n_blocks}]")
    _validate_attention_options(m)
    t = cfg.train
    if t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} must be a multiple of train.micro_batch={t.micro_batch}")
    if t.stop_after is not None and t.stop_after < 1:
        raise ConfigError(f"train.stop_after={t.stop_after} must be a positive number of steps or null")
    if t.hang_after_s is not None and not 0 < t.hang_after_s < math.inf:
        raise ConfigError(f"train.hang_after_s={t.hang_after_s} must be a positive finite number of seconds or null")
    _validate_eval_tasks(cfg)
    p = cfg.parallel
    if p.dp is not None and p.dp < 1:
        raise ConfigError(f"parallel.dp={p.dp} must be a positive number of replicas or null")
    if p.cp < 1:
        raise ConfigError(f"parallel.cp={p.cp} must be a positive number of ranks")
    if p.cp > 1 and (refusal := context_parallel_refusal()):
        raise ConfigError(refusal)
    if p.vp > 1 and p.schedule not in ("interleaved_1f1b", "zero_bubble"):
        raise ConfigError(f"parallel.schedule={p.schedule} runs one stage per rank; parallel.vp={p.vp} needs "
                          "interleaved_1f1b")
    if p.schedule == "zero_bubble" and p.pp_cache and r.kind != "baseline":
        raise ConfigError("parallel.schedule=zero_bubble splits the input-gradient pass, which never fills the "
                          "cached block gradients (wrong weight gradients); use interleaved_1f1b or parallel.pp_cache=false")
    if p.pp > 1 and r.window is not None and p.pp_cache:
        raise ConfigError("variant.window with parallel.pp_cache=true is not supported: blocks outside the window "
                          "get no gradient to carry back; set parallel.pp_cache=false")
    _validate_throughput_options(cfg)
    _validate_retrofit_options(cfg)
    check_numbers(cfg)
    return cfg


def _validate_attention_options(m) -> None:
    """The token mixers' release options (model.mla_layers, model.mla.*, model.kda.*) that may be null."""
    if m.mla_layers is not None and (len(set(m.mla_layers)) != len(m.mla_layers)
                                     or not all(isinstance(block, int) and 0 <= block < m.n_blocks
                                                 for block in m.mla_layers)):
        raise ConfigError(f"model.mla_layers={list(m.mla_layers)} must list distinct blocks in [0, {m.n_blocks - 1}] "
                          f"(0-based, model.n_blocks={m.n_blocks}), or be null for model.mla_every")
    if m.mla.q_lora_rank is not None and m.mla.q_lora_rank < 1:
        raise ConfigError(f"model.mla.q_lora_rank={m.mla.q_lora_rank} must be a positive rank or null (no query LoRA)")
    if m.mla.latent_norm_eps is not None and not 0 < m.mla.latent_norm_eps < math.inf:
        raise ConfigError(f"model.mla.latent_norm_eps={m.mla.latent_norm_eps!r} must be a positive finite number or "
                          "null (model.norm_eps)")
    if m.kda.gate_lower_bound is not None and not -math.inf < m.kda.gate_lower_bound < 0:
        raise ConfigError(f"model.kda.gate_lower_bound={m.kda.gate_lower_bound!r} must be a negative finite number "
                          "(the released K3 uses -5.0) or null (the unbounded gate)")


def _numbers(value: object, key: str):
    """(dotted key, number) of every int and float inside `value` (dataclasses, lists, mappings)."""
    if dataclasses.is_dataclass(value):
        for field_ in dataclasses.fields(value):
            yield from _numbers(getattr(value, field_.name), f"{key}.{field_.name}" if key else field_.name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{key}.{index}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield key, value


def check_numbers(cfg: Config) -> None:
    """The bounds every number of the config keeps, whatever its key (a key added later included), after the
    key's own checks have had their say: a float is finite, an int fits 64 bits (torch, numpy and the
    JSON a checkpoint records take no more), a duration (a key ending in _s) is at most MAX_DURATION_S."""
    for key, value in _numbers(cfg, ""):
        key = key.replace("model.residual.", "variant.", 1)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            raise ConfigError(f"{key}={value} does not fit a 64-bit integer; give a value in [-2**63, 2**63 - 1]")
        if key.endswith("_s") and value > MAX_DURATION_S:
            raise ConfigError(f"{key}={value!r} is longer than the {MAX_DURATION_S} seconds (7 days) any duration "
                              "may be; give a number of seconds up to that")


# -- lm_eval tasks during training (train.eval_tasks; trainer/downstream.py) ------------------------------

def _validate_eval_tasks(cfg: Config) -> None:
    t = cfg.train
    if not all(isinstance(name, str) and name.strip() for name in t.eval_tasks):
        raise ConfigError(f"train.eval_tasks={list(t.eval_tasks)} has an empty name; give lm_eval task or group "
                          "names, e.g. [attnres_local]")
    if t.eval_tasks_every is not None and t.eval_tasks_every < 1:
        raise ConfigError(f"train.eval_tasks_every={t.eval_tasks_every} must be a positive number of steps or null "
                          "(null: every train.eval_every steps)")
    limit = t.eval_tasks_limit
    if limit is not None and not (0 < limit < 1 or (1 <= limit < math.inf and limit == int(limit))):
        raise ConfigError(f"train.eval_tasks_limit={limit} must be a whole number >= 1 (examples per task), a "
                          "fraction in (0, 1), or null for all")


def _resolve_eval_tasks(names: list[str]) -> None:
    """Every name of train.eval_tasks known to lm_eval (configs/eval/tasks first), before any training."""
    try:
        from trainer.lm_tasks import LOCAL_TASKS, task_manager_for
    except ImportError as error:
        raise ConfigError(f"train.eval_tasks needs lm-evaluation-harness ({error}); install the eval extra: "
                          "pip install -e '.[eval]'") from None
    from trainer.lm_eval_adapter import LMEvalError

    try:
        task_manager_for(names, LOCAL_TASKS, key="train.eval_tasks")
    except LMEvalError as error:
        raise ConfigError(str(error)) from None


# -- retrofitting (init_from, train.trainable, train.unfreeze_after; trainer/retrofit.py) ----------------

def _validate_retrofit_options(cfg: Config) -> None:
    t = cfg.train
    if t.unfreeze_after is not None and t.unfreeze_after < 0:
        raise ConfigError(f"train.unfreeze_after={t.unfreeze_after} must be a number of steps >= 0 or null")
    if t.unfreeze_after is not None and t.trainable == "all":
        raise ConfigError(f"train.unfreeze_after={t.unfreeze_after} needs train.trainable=residual or norms "
                          "(with all, nothing is frozen)")


# -- compiled training, MFU and profiling (train.compile, train.peak_tflops, debug.profile_steps) --------

def _validate_throughput_options(cfg: Config) -> None:
    t = cfg.train
    if t.compile and t.activation_checkpointing == "selective":
        raise ConfigError("train.compile=true with train.activation_checkpointing=selective is not supported: the "
                          "selective policy picks ops in eager dispatch, which a compiled block bypasses; use full or none")
    if t.peak_tflops is not None and not 0 < t.peak_tflops < math.inf:
        raise ConfigError(f"train.peak_tflops={t.peak_tflops!r} must be a positive finite number of TFLOP/s or null")
    steps = cfg.debug.profile_steps
    if steps is not None:
        if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= t.steps:
            raise ConfigError(f"debug.profile_steps={list(steps)} must be [a, b] with 1 <= a <= b <= "
                              f"train.steps={t.steps}, or null")


def validate_layout(cfg: Config, world_size: int) -> tuple[int, int]:
    """Check the parallel layout against the processes started and the model (`Degrees.problems`, the
    layout's rules); returns (the ranks splitting a batch, dp * fsdp, and microbatches per step)."""
    p, t = cfg.parallel, cfg.train
    degrees = Degrees.of(p, world_size)
    if degrees.world != world_size:
        raise ConfigError(f"parallel.dp * parallel.fsdp * parallel.cp * parallel.pp * parallel.tp = {degrees.dp} * "
                          f"{p.fsdp} * {p.cp} * {p.pp} * {p.tp} = {degrees.world} does not match the {world_size} "
                          "processes started (torchrun --nproc-per-node x --nnodes)")
    problems = degrees.problems(cfg.model, t.seq_len, t.micro_batch, t.global_batch)
    if problems:
        raise ConfigError(problems[0])
    problem = memory_problem(cfg, degrees)
    if problem:
        raise ConfigError(problem)
    return degrees.data_ranks, t.global_batch // (t.micro_batch * degrees.data_ranks)


# Training state per parameter at the least: fp32 weights 4, fp32 gradients 4, AdamW's two fp32 moments 8
# (parallel/memory_plan.py plans the rest: activations, autocast copies, gathered FSDP units).
TRAINING_BYTES_PER_PARAMETER = 16
GIB = 2 ** 30


def host_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_problem(cfg: Config, degrees: Degrees) -> str | None:
    """Why one rank of this layout cannot hold the model's training state, or None: a lower bound (every split
    taken as even: tp over all but the routed experts, ep over those, pp and fsdp (x cp) over the rest) against
    the memory it lives in, the GPU's on CUDA, else the host's. Counted from the config, before anything is
    built, so an absurd size is one line rather than memory growing until the machine gives out."""
    import torch

    counts = config_counts(cfg.model)
    shards = degrees.pp * (degrees.fsdp * degrees.cp if degrees.fsdp > 1 else 1)
    per_rank = ((counts.total - counts.routed) / degrees.tp + counts.routed / degrees.ep) / shards
    need = TRAINING_BYTES_PER_PARAMETER * per_rank
    if torch.cuda.is_available():
        have, where = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "GPU"
    else:
        have, where = host_memory(), "host"
    if need <= have:
        return None
    m = cfg.model
    return (f"model.d_model={m.d_model}, model.n_blocks={m.n_blocks}, model.vocab_size={m.vocab_size}: "
            f"{counts.total:,} parameters, whose training state needs at least {need / GIB:,.1f} GiB per rank "
            f"({TRAINING_BYTES_PER_PARAMETER} bytes a parameter, split over tp={degrees.tp}, ep={degrees.ep}, "
            f"pp={degrees.pp}, fsdp={degrees.fsdp}), more than this {where}'s {have / GIB:,.1f} GiB; use a smaller "
            "model or shard it further (parallel.fsdp, parallel.pp, parallel.tp, parallel.ep)")


def _one_line(error: OmegaConfBaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    key = getattr(error, "full_key", None)
    if key and key.startswith("model.residual."):
        key = "variant." + key.removeprefix("model.residual.")
    head = lines[0] if lines else type(error).__name__
    return f"{key}: {head}" if key and key not in head else head


def to_typed(raw: DictConfig) -> Config:
    """Merge a composed config onto the typed schema, convert to dataclasses and validate."""
    raw = OmegaConf.to_container(raw, resolve=False)
    raw.pop("hydra", None)
    # The `variant` group holds the residual options; the model carries them as model.residual.
    raw.setdefault("model", {})["residual"] = raw.pop("variant", {})
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_one_line(error)) from None
    return validate(cfg)


def load_config(overrides: list[str] | None = None) -> Config:
    """Compose configs/config.yaml with Hydra overrides (e.g. ["model=xs", "variant=full"])."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides or []))
    except HydraException as error:
        cause = error.__cause__
        reason = str(cause).splitlines()[0] if cause is not None else ""
        raise ConfigError(f"{str(error).splitlines()[0]} {reason}".strip()) from None
    return to_typed(raw)
