"""The resume matrix: every preset of configs/parallel/ stopped after step 3 resumes in its own layout and
ends like its uninterrupted run, bitwise (the losses, gradient norm and validation loss of step 4, and
every weight of the step-4 checkpoint).

The runs of one world size are a job (JOBS) of the session's launch of that world size, beside its other
jobs (tests/conftest.py, `launched`); tests/parallel/test_resume_matrix.py checks them. The uninterrupted runs
also give other tests their layout's run, stopped after step 3 (copy_as_stopped), instead of training their
own: test_fsdp's composed layouts, test_tensor_parallel's and test_pipeline's expert-parallel layouts; and whole,
test_activation_checkpointing's runs without checkpointing. One
process runs in the test process.

Up to 2 ranks a run is stopped with train.stop_after=3 and launched again with the same command
(resume=auto, what `make train` does); from 4 ranks on, where every run costs a few seconds, the resumed run
starts in a new directory from the step-3 checkpoint of the uninterrupted run (resume=PATH), which is the
same load.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import fast_train_overrides, launch_job
from parallel.compat import context_parallel_refusal
from trainer.trained import load_trained

STEPS, STOP = 4, 3  # fast_train_overrides checkpoints every 3 steps: step 3 is a checkpoint of every run
MATRIX: dict[int, dict[str, dict]] = {  # world size -> preset -> the settings its layout needs
    1: {"single": {}},
    2: {"cp2": {}, "dp2": {}, "dp2_ep2": {}, "fsdp2": {}, "pp2": {}, "pp2_vp2": {}, "tp2": {}},
    4: {
        "cp2_pp2": {},
        "dp2_fsdp2": {"train.micro_batch": 1},
        # 4 validation batches: fewer than a pipeline's microbatches give no validation loss
        "dp2_pp2_vp2": {"train.global_batch": 8, "model.n_blocks": 8, "train.eval_batches": 4},
        "fsdp2_cp2": {},
        "fsdp2_ep2": {"train.micro_batch": 1},
        "fsdp2_pp2": {"train.global_batch": 8},
        "fsdp2_tp2": {},
        "pp2_ep2": {"train.global_batch": 8},
        "pp4_vp2": {"train.global_batch": 8, "model.n_blocks": 8, "train.eval_batches": 4},  # 8 chunks: 8 blocks
        "tp2_pp2": {},
    },
    8: {
        "dp2_fsdp2_pp2_ep2": {"train.micro_batch": 1, "train.global_batch": 8},
        "dp2_fsdp2_tp2_ep2": {"train.micro_batch": 1},
        "fsdp2_pp2_tp2": {"train.global_batch": 8},
        "fsdp2_cp2_tp2": {"train.micro_batch": 1},
    },
    16: {"dp2_fsdp2_pp2_tp2_ep2": {"train.micro_batch": 1, "train.global_batch": 8}},
}
MATRIX_SETTINGS = {layout: settings for layouts in MATRIX.values() for layout, settings in layouts.items()}
RELAUNCHED_UP_TO = 2  # world sizes up to this one stop and relaunch; larger ones resume a path
# Checkpoints moved between layouts that a user would make, each against the target layout's own
# uninterrupted run (rel 1e-5: another layout sums in another order). world size -> (source, target).
CROSS: dict[int, list[tuple[str, str]]] = {
    2: [("fsdp2", "dp2")],
    4: [("dp2_pp2_vp2", "pp4_vp2")],  # the pipeline degree changes: 2 stages of 2 chunks -> 4 stages of 2
}


def step_checkpoint(run_dir: Path, step: int = STOP) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _overrides(run_dir: Path, dataset, layout: str, **extra) -> list[str]:
    return fast_train_overrides(run_dir, dataset, steps=STEPS, parallel=layout, **MATRIX_SETTINGS[layout], **extra)


def runs(world: int, root: Path, dataset) -> list[list[str]]:
    """The runs of `world` ranks, in launch order: per preset the uninterrupted run, then the stopped and
    resumed one; then the cross-layout resumptions."""
    planned = []
    # parallel.cp > 1 is refused before torch 2.13 (parallel/compat.py): `make compat` on an older release
    # launches the other presets.
    runnable = [layout for layout in MATRIX[world] if "cp" not in layout or context_parallel_refusal() is None]
    for layout in runnable:
        straight, resumed = root / layout / "straight", root / layout / "resumed"
        planned.append(_overrides(straight, dataset, layout))
        if world <= RELAUNCHED_UP_TO:
            planned += [_overrides(resumed, dataset, layout, **{"train.stop_after": STOP}),
                        _overrides(resumed, dataset, layout)]
        else:
            planned.append(_overrides(resumed, dataset, layout, resume=step_checkpoint(straight)))
    for source, target in CROSS.get(world, []):
        planned.append(_overrides(root / f"{source}_to_{target}", dataset, target,
                                  resume=step_checkpoint(root / source / "straight")))
    return planned


JOBS = {world: launch_job(world, f"resume_matrix_{world}")(
    lambda directory, dataset, world=world: runs(world, directory, dataset)) for world in MATRIX if world > 1}


def _records(run_dir: Path) -> dict[int, dict]:
    """{step: the metrics of that step} (a step's training record and its validation record merged)."""
    merged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["step"], {}).update(record)
    return merged


def _compared(record: dict) -> dict:
    # val_loss at steps 3 and 4: step 4's reads the weights of step 4's update, which the resumed optimizer made
    return {key: record.get(key) for key in ("loss", "grad_norm", "val_loss")}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_trained(step_checkpoint(run_dir, STEPS)).model.state_dict()


def assert_resumed_bitwise(world: int, root: Path) -> None:
    """Each preset's resumed run ends with its uninterrupted run's step-4 metrics and weights, bit for bit;
    each cross-layout resumption with the target layout's step-4 metrics (rel 1e-5)."""
    for layout in MATRIX[world]:
        straight, resumed = root / layout / "straight", root / layout / "resumed"
        expected, found = _records(straight), _records(resumed)
        assert sorted(expected) == list(range(1, STEPS + 1)), layout
        assert None not in _compared(expected[STEPS]).values(), (layout, expected[STEPS])
        assert sorted(found) == (list(range(1, STEPS + 1)) if world <= RELAUNCHED_UP_TO else [STEPS]), layout
        for step in range(STOP + 1 if world > RELAUNCHED_UP_TO else 1, STEPS + 1):
            assert _compared(found[step]) == _compared(expected[step]), (layout, step)
        weights, reference = _weights(resumed), _weights(straight)
        assert weights.keys() == reference.keys(), layout
        for name, value in weights.items():
            assert torch.equal(value, reference[name]), (layout, name)
    for source, target in CROSS.get(world, []):
        found, expected = _records(root / f"{source}_to_{target}")[STEPS], _records(root / target / "straight")[STEPS]
        for key, value in _compared(found).items():
            assert value == pytest.approx(expected[key], rel=1e-5), (source, target, key)


def copy_as_stopped(straight: Path, stopped: Path) -> None:
    """`stopped`: the uninterrupted run `straight` as it stood after step 3, as if train.stop_after=3 had ended
    it there (its later checkpoints and finished.json gone; a resume drops its later metrics rows itself)."""
    shutil.copytree(straight, stopped)
    for checkpoint in (stopped / "checkpoints").glob("step_*"):
        if int(checkpoint.name.removeprefix("step_")) > STOP:
            shutil.rmtree(checkpoint)
    (stopped / "finished.json").unlink()
