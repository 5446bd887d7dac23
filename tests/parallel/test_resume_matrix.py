"""Every parallel preset stops and resumes in its own layout bitwise (tests/parallel/resume_matrix.py has the
matrix, each world size's runs a job of the session's launch of that size), and checkpoints move between the
layouts a user would change between: fsdp2 -> dp2 and a changed pipeline degree (dp2_pp2_vp2 -> pp4_vp2) here,
pp2_vp2 <-> one process in test_pipeline."""
from pathlib import Path

import pytest

import resume_matrix
from conftest import train_in_process
from trainer.config import load_config, validate_layout

PRESETS = Path(__file__).parents[2] / "configs" / "parallel"


@pytest.mark.slow
def test_every_preset_is_in_the_matrix_at_its_world_size(tiny_dataset):
    assert {preset.stem for preset in PRESETS.glob("*.yaml")} == set(resume_matrix.MATRIX_SETTINGS)
    for world, layouts in resume_matrix.MATRIX.items():
        for layout in layouts:
            overrides = resume_matrix._overrides(Path("unused"), tiny_dataset, layout)
            validate_layout(load_config(overrides), world)  # raises where the settings do not fit the layout


@pytest.mark.slow
def test_one_process_stops_and_resumes_bitwise(tmp_path, tiny_dataset):
    for overrides in resume_matrix.runs(1, tmp_path, tiny_dataset):
        train_in_process(overrides)
    resume_matrix.assert_resumed_bitwise(1, tmp_path)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_every_preset_stops_and_resumes_bitwise_in_its_own_layout(world, launched):
    resume_matrix.assert_resumed_bitwise(world, launched(resume_matrix.JOBS[world]))
