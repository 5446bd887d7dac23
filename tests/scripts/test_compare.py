"""The comparison tool: an unfinished run resumes, a finished one is not trained again, the report follows."""
import json

import pytest

import scripts.compare as compare
from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.checkpoint import latest_checkpoint
from trainer.config import load_config
from trainer.trainer import Trainer


def steps_logged(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unfinished_run_resumes_and_finished_run_is_skipped(tmp_path, tiny_dataset, monkeypatch):
    shared = [o for o in fast_train_overrides(tmp_path, tiny_dataset, steps=4) if not o.startswith("run.dir=")]
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(json.dumps({"seeds": [0], "shared": shared,
                                      "runs": [{"name": "xs-baseline", "overrides": ["variant=baseline"]}]}))
    tool = [f"experiment={experiment}", f"runs_dir={tmp_path / 'runs'}", f"report_dir={tmp_path / 'report'}"]
    run_dir = tmp_path / "runs" / "xs-baseline-s0"
    Trainer(load_config([*shared, "variant=baseline", "seed=0", f"run.dir={run_dir}", "train.stop_after=2",
                         "train.ckpt_every=2"]), init_distributed()).fit()
    assert latest_checkpoint(run_dir).name == "step_00000002"

    compare.main(tool)  # resumes at step 2 and finishes
    assert latest_checkpoint(run_dir).name == "step_00000004"
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    assert (tmp_path / "report" / "report.md").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare, "Trainer", no_training)
    (tmp_path / "report" / "report.md").unlink()
    compare.main(tool)
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    assert (tmp_path / "report" / "report.md").is_file()

    compare.main(["--report-only", str(run_dir), "--out", str(tmp_path / "only")])
    assert (tmp_path / "only" / "report.md").is_file()


def test_unknown_experiment_is_one_clear_line(capsys):
    with pytest.raises(SystemExit):
        compare.main(["experiment=nope"])
    assert "experiment='nope' is not one of ablations | cpu_repro | lr_sweep | quick | scaling" in capsys.readouterr().err
