"""Every model x variant composes; bad values fail with one line naming key, value and what is allowed."""
import dataclasses
import json
import math
import time

import pytest
import torch
from omegaconf import OmegaConf

from kernels.select import triton_refusal

from model import build_model
from model.params import count_parameters
from model.residual import DepthGeometry
from parallel.dims import Degrees, resolve_precision
from trainer.config import (CONFIG_DIR, ConfigError, config_from_saved, host_memory, load_config, memory_problem,
                            validate_layout)

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (CONFIG_DIR / "variant").glob("*.yaml"))


def test_groups_are_the_documented_ones():
    assert MODELS == ["kimi_k3", "kimi_linear_48b", "l", "m", "s", "xs"]
    assert VARIANTS == ["baseline", "block", "denseformer", "full", "hc", "highway", "kimi_k3", "mhc", "x0"]


# The presets of another variant's kind: DenseFormer is Full's, Kimi K3's Block AttnRes is Block's.
KIND_OF_PRESET = {"denseformer": "full", "kimi_k3": "block"}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_model_and_variant_composes(model, variant):
    """A variant= on the command line wins over a model preset's own (model=kimi_k3 picks variant=kimi_k3)."""
    cfg = load_config([f"model={model}", f"variant={variant}"])
    assert cfg.model.residual.kind == KIND_OF_PRESET.get(variant, variant)
    if variant == "full":
        assert DepthGeometry.of(cfg.model).size == 1
    if variant == "block":  # the default block size gives about 8 depth blocks
        n_depth_blocks = DepthGeometry.of(cfg.model).max_sources - 1
        assert 6 <= n_depth_blocks <= 10


PARALLEL_PRESETS = sorted(p.stem for p in (CONFIG_DIR / "parallel").glob("*.yaml"))


@pytest.mark.parametrize("preset", PARALLEL_PRESETS)
def test_every_parallel_key_overrides_from_any_preset(preset):
    """Each preset is reachable from `single` by plain key overrides: every schema key exists on every preset."""
    target = load_config([f"parallel={preset}"]).parallel
    overrides = [f"parallel.{key}={'null' if value is None else value}" for key, value in vars(target).items()]
    assert load_config(["parallel=single", *overrides]).parallel == target


@pytest.mark.parametrize("overrides, expected", [
    (["parallel=single", "parallel.cp=2"], {"parallel.cp": 2, "parallel.fsdp": 1, "parallel.tp": 1}),
    (["parallel=pp2_vp2", "parallel.fsdp=2", "parallel.tp=2"],
     {"parallel.fsdp": 2, "parallel.pp": 2, "parallel.vp": 2, "parallel.tp": 2}),
    (["variant=full", "variant.heads=2", "variant.window=3"], {"model.residual.heads": 2, "model.residual.window": 3}),
    (["optim=adamw", "optim.muon_momentum=0.9"], {"optim.muon_momentum": 0.9}),
])
def test_keys_missing_from_a_preset_file_still_override(overrides, expected):
    cfg = load_config(overrides)
    assert {key: OmegaConf.select(OmegaConf.structured(cfg), key) for key in expected} == expected


