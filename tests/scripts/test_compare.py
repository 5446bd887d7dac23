"""The comparison tool: an unfinished run resumes, a finished one is not trained again, the report follows."""
import json
import shutil

import pytest

import scripts.compare as compare
from scripts.experiments import load_experiment
from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import latest_checkpoint
from trainer.run_dir.finished import FINISHED_FILE
from trainer.config import load_config
from trainer.trainer import Trainer


def steps_logged(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_run_experiment(tmp_path, tiny_dataset, variant):
    """A 4-step experiment of one run, seed 0: its shared overrides, the tool's arguments, its run directory."""
    shared = [o for o in fast_train_overrides(tmp_path, tiny_dataset, steps=4) if not o.startswith("run.dir=")]
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(json.dumps({"seeds": [0], "shared": shared,
                                      "runs": [{"name": f"xs-{variant}", "overrides": [f"variant={variant}"]}]}))
    tool = [f"experiment={experiment}", f"runs_dir={tmp_path / 'runs'}", f"report_dir={tmp_path / 'report'}"]
    return shared, tool, tmp_path / "runs" / f"xs-{variant}-s0"


@pytest.mark.slow
def test_unfinished_run_resumes_and_finished_run_is_skipped(tmp_path, tiny_dataset, monkeypatch):
    shared, tool, run_dir = one_run_experiment(tmp_path, tiny_dataset, "baseline")
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

    compare.main([f"runs={run_dir.parent}/*", f"report_dir={tmp_path / 'only'}"])
    assert f"1 runs: `{run_dir}`." in (tmp_path / "only" / "report.md").read_text()


def test_runs_items_are_reported_in_their_order(tmp_path, monkeypatch):
    """runs= may repeat, each item a list or a glob (its matches sorted), a glob's brackets as typed."""
    for name in ("b-s0", "a-s1", "a-s0"):
        (tmp_path / name).mkdir()
    reported = []
    monkeypatch.setattr(compare, "build_report", lambda run_dirs, out, title: reported.append((run_dirs, out)) or out)
    compare.main([f"runs=[{tmp_path / 'b-s0'}]", f"runs={tmp_path}/[a]-s*", f"report_dir={tmp_path / 'report'}"])
    assert reported == [([str(tmp_path / "b-s0"), str(tmp_path / "a-s0"), str(tmp_path / "a-s1")],
                         str(tmp_path / "report"))]


@pytest.mark.slow
def test_a_finished_run_whose_checkpoints_were_deleted_is_neither_retrained_nor_wiped(tmp_path, tiny_dataset,
                                                                                     monkeypatch, capsys):
    """Deleting a finished run's checkpoints frees disk; without finished.json the next launch would train
    it again from step 0 and drop its metrics."""
    _, tool, run_dir = one_run_experiment(tmp_path, tiny_dataset, "block")
    compare.main(tool)
    assert json.loads((run_dir / FINISHED_FILE).read_text()) == {"step": 4}
    shutil.rmtree(run_dir / "checkpoints")
    metrics = (run_dir / "metrics.jsonl").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare, "Trainer", no_training)
    compare.main(tool)
    assert "xs-block-s0: finished (4/4 steps), skipped" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    with pytest.raises(SystemExit) as exit_info:
        compare.main([*tool, "train.steps=6"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[1:] == [f"[compare] error: {run_dir} finished at step 4 and has no checkpoint to extend it to "
                         "train.steps=6; start it in a new runs_dir, or keep train.steps=4"]
    assert (run_dir / "metrics.jsonl").read_text() == metrics


@pytest.mark.slow
def test_a_forged_finished_json_is_not_believed_over_the_checkpoints(tmp_path, tiny_dataset, capsys):
    """A finished.json at train.steps in a run whose checkpoints and metrics stop at step 2 used to make the
    grid skip an unfinished run; it now resumes, with one line saying why."""
    shared, tool, run_dir = one_run_experiment(tmp_path, tiny_dataset, "baseline")
    Trainer(load_config([*shared, "variant=baseline", "seed=0", f"run.dir={run_dir}", "train.stop_after=2",
                         "train.ckpt_every=2"]), init_distributed()).fit()
    (run_dir / FINISHED_FILE).write_text('{"step": 4}\n')
    capsys.readouterr()
    compare.main(tool)
    assert (f"[compare] {run_dir}: finished.json records step 4, but its newest checkpoint is at step 2 and "
            "metrics.jsonl logs no step 4; not treated as finished") in capsys.readouterr().err.splitlines()
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    assert latest_checkpoint(run_dir).name == "step_00000004"


def fake_run(tmp_path, checkpoints, logged, finished):
    """A run directory as finished_at reads it: complete checkpoints (a meta.json each), metrics rows, finished.json."""
    run = tmp_path / "run"
    for step in checkpoints:
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:08d}" / "meta.json").write_text("{}")
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in logged))
    (run / FINISHED_FILE).write_text(json.dumps({"step": finished}))
    return run


