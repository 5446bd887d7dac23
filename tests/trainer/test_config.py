"""Every model x variant composes; bad values fail with one line naming key, value and what is allowed."""
import pytest
import torch
from omegaconf import OmegaConf

from kernels.select import triton_refusal

from model import build_model
from model.params import count_parameters
from model.residual import DepthGeometry
from parallel.dims import resolve_precision
from trainer.config import CONFIG_DIR, ConfigError, load_config

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (CONFIG_DIR / "variant").glob("*.yaml"))


def test_groups_are_the_documented_ones():
    assert MODELS == ["kimi_linear_48b", "l", "m", "s", "xs"]
    assert VARIANTS == ["baseline", "block", "denseformer", "full", "hc", "highway", "mhc", "x0"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_model_and_variant_composes(model, variant):
    cfg = load_config([f"model={model}", f"variant={variant}"])
    assert cfg.model.residual.variant == ("full" if variant == "denseformer" else variant)  # a preset of Full
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
    ("seed=-1", "seed=-1 must be >= 0"),
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
                                "TRITON_INTERPRET=1 (the Triton interpreter); use model.kernel_impl=auto or reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(["model.kernel_impl=triton"]).model.kernel_impl == "triton"
    # What trainer.config asks on a CUDA machine (on_cuda=torch.cuda.is_available()): no refusal, interpreter or not.
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_refusal(on_cuda=True) is None


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
