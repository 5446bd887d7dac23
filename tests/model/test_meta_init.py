"""Meta-device construction and layout-independent initialisation (model.init.materialise).

A parameter's initial value depends only on the seed and its name in the whole single-process
Decoder: not on the device the model was built on, on what was drawn before, or on which other
parts a rank keeps.
"""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from model import build_model
from model.decoder import Decoder
from model.init import initialise, materialise
from model.layer import TransformerBlock
from parallel.pipeline.plan import PipelinePlan
from parallel.pipeline.runner import keep_rank_parts
from trainer.config import load_config

SEED = 5


def config(variant):
    return load_config(["model=xs", f"variant={variant}"])


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, non-persistent ones (MoE load counts) included."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_bitwise_equal(ours: dict, reference: dict) -> None:
    for name, value in ours.items():
        assert value.dtype == reference[name].dtype and torch.equal(value, reference[name]), name


@pytest.mark.parametrize("variant", ["baseline", "block", "full", "mhc"])
def test_materialised_from_meta_equals_built_on_cpu(variant):
    cfg = config(variant)
    on_cpu = Decoder(cfg.model)  # real tensors, torch's constructor defaults, then initialised in place
    initialise(on_cpu, cfg.model.init_stds, SEED)
    meta = build_model(cfg, device="meta")
    assert all(t.is_meta for t in tensors(meta).values())
    materialise(meta, "cpu", cfg.model.init_stds, SEED)
    assert not any(t.is_meta for t in tensors(meta).values())
    assert tensors(meta).keys() == tensors(on_cpu).keys()
    assert_bitwise_equal(tensors(meta), tensors(on_cpu))
    assert_bitwise_equal(tensors(build_model(cfg, seed=SEED)), tensors(on_cpu))
    buffers = dict(meta.named_buffers())  # to_empty leaves garbage: init_weights must set every buffer
    assert any(name.endswith("load_counts") for name in buffers)
    for name, buffer in buffers.items():
        assert torch.equal(buffer, torch.zeros_like(buffer)), name


@pytest.mark.parametrize("variant", ["baseline", "block", "mhc"])
def test_pipeline_stages_start_from_the_whole_models_weights(variant):
    cfg = config(variant)
    whole = tensors(build_model(cfg, seed=SEED))
    plan = PipelinePlan(cfg.model, pp=2, vp=2, cache=True)
    kept = set()
    for rank in range(plan.pp):
        stage = keep_rank_parts(build_model(cfg, device="meta"), plan, rank)
        materialise(stage, "cpu", cfg.model.init_stds, SEED)
        assert_bitwise_equal(tensors(stage), whole)
        kept |= tensors(stage).keys()
    assert kept == whole.keys()


def test_a_block_materialised_alone_has_its_values_in_the_whole_model():
    cfg = config("block")
    whole = tensors(build_model(cfg, seed=SEED))
    with torch.device("meta"):
        block = TransformerBlock(cfg.model, 2, build_model(cfg, device="meta").mixer)
    materialise(block, "cpu", cfg.model.init_stds, SEED, prefix="layers.2")
    assert_bitwise_equal({f"layers.2.{name}": t for name, t in tensors(block).items()}, whole)


def test_initial_weights_ignore_the_global_rng_and_leave_it_alone():
    cfg = config("block")
    torch.manual_seed(0)
    first = tensors(build_model(cfg))
    torch.manual_seed(0)
    torch.randn(100)  # draws made before building must not shift the weights
    before = torch.get_rng_state()
    second = tensors(build_model(cfg))
    assert torch.equal(torch.get_rng_state(), before)
    assert_bitwise_equal(second, first)
    other_seed = tensors(build_model(cfg, seed=SEED + 1))
    assert not torch.equal(other_seed["layers.0.attn.q_proj.weight"], first["layers.0.attn.q_proj.weight"])


class CountAllocations(TorchDispatchMode):
    """Bytes of every non-meta tensor that an op creates (to_empty's allocations and init temporaries)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::eye",
                                 "aten::one_hot", "aten::rand_like", "aten::scalar_tensor", "aten::lift_fresh"):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_pipeline_rank_allocates_only_its_own_stage():
    """Pruned on meta, then materialised: rank 1 of pp=2 never allocates rank 0's weights."""
    cfg = config("block")
    whole_bytes = sum(t.numel() * t.element_size() for t in tensors(build_model(cfg)).values())
    plan = PipelinePlan(cfg.model, pp=2, vp=1, cache=False)
    stage = keep_rank_parts(build_model(cfg, device="meta"), plan, 1)
    with CountAllocations() as counter:
        materialise(stage, "cpu", cfg.model.init_stds, SEED)
    stage_bytes = sum(t.numel() * t.element_size() for t in tensors(stage).values())
    assert stage_bytes < 0.7 * whole_bytes  # the embedding and blocks 0-1 stayed on rank 0
    assert stage_bytes <= counter.bytes < 1.01 * stage_bytes  # the small rest: init temporaries


def test_place_keeps_a_slice_of_each_full_parameter():
    """The hook a sharding layer uses: it sees each full, initialised parameter by name and keeps a part."""
    cfg = config("block")
    whole = dict(build_model(cfg, seed=SEED).named_parameters())
    seen = []

    def first_half(name, full):
        seen.append(name)
        assert torch.equal(full, whole[name]), name
        return full.chunk(2)[0].clone()

    model = materialise(build_model(cfg, device="meta"), "cpu", cfg.model.init_stds, SEED, place=first_half)
    assert sorted(seen) == sorted(whole)
    for name, param in model.named_parameters():
        assert isinstance(param, nn.Parameter) and param.requires_grad
        assert torch.equal(param, whole[name].chunk(2)[0]), name


def test_a_module_nothing_initialises_is_refused():
    with pytest.raises(ValueError, match=r"^0 holds tensors but no module initialises them"):
        initialise(nn.Sequential(nn.Linear(2, 2)), config("baseline").model.init_stds, SEED)