@pytest.mark.parametrize("checkpoints, logged, believed", [
    ([], [], 6),               # checkpoints deleted on purpose: finished.json is all that is left
    ([6], [1, 2, 3, 4, 5, 6], 6),
    ([3], [1, 2, 3, 4, 5, 6], 6),  # the last checkpoint deleted, an earlier (pinned) one kept: the metrics show 6
    ([3], [1, 2, 3], 0),       # nothing past step 3: not finished at 6
    ([3, 9], [], 6),           # extended past it since: the newer checkpoint counts
])
def test_finished_json_is_believed_where_checkpoints_or_metrics_reach_its_step(tmp_path, checkpoints, logged,
                                                                               believed):
    said = []
    assert compare.finished_at(fake_run(tmp_path, checkpoints, logged, finished=6), said.append) == believed
    assert len(said) == (believed == 0)


def test_unknown_experiment_is_one_clear_line(capsys):
    with pytest.raises(SystemExit):
        compare.main(["experiment=nope"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("experiment='nope' is not one of ablations | controls | controls_long | cpu_repro | long_blend | "
            "long_blend_lr | long_blend_tuned | lr_sweep | muon_lr_sweep | quick | scaling") in err


def test_the_long_blend_grid_without_its_corpus_location_is_one_clear_line(capsys, monkeypatch, tmp_path):
    """long_blend reads `make corpus`'s blend under $ATTNRES_DATA_CACHE: unset, the first run's config says so
    before anything trains."""
    monkeypatch.delenv("ATTNRES_DATA_CACHE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["experiment=long_blend_lr", f"runs_dir={tmp_path / 'runs'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "runs").exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "[compare] error: KeyError raised while resolving interpolation: \"Environment variable "
        "'ATTNRES_DATA_CACHE' not found\"")


def test_shards_split_the_plan_and_the_last_call_reports(tmp_path, tiny_dataset, monkeypatch):
    shared = [o for o in fast_train_overrides(tmp_path, tiny_dataset, steps=2) if not o.startswith("run.dir=")]
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(json.dumps({"seeds": [0, 1], "shared": shared,
                                      "runs": [{"name": "xs-baseline", "overrides": ["variant=baseline"]}]}))
    tool = [f"experiment={experiment}", f"runs_dir={tmp_path / 'runs'}", f"report_dir={tmp_path / 'report'}"]
    compare.main([*tool, "shard=1/2"])  # the plan is seed-major: s0, s1; worker 1 of 2 trains s1 only
    assert steps_logged(tmp_path / "runs" / "xs-baseline-s1") == [1, 2]
    assert not (tmp_path / "runs" / "xs-baseline-s0").exists() and not (tmp_path / "report").exists()
    compare.main([*tool, "shard=0/2"])
    assert steps_logged(tmp_path / "runs" / "xs-baseline-s0") == [1, 2]

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare, "Trainer", no_training)
    compare.main(tool)
    assert "0,1" in (tmp_path / "report" / "report.md").read_text()  # one group, both seeds


@pytest.mark.parametrize("shard", ["2/2", "x", "1"])
def test_bad_shard_is_one_clear_line(shard, capsys):
    with pytest.raises(SystemExit):
        compare.main(["experiment=quick", f"shard={shard}"])
    assert f"shard={shard} must be K/N with 0 <= K < N (worker K of N), e.g. shard=0/2" in capsys.readouterr().err


@pytest.mark.lm_eval
def test_eval_tasks_give_the_report_a_downstream_table(tmp_path, tiny_dataset):
    shared = [o for o in fast_train_overrides(tmp_path, tiny_dataset, steps=2) if not o.startswith("run.dir=")]
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(json.dumps({
        "seeds": [0], "shared": shared, "eval": {"tasks": ["attnres_mc_words"], "limit": 6},
        "runs": [{"name": "xs-baseline", "overrides": ["variant=baseline"]},
                 {"name": "xs-block", "overrides": ["variant=block", "variant.block_size=2"]}]}))
    compare.main([f"experiment={experiment}", f"runs_dir={tmp_path / 'runs'}", f"report_dir={tmp_path / 'report'}"])
    accuracy = {}
    for name in ("xs-baseline-s0", "xs-block-s0"):
        run_dir = tmp_path / "runs" / name
        results = json.loads((run_dir / "eval.json").read_text())
        accuracy[name] = results["tasks"]["attnres_mc_words"]["metrics"]["acc"]["value"]
        assert results["settings"]["limit"] == 6
        assert not (run_dir / "eval-export").exists()
    report = (tmp_path / "report" / "report.md").read_text()
    section = report[report.index("## Downstream tasks"):]
    baseline_row = next(line for line in section.splitlines() if "| acc |" in line and "| baseline |" in line)
    block_row = next(line for line in section.splitlines() if "| acc |" in line and "| block S=2 |" in line)
    assert f"| {accuracy['xs-baseline-s0']:.4f} ± " in baseline_row and baseline_row.endswith("| - |")
    assert f"{accuracy['xs-block-s0'] - accuracy['xs-baseline-s0']:+.4f} (n=1)" in block_row


def test_a_bad_eval_block_is_one_clear_line(tmp_path, capsys):
    experiment = tmp_path / "bad.yaml"
    experiment.write_text(json.dumps({"seeds": [0], "eval": {"task": ["x"]},
                                      "runs": [{"name": "a", "overrides": []}]}))
    with pytest.raises(SystemExit):
        compare.main([f"experiment={experiment}"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eval must be {tasks: [NAME, ...], limit: N, num_fewshot: N}" in err


def test_the_quick_experiment_evaluates_on_the_local_tasks():
    from inference.evaluate import LOCAL_TASKS, task_manager_for

    evaluation = load_experiment("quick").evaluation
    assert evaluation.tasks == ["attnres_local"]
    manager = task_manager_for(evaluation.tasks, LOCAL_TASKS)
    assert {"attnres_mc_words", "attnres_gen_words"} <= set(manager.all_tasks)


def tuned_experiment(tmp_path, tiny_dataset):
    """Baseline and Block S=2 (xs), a tuning stage of 2 steps at two learning rates, seed 0, then 3 steps at each
    arm's chosen rate."""
    shared = [o for o in fast_train_overrides(tmp_path, tiny_dataset, steps=3) if not o.startswith("run.dir=")]
    experiment = tmp_path / "tuned.yaml"
    experiment.write_text(json.dumps({
        "seeds": [0], "shared": shared, "tune": {"key": "optim.lr", "values": [3e-2, 3e-3], "steps": 2, "seeds": [0]},
        "runs": [{"name": "base", "overrides": ["variant=baseline"]},
                 {"name": "block", "overrides": ["variant=block", "variant.block_size=2"]}]}))
    return [f"experiment={experiment}", f"runs_dir={tmp_path / 'runs'}", f"report_dir={tmp_path / 'report'}"]


def last_val_loss(run_dir):
    return [json.loads(line)["val_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("val_loss") is not None][-1]


@pytest.mark.slow
def test_a_tuning_stage_is_sharded_and_each_arm_trains_at_its_own_best_value(tmp_path, tiny_dataset, capsys):
    tool = tuned_experiment(tmp_path, tiny_dataset)
    tune = tmp_path / "runs" / "tune"
    compare.main([*tool, "shard=0/2"])  # the sweep's plan: base at 0.003, 0.03, block at 0.003, 0.03
    assert sorted(path.name for path in tune.iterdir()) == ["base-lr0.003-s0", "block-lr0.003-s0"]
    assert ("[compare] tuning stage: 2 of 4 runs not finished (base-lr0.03-s0, block-lr0.03-s0); the runs on the "
            "full budget wait for them: run this again once they are") in capsys.readouterr().err.splitlines()
    compare.main([*tool, "shard=1/2"])  # the rest of the sweep, then its share of the full-budget runs
    chosen = {arm: min((0.003, 0.03), key=lambda lr: last_val_loss(tune / f"{arm}-lr{lr:g}-s0"))
              for arm in ("base", "block")}
    full = [f"{arm}-lr{chosen[arm]:g}-s0" for arm in ("base", "block")]
    assert not (tmp_path / "runs" / full[0]).exists() and steps_logged(tmp_path / "runs" / full[1]) == [1, 2, 3]
    compare.main([*tool, "shard=0/2"])
    compare.main(tool)  # every run finished: the report
    for arm, name in zip(("base", "block"), full):
        assert steps_logged(tmp_path / "runs" / name) == [1, 2, 3]
        config = (tmp_path / "runs" / name / "config.yaml").read_text()
        assert f"lr: {chosen[arm]}" in config
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| arm | seeds | 0.003 | 0.03 | chosen |" in report
    for arm, variant in (("base", "baseline"), ("block", "block S=2")):
        # two values: every choice is at an edge of the values tried
        side = "lowest" if chosen[arm] == 0.003 else "highest"
        assert (f"- **xs {variant}: the choice {chosen[arm]:g} is the {side} value tried, so the optimum may lie "
                "beyond it: widen the sweep.**") in report
    tuned_rows = [line for line in report.splitlines() if line.startswith("| xs each tuned |")]
    assert [row.split(" | ")[1] for row in tuned_rows] == ["baseline", "block S=2"]
    block_minus_base = last_val_loss(tmp_path / "runs" / full[1]) - last_val_loss(tmp_path / "runs" / full[0])
    assert f"| {block_minus_base:+.4f} | 1 |" in tuned_rows[1]


@pytest.mark.parametrize("by_value, value, edge", [
    ({1e-3: {0: 4.80, 1: 4.90}, 2e-3: {0: 4.70, 1: 4.86}, 4e-3: {0: 4.75, 1: 4.70}}, 4e-3, True),  # 4.725 < 4.78
    ({1e-3: {0: 4.80}, 2e-3: {0: 4.70}, 4e-3: {0: 4.75}}, 2e-3, False),
    # seed 1 only at 1e-3 and 4e-3: the paired mean is over seed 0, the seed every value has
    ({1e-3: {0: 4.80, 1: 4.00}, 2e-3: {0: 4.70}, 4e-3: {0: 4.75, 1: 4.10}}, 2e-3, False),
])
def test_the_choice_is_the_lowest_paired_mean_and_an_edge_choice_is_flagged(by_value, value, edge):
    from scripts.report.tuning import choose

    choice = choose(by_value)
    assert choice.value == value and choice.at_edge == edge
    assert choice.seeds == ((0, 1) if value == 4e-3 else (0,))


def test_report_only_names_the_planned_runs_not_started(tmp_path, tiny_dataset, capsys):
    _, tool, run_dir = one_run_experiment(tmp_path, tiny_dataset, "baseline")
    with pytest.raises(SystemExit):
        compare.main([*tool, "report_only=true"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"[compare] error: experiment tiny: no run has started yet, so there is nothing to report (planned: {run_dir})")
    compare.main([*tool, "seeds=[0,1]", "shard=0/2"])  # seed 0 only
    compare.main([*tool, "seeds=[0,1]", "report_only=true"])
    report = (tmp_path / "report" / "report.md").read_text()
    assert (f"1 runs: `{run_dir}`. Not started yet, so not in this report (1): "
            f"`{run_dir.parent / 'xs-baseline-s1'}`.") in report
    assert not (run_dir.parent / "xs-baseline-s1").exists()
    with pytest.raises(SystemExit):
        compare.main([*tool, "report_only=maybe"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: report_only: Value 'maybe' is not a valid bool (type str)")
