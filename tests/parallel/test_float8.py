"""train.float8 (parallel/float8.py): which Linear layers torchao converts, a float8 step against the fp32
step on the CPU (torchao's emulation: operands rounded to float8 exactly as on a GPU, multiplied in fp32),
the memory fact the planner relies on, MFU's peak and a trainer run."""
from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

from conftest import fast_train_overrides
from model import build_model
from model.flops import training_flops_per_token
from parallel.dims import Degrees, DistInfo, Layout, init_distributed
from parallel.engine import build_engine
from parallel.float8 import convert_to_float8, float8_refusal
from parallel.memory_plan import plan
from trainer.config import ConfigError, ParallelConfig, load_config
from trainer.mfu import float8_flop_share, peak_for_device_name
from trainer.trainer import Trainer

ONE_PROCESS = DistInfo(0, 1, 0, torch.device("cpu"), None)
# An input-dependent depth read gives every sublayer's read an nn.Linear (query_proj): it must stay out.
OVERRIDES = ["model=xs", "variant=block", "variant.query=input_dependent", "variant.two_phase=false"]
KDA = ["q_proj", "k_proj", "v_proj", "f_proj.0", "f_proj.1", "g_proj.0", "g_proj.1", "o_proj"]
SWIGLU = ["gate_proj", "up_proj", "down_proj"]
# model=xs: block 0 KDA + dense MLP, blocks 1-2 KDA + MoE, block 3 MLA + MoE (mla_every=4). KDA's b_proj
# (2 outputs, one per head) and MLA's kv_a_proj (40 = latent 32 + rope 8) miss the 16-multiple rule.
EXPECTED = sorted(
    [f"layers.{b}.attn.{name}" for b in (0, 1, 2) for name in KDA]
    + [f"layers.0.mlp.{name}" for name in SWIGLU]
    + [f"layers.{b}.mlp.shared.{name}" for b in (1, 2, 3) for name in SWIGLU]
    + [f"layers.3.attn.{name}" for name in ("q_proj", "kv_b_proj", "o_proj")])
STEPS, SEQ = 3, 32


def engine(float8: bool):
    cfg = load_config(OVERRIDES)
    return build_engine(build_model(cfg, device="meta"), ONE_PROCESS, Layout(degrees=Degrees()), ParallelConfig(),
                        micro_batch=2, seq_len=SEQ, microbatches=1, seed=0, float8=float8)


def test_only_the_token_mixers_and_mlps_linears_are_converted_and_names_are_unchanged():
    plain, converted = engine(False).model, engine(True).model
    float8 = sorted(name for name, module in converted.named_modules() if isinstance(module, Float8Linear))
    assert float8 == EXPECTED
    kept = {name for name, module in converted.named_modules() if type(module) is nn.Linear}
    assert {"layers.1.mlp.router", "layers.0.attn_res.query_proj", "layers.3.mlp_res.query_proj",
            "layers.0.attn.b_proj", "layers.3.attn.kv_a_proj"} <= kept
    assert type(converted.lm_head) is type(plain.lm_head)
    # Same parameter names and initial values: checkpoints move between float8 and bf16 runs.
    assert [name for name, _ in plain.named_parameters()] == [name for name, _ in converted.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), converted.parameters()):
        assert torch.equal(a, b), name


def test_the_trainer_runs_train_float8(tmp_path, tiny_dataset):
    cfg = load_config(fast_train_overrides(tmp_path / "run", tiny_dataset, steps=2, **{"train.float8": "true"}))
    trainer = Trainer(cfg, init_distributed())
    trainer.fit()
    converted = {name for name, module in trainer.model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == set(EXPECTED)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]


def test_tp_slicing_is_counted_in_the_alignment_rule():
    model = build_model(load_config(OVERRIDES), device="meta")
    # At tp=4, d_model 96 splits into 24-wide slices: nothing keeps a 16-multiple on both sides.
    assert convert_to_float8(model, tp=4, emulate=True) == []