@pytest.mark.parametrize("override, fragment", [
    ("variant.kernel=tanh", "variant.kernel='tanh' is not valid; allowed: softmax | sigmoid"),
    ("variant.query=random", "variant.query='random' is not valid; allowed: learned | input_dependent"),
    ("variant.heads=3", "variant.heads=3 must divide model.d_model=256"),
    ("variant.block_size=0", "variant.block_size=0"),
    ("model.d_model=abc", "model.d_model"),
    ("optim=sgd", "optim/sgd"),
    ("train.global_batch=12", "train.global_batch=12 must be a multiple of train.micro_batch=8"),
    ("variant.nonsense=1", "nonsense"),
    ("model.moe.top_k=9", "model.moe.top_k=9 exceeds model.moe.n_routed_experts=8"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be a finite number >= 0 (the max gradient norm; 0 turns clipping off)"),
    ("train.warmup_steps=-5", "train.warmup_steps=-5 must be >= 0"),
    ("train.min_lr_ratio=5", "train.min_lr_ratio=5.0 must be in [0, 1]"),
    ("optim.weight_decay=-3", "optim.weight_decay=-3.0 must be a finite number >= 0"),
    ("optim.lr=nan", "optim.lr=nan must be a positive finite number"),
    ("optim.lr=inf", "optim.lr=inf must be a positive finite number"),
    ("optim.betas=[0.9,1.5]", "optim.betas.1=1.5 must be in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers"),
    ("optim.eps=0", "optim.eps=0.0 must be a positive finite number"),
    ("++model.init_std=-0.02", "model.init_std=-0.02 must be a positive finite number"),
    ("model.moe.bias_update_rate=-1e-2", "model.moe.bias_update_rate=-0.01 must be a finite number >= 0"),
    ("seed=-1", "seed=-1 must be an integer in [0, 2**63 - 1 = 9223372036854775807]"),
    ("seed=100000000000000000000000", "seed=100000000000000000000000 must be an integer in [0, 2**63 - 1"),
    ("seed=1e23", "seed: Value '1e+23' of type 'float' could not be converted to Integer"),
    ("model.n_blocks=10000000", "model.n_blocks=10000000 must be in [1, 1024] (transformer blocks"),
    ("model.n_blocks=1e7", "model.n_blocks=1e7 Value '10000000.0' of type 'float' could not be converted to Integer"),
    ("model.kda.chunk_size=100000", "model.kda.chunk_size=100000 must be in [1, 1024] tokens"),
    ("model.mla_layers=[3,8]", "model.mla_layers=[3, 8] must list distinct blocks in [0, 7] (0-based, model.n_blocks=8)"),
    ("model.mla_layers=[3,3]", "model.mla_layers=[3, 3] must list distinct blocks in [0, 7]"),
    ("model.mla_layers=[-1]", "model.mla_layers=[-1] must list distinct blocks in [0, 7]"),
    ("model.mla.q_lora_rank=0", "model.mla.q_lora_rank=0 must be a positive rank or null (no query LoRA)"),
    ("model.mla.latent_norm_eps=0", "model.mla.latent_norm_eps=0.0 must be a positive finite number or null"),
    ("model.kda.gate_lower_bound=5", "model.kda.gate_lower_bound=5.0 must be a negative finite number"),
    ("model.kda.gate_lower_bound=-inf", "model.kda.gate_lower_bound=-inf must be a negative finite number"),
    # Every number, whatever its key: finite, within 64 bits, a duration (*_s) at most 7 days.
    ("parallel.init_timeout_s=1e15", "parallel.init_timeout_s=1000000000000000.0 is longer than the 604800 seconds "
                                     "(7 days) any duration may be"),
    ("parallel.collective_timeout_s=1e15", "parallel.collective_timeout_s=1000000000000000.0 is longer than the "
                                           "604800 seconds"),
    ("train.hang_after_s=604801", "train.hang_after_s=604801.0 is longer than the 604800 seconds"),
    ("debug.sleep_s=1e300", "debug.sleep_s=1e+300 is longer than the 604800 seconds"),
    ("train.steps=100000000000000000000000", "train.steps=100000000000000000000000 does not fit a 64-bit integer; "
                                             "give a value in [-2**63, 2**63 - 1]"),
    ("debug.crash_at_step=100000000000000000000000", "debug.crash_at_step=100000000000000000000000 does not fit"),
    ("debug.nan_loss_steps=[3,100000000000000000000000]", "debug.nan_loss_steps.1=100000000000000000000000 does not "
                                                          "fit a 64-bit integer"),
    ("++parallel.ep=0", "parallel.ep=0 must be positive"),
    ("train.precision=fp16", "train.precision='fp16' is not valid; allowed: auto | bf16 | fp32"),
    # An empty path would be the current directory (issue 24, cause 2).
    ("run.dir=", "run.dir='' is empty, which would mean the current directory; give a path"),
    ("data.path=", "data.path='' is empty, which would mean the current directory; give a path, or null for the "
                   "built-in Shakespeare corpus"),
    ("data.cache_dir=' '", "data.cache_dir=' ' is empty"),
    ("data.tokenizer=", "data.tokenizer='' is empty"),
    ("init_from=", "init_from='' is empty"),
    ("resume=", "resume='' is empty"),
    ("train.eval_tasks=['']", "train.eval_tasks=[''] has an empty name"),
    ("train.eval_tasks_every=0", "train.eval_tasks_every=0 must be a positive number of steps or null"),
    ("train.eval_tasks_limit=2.5", "train.eval_tasks_limit=2.5 must be a whole number >= 1 (examples per task), a "
                                   "fraction in (0, 1), or null"),
    ("train.eval_tasks_limit=inf", "train.eval_tasks_limit=inf must be a whole number >= 1 (examples per task), a "
                                   "fraction in (0, 1), or null"),
    ("train.eval_tasks_limit=nan", "train.eval_tasks_limit=nan must be a whole number >= 1"),
])
def test_invalid_value_fails_with_one_clear_line(override, fragment):
    with pytest.raises(ConfigError) as error:
        load_config([override])
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message


def test_two_phase_true_refuses_a_read_it_cannot_batch_and_null_reads_it_per_layer():
    with pytest.raises(ConfigError, match="variant.two_phase=true needs query=learned") as error:
        load_config(["variant.mixing=static", "variant.two_phase=true"])
    assert "\n" not in str(error.value)
    assert load_config(["variant.mixing=static"]).model.residual.two_phase is None


@pytest.mark.parametrize("precision, device, dtype", [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16),
    ("bf16", "cpu", torch.bfloat16), ("fp32", "cuda", torch.float32),
])
def test_precision_auto_is_bf16_on_cuda_and_fp32_elsewhere(precision, device, dtype):
    assert load_config().train.precision == "auto"
    assert resolve_precision(load_config([f"train.precision={precision}"]).train.precision,
                             torch.device(device)) == dtype


