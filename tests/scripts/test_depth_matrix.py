"""scripts.depth_matrix on trained runs: rank 1 for the baseline, more for Full; the comparison report's M panel."""
import json

import pytest

import scripts.compare as compare
from conftest import fast_train_overrides
from parallel.dims import init_distributed
from scripts.depth_matrix import main
from trainer.config import load_config
from trainer.trainer import Trainer


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_dataset):
    """A baseline and a Full run of model=xs, 8 steps at a high learning rate so the queries move."""
    root = tmp_path_factory.mktemp("depth_matrix_runs")
    runs = {}
    for variant in ("baseline", "full"):
        runs[variant] = root / variant
        overrides = fast_train_overrides(runs[variant], tiny_dataset, steps=8, variant=variant, **{"optim.lr": 1e-2})
        Trainer(load_config(overrides), init_distributed()).fit()
    return runs


def summary(run_dir):
    return json.loads((run_dir / "depth_matrix" / "depth_matrix.json").read_text())


@pytest.mark.slow
def test_baseline_has_rank_one_and_full_a_higher_rank(trained_runs, capsys):
    for run_dir in trained_runs.values():
        main([f"checkpoint={run_dir}", "batches=2"])
    printed = capsys.readouterr().out
    assert "semiseparable rank mean 1.00, max 1" in printed
    baseline, full = summary(trained_runs["baseline"]), summary(trained_runs["full"])
    assert baseline["variant"] == "baseline" and baseline["step"] == 8 and baseline["samples"] == 2 * 2 * 32
    assert baseline["semiseparable_rank"]["fraction"] == {"1": 1.0}
    assert baseline["mean"][3] == [1.0] * 4 + [None] * 5 and baseline["std"][3][:4] == [0.0] * 4
    assert full["semiseparable_rank"]["max"] > 1 and full["semiseparable_rank"]["mean"] > 1.5
    # Full's rows are distributions: they sum to 1 (to fp32's rounding: the weights are fp32 softmaxes, averaged);
    # entropy below uniform's ln(l) once trained
    assert sum(full["mean"][8]) == pytest.approx(1.0, abs=1e-6)
    assert 0 < full["row_entropy"][8] < 2.1972  # ln 9
    assert (trained_runs["full"] / "depth_matrix" / "depth_matrix.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_comparison_report_shows_every_variants_matrix(trained_runs, tmp_path):
    for run_dir in trained_runs.values():
        main([f"checkpoint={run_dir}", "batches=1", f"out={run_dir / 'depth_matrix'}"])
    compare.main([f"runs=[{','.join(map(str, trained_runs.values()))}]", f"report_dir={tmp_path / 'report'}"])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Depth-mixing matrix M" in report and (tmp_path / "report" / "depth_matrix.png").is_file()
    assert "| xs | baseline | 1 | 1.00 | 1 |" in report


@pytest.mark.parametrize("args, message", [
    ([], "error: checkpoint= is required"),
    (["checkpoint=/nonexistent/run"], "error: /nonexistent/run does not exist"),
    (["checkpoint=x", "batches=0"], "error: batches=0 must be at least 1"),
    (["checkpoint=x", "depth=3"], "error: unknown key 'depth'"),
])
def test_bad_arguments_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exited:  # main(argv) in this process, as `python -m scripts.depth_matrix`
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(message) and err.count("\n") == 1
