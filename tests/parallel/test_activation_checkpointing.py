"""Activation checkpointing (train.activation_checkpointing): the same numbers as `none` (bitwise: loss,
every gradient, expert load counts, diagnostics, training losses), less activation memory."""
import json

import pytest
import torch
import torch.nn.functional as F

import resume_matrix
from conftest import fast_train_overrides, launch_job
from model import build_model
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.dims import init_distributed
from scripts.bench.memory import activation_bytes
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer
from tp_parity_worker import RELEASE_ATTENTION, RELEASE_MOE

VARIANTS = {
    "baseline": ["variant=baseline"],
    "full": ["variant=full"],
    "block": ["variant=block", "variant.two_phase=true"],
    # An AttnRes block spanning two transformer blocks: phase-1 reads cross the block boundary.
    "block_size4": ["variant=block", "variant.two_phase=true", "variant.block_size=4"],
    # Blocks straddling transformer blocks: the partial sum crosses the boundary.
    "block_size3": ["variant=block", "variant.two_phase=true", "variant.block_size=3"],
    "mhc": ["variant=mhc"],
    "block_aux_loss": ["variant=block", "variant.two_phase=true", "model.moe.aux_loss_coef=0.01"],
    "release_attention": ["variant=block", "variant.two_phase=true", *RELEASE_ATTENTION],  # K3's token mixers
    "release_moe": ["variant=block", "variant.two_phase=true", *RELEASE_MOE],  # K3's MoE (SiTU, latent, groups)
}
TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))


def model_for(overrides, mode):
    torch.manual_seed(0)
    model = build_model(load_config(["model=xs", *overrides]))
    apply_activation_checkpointing(model, mode)
    return model


def one_step(overrides, mode):
    """Loss, gradients, expert load counts and diagnostics of one forward + backward."""
    model = model_for(overrides, mode)
    diagnostics = {}
    logits = model(TOKENS, diagnostics=diagnostics)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), TOKENS.flatten()) + model.aux_loss()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    counts = [moe.load_counts.clone() for moe in model.moe_layers()]
    with torch.no_grad():
        eval_logits = model(TOKENS)
    return loss, grads, counts, diagnostics, eval_logits


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointed_step_is_bitwise_equal_to_none(variant, mode):
    loss, grads, counts, diagnostics, eval_logits = one_step(VARIANTS[variant], "none")
    ac_loss, ac_grads, ac_counts, ac_diagnostics, ac_eval_logits = one_step(VARIANTS[variant], mode)
    assert torch.equal(ac_loss, loss)
    assert grads.keys() == ac_grads.keys()
    missing = [name for name, g in grads.items() if g is None]
    assert missing == [], missing  # every parameter gets a gradient, so the comparison covers them all
    unequal = [name for name in grads if not torch.equal(ac_grads[name], grads[name])]
    assert unequal == []
    # The recomputation neither counts tokens twice nor records diagnostics twice.
    assert [c.sum().item() for c in counts] == [2 * 32 * 2] * 3
    assert all(torch.equal(a, b) for a, b in zip(ac_counts, counts))
    assert ac_diagnostics == diagnostics
    assert sorted(diagnostics["output_rms"]) == list(range(1, 9))
    assert torch.equal(ac_eval_logits, eval_logits)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["baseline", "block", "mhc"])
def test_checkpointing_stores_less_full_least(variant):
    saved = {mode: activation_bytes(model_for(VARIANTS[variant], mode), TOKENS)[0]
             for mode in ("none", "full", "selective")}
    assert saved["full"] < saved["selective"] < saved["none"], saved
    assert saved["full"] < 0.5 * saved["none"], saved


@pytest.mark.slow
def test_applying_again_replaces_the_mode():
    model = model_for(VARIANTS["block"], "full")
    apply_activation_checkpointing(model, "selective")
    assert activation_bytes(model, TOKENS)[0] == activation_bytes(model_for(VARIANTS["block"], "selective"), TOKENS)[0]
    apply_activation_checkpointing(model, "none")
    assert activation_bytes(model, TOKENS)[0] == activation_bytes(model_for(VARIANTS["block"], "none"), TOKENS)[0]


def test_an_unknown_mode_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        load_config(["train.activation_checkpointing=some"])
    assert str(error.value) == "train.activation_checkpointing='some' is not valid; allowed: none | full | selective"


@pytest.mark.slow
def test_the_trainer_checkpoints_its_model(tmp_path, tiny_dataset):
    saved = {}
    for mode in ("none", "full"):
        trainer = Trainer(load_config(fast_train_overrides(tmp_path / mode, tiny_dataset, **{
            "train.activation_checkpointing": mode})), init_distributed())
        try:
            saved[mode] = activation_bytes(trainer.model, TOKENS)[0]
        finally:
            trainer.close()
    assert saved["full"] < 0.5 * saved["none"], saved


def logged(run_dir) -> dict:
    """step -> (loss, gradient norm, expert load imbalance, diagnostics) from the run's JSONL files."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: [r["loss"], r["grad_norm"], r["moe_load_imbalance"], None] for r in rows if "loss" in r}
    diagnostics = run_dir / "diagnostics.jsonl"  # only where one rank holds the whole model (not under pp)
    for line in diagnostics.read_text().splitlines() if diagnostics.exists() else []:
        record = json.loads(line)
        steps[record["step"]][3] = record
    return steps


LAYOUTS = {"pp2_vp2": "full", "dp2_ep2": "selective", "tp2": "selective", "cp2": "selective"}


@launch_job(2)
def layout_runs(root, dataset):
    """Each layout with its checkpointing mode; the same layout without is the resume matrix's uninterrupted
    run (its settings are the same: resume_matrix.MATRIX_SETTINGS)."""
    return [fast_train_overrides(root / layout, dataset, steps=resume_matrix.STEPS, parallel=layout,
                                 **resume_matrix.MATRIX_SETTINGS[layout], **{"train.activation_checkpointing": mode})
            for layout, mode in LAYOUTS.items()]


def test_training_under_torchrun_matches_none(launched):
    """Each layout with its checkpointing mode, in the session's 2-rank launch, against the resume matrix's
    uninterrupted run of the layout without: the same losses, gradient norms, expert loads and diagnostics over
    4 steps, bitwise."""
    root, matrix = launched(layout_runs), launched(resume_matrix.JOBS[2])
    for layout, mode in LAYOUTS.items():
        without, checkpointed = logged(matrix / layout / "straight"), logged(root / layout)
        assert sorted(without) == [1, 2, 3, 4], layout
        assert (without[3][3] is not None) == (layout == "dp2_ep2"), layout  # diagnostics: with the whole model
        assert checkpointed == without, (layout, mode)