def test_a_float8_step_tracks_the_fp32_step_on_cpu_emulation():
    """e4m3 keeps 3 mantissa bits to bf16's 7, so its rounding is 16x coarser: bf16 autocast keeps these
    step losses within 3e-4 (relative) of fp32, so float8 gets 16 x 3e-4 ~ 5e-3. Measured: 5e-5, 7e-4,
    1.3e-3 over the three steps. Each converted weight's first gradient (e5m2 output gradients, 2 mantissa
    bits) points the fp32 way within cosine 0.98 (measured: 0.992 at worst). The losses must differ from
    fp32's too, or the float8 path did not run."""
    tokens = torch.randint(0, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for float8 in (False, True):
        run = engine(float8)
        optimizer = torch.optim.AdamW(run.model.parameters(), lr=3e-3)
        losses, first_grads = [], None
        for _ in range(STEPS):
            losses.append(run.forward_backward([(tokens[:, :-1], tokens[:, 1:])], contextlib.nullcontext, None).item())
            first_grads = first_grads or {n: p.grad.clone() for n, p in run.model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        runs[float8] = losses, first_grads
    (fp32_losses, fp32_grads), (float8_losses, float8_grads) = runs[False], runs[True]
    for fp32, float8 in zip(fp32_losses, float8_losses):
        assert float8 != fp32
        assert abs(float8 - fp32) <= 5e-3 * fp32
    assert float8_losses[-1] < float8_losses[0] - 1.0  # it trains: 6.68 -> 5.11
    for name in EXPECTED:
        weight = f"{name}.weight"
        cosine = F.cosine_similarity(float8_grads[weight].flatten(), fp32_grads[weight].flatten(), 0)
        assert cosine >= 0.98, name


def test_a_float8_linear_under_autocast_keeps_its_master_weight_not_a_bf16_copy():
    """What parallel/memory_plan.py counts: a plain Linear under bf16 autocast saves a bf16 copy of its
    weight for backward, a float8 one saves the fp32 weight itself and recasts it in backward."""
    saved = {}
    for float8 in (False, True):
        linear = nn.Linear(64, 128, bias=False)
        if float8:
            linear = Float8Linear.from_float(linear, Float8LinearConfig(emulate=True))
        weights = []

        def pack(tensor, linear=linear, weights=weights):
            if tensor.numel() == linear.weight.numel():
                weights.append((tensor.dtype, tensor.untyped_storage().data_ptr() == linear.weight.data_ptr()))
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            linear(torch.randn(4, 64, requires_grad=True))  # as inside a model: both gradients wanted
        saved[float8] = weights
    assert saved == {False: [(torch.bfloat16, False)], True: [(torch.float32, True)]}


@pytest.mark.parametrize("precision,float8,autocast_copies", [
    ("bf16", False, "all"), ("bf16", True, "all but float8"), ("fp32", True, "none")])
def test_the_planner_drops_the_autocast_copies_of_float8_weights(precision, float8, autocast_copies):
    cfg = load_config(["model=xs"]).model
    model = build_model(cfg, device="meta")
    converted = sum(model.get_submodule(name).weight.numel() for name in EXPECTED)
    p = plan(cfg, Degrees(), seq_len=SEQ, micro_batch=2, microbatches=1, mode="none", precision=precision,
             float8=float8)
    expected = {"all": 2 * p.params, "all but float8": 2 * (p.params - converted), "none": 0}[autocast_copies]
    assert p.autocast_copy_bytes == expected
    sharded = plan(cfg, Degrees(fsdp=2), seq_len=SEQ, micro_batch=2, microbatches=1, mode="none",
                   precision=precision, float8=float8)
    assert sharded.autocast_copy_bytes == 0  # FSDP gathers bf16 weights whether or not the matmul is float8


def test_refusals_are_one_line(monkeypatch):
    assert float8_refusal(None) is None and float8_refusal((9, 0)) is None
    assert float8_refusal((8, 0)) == ("train.float8=true needs float8 tensor cores (compute capability 8.9+: Ada, "
                                      "Hopper, Blackwell); this GPU is sm80: set train.float8=false")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import torchao.float8` meets without torchao
    with pytest.raises(ConfigError) as refused:
        load_config(["model=xs", "train.float8=true"])
    message = str(refused.value)
    assert message.startswith("train.float8=true needs torchao (") and "\n" not in message
    assert message.endswith("install 'torchao>=0.18,<0.19' or set train.float8=false")


def test_mfu_divides_by_the_peak_of_the_float8_and_bf16_mix():
    cfg = load_config(["model=xs"])
    flops = training_flops_per_token(cfg.model, cfg.train.seq_len)["total"]
    model = build_model(cfg, device="meta")
    share = float8_flop_share(cfg.model, 1, flops)
    assert share == 6 * sum(model.get_submodule(name).weight.numel() for name in EXPECTED) / flops
    assert 0.3 < share < 0.5  # model=xs: 0.38; the routed experts, routers, lm_head and attention make the rest
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_for_device_name(h100) == 989.0 and peak_for_device_name(h100, 1.0) == pytest.approx(1979.0)
    # Half the FLOPs at 1979, half at 989: 1 / (0.5 / 1979 + 0.5 / 989) TFLOP/s.
    assert peak_for_device_name(h100, 0.5) == pytest.approx(1318.9, abs=0.1)
    assert peak_for_device_name("NVIDIA A100-SXM4-80GB", 0.5) is None  # no float8 tensor cores