def test_triton_kernels_on_cpu_are_refused_before_any_work(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as error:
        load_config(["model.kernel_impl=triton"])
    assert str(error.value) == ("model.kernel_impl=triton: impl='triton' on CPU tensors runs only under "
                                "TRITON_INTERPRET=1 (the Triton interpreter); use model.kernel_impl=auto or torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(["model.kernel_impl=triton"]).model.kernel_impl == "triton"
    # What trainer.config asks on a CUDA machine (on_cuda=torch.cuda.is_available()): no refusal, interpreter or not.
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_refusal(on_cuda=True) is None


def test_the_old_kernel_impl_reference_is_one_line_naming_the_valid_values():
    """`reference` became `torch` (KDA's plain-torch path is its chunk form, not kernels/kda/reference.py)."""
    with pytest.raises(ConfigError) as error:
        load_config(["model.kernel_impl=reference"])
    assert str(error.value) == "model.kernel_impl='reference' is not valid; allowed: auto | torch | triton"


@pytest.mark.slow
def test_sizes_have_the_documented_parameter_counts():
    active = {}
    for size in ["xs", "s", "m", "l"]:
        with torch.device("meta"):
            active[size] = count_parameters(build_model(load_config([f"model={size}"])))["active"]
    assert 0.6e6 < active["xs"] < 1.5e6
    assert 8e6 < active["s"] < 14e6
    assert 40e6 < active["m"] < 65e6
    assert 170e6 < active["l"] < 250e6


def test_kimi_linear_48b_shape_matches_the_published_model():
    cfg = load_config(["model=kimi_linear_48b", "variant=block"])
    with torch.device("meta"):
        model = build_model(cfg)
    counts = count_parameters(model)
    assert 48e9 <= counts["total"] <= 49.5e9  # published: 48B total
    assert 2.8e9 <= counts["active"] <= 3.6e9  # published: ~3B activated
    mla_blocks = [i for i in range(cfg.model.n_blocks) if cfg.model.is_mla(i)]
    assert mla_blocks == [3, 7, 11, 15, 19, 23, 26]  # 3:1 KDA:MLA, last block MLA


def test_model_returns_logits_of_vocab_width():
    cfg = load_config(["model=xs"])
    logits = build_model(cfg)(torch.randint(0, cfg.model.vocab_size, (2, 5)))
    assert logits.shape == (2, 5, cfg.model.vocab_size)


@pytest.mark.parametrize("override", ["model.n_blocks=10000000", "model.n_blocks=1e7"])
def test_ten_million_blocks_are_refused_within_a_second(override):
    """Refused by value, before any block is built (3.6 ms a block even on the meta device: ten hours)."""
    start = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        load_config([override])
    assert time.perf_counter() - start < 2
    assert "model.n_blocks" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("section, key, value", [
    ("train", "eval_tasks_limit", math.inf), ("train", "eval_tasks_limit", math.nan),
    ("train", "hang_after_s", 1e15), ("parallel", "init_timeout_s", 1e15), ("seed", None, 10 ** 23),
    ("train", "peak_tflops", math.inf), ("debug", "sleep_rank", 2 ** 64), ("model", "n_blocks", 1_000_000),
])
def test_a_saved_config_out_of_range_is_a_config_error_naming_the_key(section, key, value):
    """A checkpoint's meta.json or an export's config.json is read by config_from_saved: every bad value is a
    ConfigError (resume=auto falls back past it), never an OverflowError from deep inside a check."""
    saved = json.loads(json.dumps(dataclasses.asdict(load_config())))  # as a run writes and reads it back
    if key is None:
        saved[section] = value
    else:
        saved[section][key] = value
    with pytest.raises(ConfigError) as error:
        config_from_saved(saved)
    assert f"{key or section}=" in str(error.value) and "\n" not in str(error.value)


def test_a_model_beyond_this_machines_memory_is_refused_at_once():
    """model.d_model=100000000 on one process: 7.6 trillion parameters to materialise whole, beyond any machine;
    refused by its count, built from nothing."""
    cfg = load_config(["model.d_model=100000000"])
    start = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        validate_layout(cfg, 1)
    assert time.perf_counter() - start < 1
    assert str(error.value).startswith("model.d_model=100000000, model.n_blocks=8, model.vocab_size=8192: "
                                       "7,581,100,284,312 parameters, whose training state needs at least 112,967.2 "
                                       "GiB per rank (16 bytes a parameter, split over tp=1, ep=1, pp=1, fsdp=1), more "
                                       "than this ")
    assert "\n" not in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available() and host_memory() >= 733 * 2 ** 30,
                    reason="this host holds the 48B model's training state whole")
def test_the_48b_model_is_refused_whole_and_accepted_sharded():
    """The per-rank bound divides by the layout's sharding: Kimi Linear 48B on one process needs 732 GiB, more
    than a GPU or a usual host has, while 256 ranks (fsdp 8 x pp 4 x dp 8, ep 8) need about 3.7 GiB each."""
    whole = load_config(["model=kimi_linear_48b"])
    with pytest.raises(ConfigError, match=r"49,122,928,512 parameters, whose training state needs at least 732\.0 GiB"):
        validate_layout(whole, 1)
    sharded = load_config(["model=kimi_linear_48b", "parallel.fsdp=8", "parallel.pp=4", "parallel.ep=8",
                           "parallel.schedule=1f1b", "train.micro_batch=1", "train.global_batch=64"])
    assert memory_problem(sharded, Degrees.of(sharded.parallel, 256)) is None
    assert validate_layout(sharded, 256) == (64, 1)


def test_model_kimi_k3_brings_its_block_size_and_a_variant_override_still_wins():
    """K3's attn_res_block_size is 12 decoder layers: 24 sublayers a block."""
    assert load_config(["model=kimi_k3"]).model.residual.block_size == 24
    assert load_config(["model=kimi_k3", "variant.block_size=12"]).model.residual.block_size == 12
    assert load_config(["model=kimi_k3", "variant=baseline"]).model.residual.kind == "baseline"
    assert load_config(["model=s"]).model.residual.block_size is None
