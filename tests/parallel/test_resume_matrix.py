"""Every parallel preset stops and resumes in its own layout bitwise (tests/parallel/resume_matrix.py has the
matrix; its 4-, 8- and 16-rank rows run in test_fsdp's composed launches), and checkpoints move between the
layouts a user would change between: fsdp2 -> dp2 here, a changed pipeline degree (dp2_pp2_vp2 -> pp4_vp2) in
the 4-rank launch, pp2_vp2 <-> one process in test_pipeline."""
from pathlib import Path

import resume_matrix
from conftest import torchrun_runs, train_in_process
from trainer.config import load_config, validate_layout

PRESETS = Path(__file__).parents[2] / "configs" / "parallel"


def test_every_preset_is_in_the_matrix_at_its_world_size(tiny_dataset):
    assert {preset.stem for preset in PRESETS.glob("*.yaml")} == set(resume_matrix.MATRIX_SETTINGS)
    for world, layouts in resume_matrix.MATRIX.items():
        for layout in layouts:
            overrides = resume_matrix._overrides(Path("unused"), tiny_dataset, layout)
            validate_layout(load_config(overrides), world)  # raises where the settings do not fit the layout


def test_one_process_stops_and_resumes_bitwise(tmp_path, tiny_dataset):
    for overrides in resume_matrix.runs(1, tmp_path, tiny_dataset):
        train_in_process(overrides)
    resume_matrix.assert_resumed_bitwise(1, tmp_path)


def test_every_two_rank_preset_stops_and_resumes_bitwise_in_its_own_layout(tmp_path, tiny_dataset):
    result = torchrun_runs(resume_matrix.runs(2, tmp_path, tiny_dataset), tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    resume_matrix.assert_resumed_bitwise(2, tmp_path)
