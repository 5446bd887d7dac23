"""The comparison report on real tiny runs (baseline and Block), plus copies of them edited into a
block-size sweep and a three-size scaling grid; the power-law fit on a known law."""
import json
import math
import shutil

import pytest
from omegaconf import OmegaConf

from conftest import fast_train_overrides
from parallel.dims import init_distributed
import scripts.compare as compare
from scripts.report import build_report
from scripts.report.runs import Run
from scripts.report.stats import PowerLaw, compute_multiplier, fit_power_law
from scripts.report.sweeps import parabola_minimum
from trainer.config import load_config
from trainer.trainer import Trainer

pytestmark = pytest.mark.lm_eval  # tiny_runs, which most tests read, scores lm_eval's local tasks


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, tiny_dataset):
    """A finished baseline and Block (S=2) run of 6 steps with diagnostics at steps 3 and 6; the baseline also
    scores lm_eval's local tasks at steps 3 and 6 (train.eval_tasks, 4 examples each)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    tasks = ["train.eval_tasks=[attnres_local]", "train.eval_tasks_every=3", "train.eval_tasks_limit=4"]
    for name, variant in (("baseline", ["variant=baseline", *tasks]),
                          ("block", ["variant=block", "variant.block_size=2"])):
        dirs[name] = root / f"xs-{name}-s0"
        Trainer(load_config([*fast_train_overrides(dirs[name], tiny_dataset, steps=6), *variant]),
                init_distributed()).fit()
    return dirs


def final_val_loss(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


def edited_copy(source, target, config: dict, loss_scale: float = 1.0):
    """A copy of a run directory with config keys replaced and every loss scaled."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = OmegaConf.load(target / "config.yaml")
    for key, value in config.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, target / "config.yaml")
    records = [json.loads(line) for line in (target / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.update({k: r[k] * loss_scale for k in ("loss", "val_loss") if k in r})
    (target / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return target


def test_report_holds_every_figure_and_the_runs_numbers(tmp_path, tiny_runs):
    report = build_report(list(tiny_runs.values()), tmp_path / "report", "tiny")
    out = report.parent
    for name in ["loss_vs_tokens.png", "loss_vs_compute.png", "task_metrics_vs_tokens.png", "magnitudes_xs.png",
                 "depth_xs_block-S-2.png", "layer_importance.png", "moe_imbalance.png"]:
        assert (out / name).stat().st_size > 1000, name
    text = report.read_text()
    rows = [json.loads(line) for line in (tiny_runs["baseline"] / "metrics.jsonl").read_text().splitlines()]
    accuracy = [(row["tokens"], row["eval/attnres_mc_words/acc"]) for row in rows if "eval_tasks_time_s" in row]
    assert [tokens for tokens, _ in accuracy] == [3 * 128, 6 * 128]
    assert Run.load(tiny_runs["baseline"]).task_curves["attnres_mc_words/acc"] == accuracy
    assert Run.load(tiny_runs["block"]).task_curves == {}
    for run_dir in tiny_runs.values():
        assert f"{final_val_loss(run_dir):.4f}" in text
    diff = final_val_loss(tiny_runs["block"]) - final_val_loss(tiny_runs["baseline"])
    assert f"{diff:+.4f}" in text
    assert "n=1: no interval" in text
    assert "| xs | block S=2 |" in text and "pre-attention" in text
    baseline_imbalance = [json.loads(line).get("moe_load_imbalance")
                          for line in (tiny_runs["baseline"] / "metrics.jsonl").read_text().splitlines()]
    tail = [v for v in baseline_imbalance if v is not None]
    tail = tail[len(tail) * 3 // 4:]
    assert f"- xs baseline: max/mean expert load over the last quarter of logged steps {sum(tail) / len(tail):.2f}" \
        in text
    for image in [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]:
        assert (out / image).is_file(), image


def test_report_draws_the_block_size_sweep_and_the_scaling_fit(tmp_path, tiny_runs):
    runs = [*tiny_runs.values(), edited_copy(tiny_runs["block"], tmp_path / "xs-block4-s0",
                                             {"model.residual.block_size": 4}, loss_scale=1.01)]
    for i, width in enumerate((128, 192)):  # two more sizes: three in all for each variant
        for name, source in tiny_runs.items():
            runs.append(edited_copy(source, tmp_path / f"w{width}-{name}-s0", {"model.d_model": width},
                                    loss_scale=0.9 - 0.1 * i))
    report = build_report(runs, tmp_path / "report", "sweep")
    text = report.read_text()
    assert (report.parent / "block_size_sweep_xs.png").is_file() and "## Block-size sweep (xs)" in text
    assert (report.parent / "scaling.png").is_file() and "| baseline |" in text.split("## Scaling")[1]
    assert "the baseline's fit needs" in text


def test_power_law_fit_recovers_a_known_law():
    law = PowerLaw(A=40.0, alpha=0.07)
    compute = [1e15, 3e15, 1e16, 4e16, 1e17]
    fit = fit_power_law(compute, [law.loss(c) for c in compute])
    assert fit.A == pytest.approx(40.0, rel=1e-9) and fit.alpha == pytest.approx(0.07, rel=1e-9)
    # A variant that reaches at C the baseline's loss at 1.25 C has a 1.25x compute multiplier.
    assert compute_multiplier(law, law.loss(1.25e17), 1e17) == pytest.approx(1.25, rel=1e-9)


def test_report_draws_the_lr_sweep_with_each_variants_best(tmp_path, tiny_runs):
    """Runs that differ in lr form one group per (lr, variant); each is compared with the baseline at its lr."""
    runs = []
    for lr, scale in ((1e-3, 1.02), (3e-3, 1.0), (1e-2, 1.05)):
        for name, source in tiny_runs.items():
            runs.append(edited_copy(source, tmp_path / f"{name}-lr{lr:g}-s0", {"optim.lr": lr}, loss_scale=scale))
    report = build_report(runs, tmp_path / "report", "lr sweep")
    text = report.read_text()
    assert (report.parent / "lr_sweep.png").stat().st_size > 1000
    base = final_val_loss(tiny_runs["baseline"])
    assert "- xs baseline init=scaled: best lr 0.003; a parabola in log lr through it and its neighbours has its " \
           f"minimum at 0.00" in text and f"mean final loss by lr: 0.001: {base * 1.02:.4f}" in text
    assert "| xs lr=0.01 | block S=2 |" in text
    # Each lr's Block row is compared with the baseline at the same lr (equal scales: the unscaled difference).
    diff = final_val_loss(tiny_runs["block"]) - base
    assert text.count(f"| {diff * 1.05:+.4f} |") == 1 and text.count(f"| {diff * 1.02:+.4f} |") == 1


def test_runs_that_differ_in_optimizer_or_muon_lr_are_rows_of_their_own(tmp_path, tiny_runs):
    """A Muon learning-rate sweep with its AdamW control: one row per (optimizer, muon_lr), not one pooled row."""
    source = tiny_runs["baseline"]
    runs = [edited_copy(source, tmp_path / "adamw-s0", {}),
            *(edited_copy(source, tmp_path / f"muon{lr:g}-s0", {"optim.name": "muon", "optim.muon_lr": lr},
                          loss_scale=scale) for lr, scale in ((0.01, 0.99), (0.02, 0.98)))]
    text = build_report(runs, tmp_path / "report", "muon sweep").read_text()
    base = final_val_loss(source)
    for setting, loss in (("xs optim=adamw", base), ("xs optim=muon muon_lr=0.01", base * 0.99),
                          ("xs optim=muon muon_lr=0.02", base * 0.98)):
        row = next(line for line in text.splitlines() if line.startswith(f"| {setting} | baseline |"))
        assert f"| {loss:.4f} |" in row, row


def test_dense_runs_are_a_setting_of_their_own_named_after_their_size(tmp_path, tiny_runs):
    """The dense-vs-MoE control: an xs run with every block dense is `xs dense`, compared with its own baseline."""
    source = tiny_runs["baseline"]
    runs = [edited_copy(source, tmp_path / "moe-s0", {}),
            edited_copy(source, tmp_path / "dense-s0", {"model.n_dense_layers": 4}, loss_scale=1.01),
            edited_copy(source, tmp_path / "two-dense-s0", {"model.n_dense_layers": 2}, loss_scale=1.02)]
    text = build_report(runs, tmp_path / "report", "dense").read_text()
    base = final_val_loss(source)
    for setting, loss in (("xs", base), ("xs dense", base * 1.01), ("xs n_dense_layers=2", base * 1.02)):
        row = next(line for line in text.splitlines() if line.startswith(f"| {setting} | baseline |"))
        assert f"| {loss:.4f} |" in row, row


def seeded_copies(tiny_runs, tmp_path, one_block_scale: float) -> list:
    """Baseline and one-block (S = 8 = L at xs) runs at seeds 0 and 1 with a known spread."""
    runs = []
    for seed, jitter in ((0, 1.0), (1, 1.004)):
        runs.append(edited_copy(tiny_runs["baseline"], tmp_path / f"baseline-s{seed}", {"seed": seed},
                                loss_scale=jitter))
        runs.append(edited_copy(tiny_runs["block"], tmp_path / f"one-block-s{seed}",
                                {"seed": seed, "model.residual.block_size": 8},
                                loss_scale=jitter * one_block_scale * final_val_loss(tiny_runs["baseline"])
                                / final_val_loss(tiny_runs["block"])))
    return runs


def test_sanity_panel_flags_a_one_block_run_that_beats_the_baseline(tmp_path, tiny_runs):
    text = build_report(seeded_copies(tiny_runs, tmp_path, 0.9), tmp_path / "report", "bad").read_text()
    panel = text.split("## Sanity checks")[1].split("## Loss curves")[0]
    assert "xs: one block (block S=8) minus baseline: -0." in panel and "(n=2, t=" in panel
    assert "ahead on every seed, interval excludes 0." in panel
    assert "**Warning: the sign of a mis-specified baseline, or of a gain that is access to the embedding.**" in panel
    assert "| read | xs block S=8 |" in panel and "| final |" in panel


def test_sanity_panel_passes_a_one_block_run_level_with_the_baseline(tmp_path, tiny_runs):
    text = build_report(seeded_copies(tiny_runs, tmp_path, 1.001), tmp_path / "report", "good").read_text()
    panel = text.split("## Sanity checks")[1].split("## Loss curves")[0]
    assert "behind on every seed, interval excludes 0." in panel and "Warning" not in panel


def seed_scale(scale: float | tuple[float, float], seed: int) -> float:
    return scale[seed] if isinstance(scale, tuple) else scale


def with_controls(tiny_runs, tmp_path, scales: dict[str, float | tuple[float, float]]) -> list:
    """seeded_copies' baseline at seeds 0 and 1, plus runs whose final losses are the baseline's times
    scales[name] (the same jitter per seed; a pair gives seeds 0 and 1 their own scales): one-block (S=8),
    block (S=2) and x0."""
    runs = []
    base = final_val_loss(tiny_runs["baseline"])
    for seed, jitter in ((0, 1.0), (1, 1.004)):
        runs.append(edited_copy(tiny_runs["baseline"], tmp_path / f"baseline-s{seed}", {"seed": seed},
                                loss_scale=jitter))
        for name, source, config in (("one-block", "block", {"model.residual.block_size": 8}),
                                     ("block", "block", {}),
                                     ("x0", "baseline", {"model.residual.kind": "x0"})):
            runs.append(edited_copy(tiny_runs[source], tmp_path / f"{name}-s{seed}", {"seed": seed, **config},
                                    loss_scale=jitter * seed_scale(scales[name], seed) * base
                                    / final_val_loss(tiny_runs[source])))
    return runs


def sanity_panel(runs, tmp_path) -> str:
    return build_report(runs, tmp_path / "report", "controls").read_text().split("## Sanity checks")[1] \
        .split("## Loss curves")[0]


def test_sanity_panel_warns_when_one_block_beats_the_depth_selecting_variants(tmp_path, tiny_runs):
    panel = sanity_panel(with_controls(tiny_runs, tmp_path, {"one-block": 0.9, "block": 0.97, "x0": 0.95}), tmp_path)
    line = next(line for line in panel.splitlines() if line.startswith("  - block S=8 minus block S=2: "))
    assert line.endswith("ahead on every seed, interval excludes 0: **the reverse of the paper's order** (the paper: "
                         "Full 1.737 < Block 1.746 < one block (about a third of Full's gain) < baseline 1.766).")
    assert "**Warning: the fewer the blocks, the better.**" in panel


def test_sanity_panel_states_each_variants_gain_over_x0_and_its_depth_selection_share(tmp_path, tiny_runs):
    runs = with_controls(tiny_runs, tmp_path, {"one-block": 0.98, "block": 0.9, "x0": 0.96})
    panel = sanity_panel(runs, tmp_path)
    assert "Warning" not in panel and "  - block S=8 minus block S=2: +0." in panel and "the paper's order." in panel
    base = final_val_loss(tiny_runs["baseline"])
    # Seed 1 scales every loss by 1.004, so the paired differences are d and 1.004 d: mean 1.002 d, sd
    # 0.004 |d| / sqrt(2), t = mean / (sd / sqrt(2)), and the 95% interval is mean ± tan(0.475 pi) sd / sqrt(2)
    # (Student's t with one degree of freedom is the Cauchy distribution).
    for name, scale in (("x0", 0.96), ("block", 0.9)):
        d = (scale - 1) * base if name == "x0" else (scale - 0.96) * base
        mean, sd = (d + 1.004 * d) / 2, abs(0.004 * d) / 2 ** 0.5
        half = math.tan(0.475 * math.pi) * sd / 2 ** 0.5
        expected = (f"{mean:+.4f} ± {sd:.4f} (n=2, t={mean / (sd / 2 ** 0.5):+.1f}, 95% CI [{mean - half:+.4f}, "
                    f"{mean + half:+.4f}]): ahead on every seed, interval excludes 0")
        assert expected in panel, (name, expected)
    assert "x0 minus baseline: " in panel and "the gain of access to the embedding alone" in panel
    # block's gain over the baseline is 0.10 base, 0.06 base of it over x0: 60% needs depth selection.
    assert "  - block S=2 minus x0: " in panel and "depth-selection share of its gain over the baseline is 60%" in panel


def test_sanity_panel_gives_no_share_of_a_gain_inside_seed_noise(tmp_path, tiny_runs):
    """Block 0.4% under the baseline at seed 0 and about 0.2% over it at seed 1: a mean gain of -0.1% that its
    interval cannot separate from 0 is noise, and a share of it (a ratio of two noises) would read as
    anything from -250% to +250%."""
    panel = sanity_panel(with_controls(tiny_runs, tmp_path, {"one-block": 0.98, "block": (0.996, 1.002),
                                                             "x0": 1.001}), tmp_path)
    line = next(line for line in panel.splitlines() if line.startswith("  - block S=2 minus x0: "))
    assert "is not separable from 0 with n=2, so there is no gain to split into shares" in line, line
    assert "depth-selection share" not in line


def test_sanity_panel_asks_for_an_x0_run_beside_attnres(tmp_path, tiny_runs):
    panel = sanity_panel(seeded_copies(tiny_runs, tmp_path, 1.001), tmp_path)
    assert "xs: no x0 run, so embedding access and attention over depth cannot be told apart (add a run with " \
           "`variant=x0`)." in panel


def test_sanity_panel_asks_for_a_one_block_run_when_there_is_none(tmp_path, tiny_runs):
    text = build_report(list(tiny_runs.values()), tmp_path / "report", "none").read_text()
    assert "xs: no one-block run to check the baseline against (add a run with " \
           "`variant=block variant.block_size=8`)" in text


def test_sanity_panel_gives_a_single_seed_control_no_interval_and_no_warning(tmp_path, tiny_runs):
    """A one-seed old-recipe control 20% below its baseline has one paired difference: no interval, so no
    verdict (the seed spread of other groups says nothing about this pair's)."""
    runs = seeded_copies(tiny_runs, tmp_path, 1.001)
    for name, scale in (("baseline", 1.0), ("block", 0.8)):
        config = {"model.init": "flat"} | ({"model.residual.block_size": 8} if name == "block" else {})
        runs.append(edited_copy(tiny_runs[name], tmp_path / f"flat-{name}-s0", config, loss_scale=scale))
    text = build_report(runs, tmp_path / "report", "control").read_text()
    panel = text.split("## Sanity checks")[1].split("## Loss curves")[0]
    flat_line = next(line for line in panel.splitlines() if line.startswith("- xs init=flat:"))
    scaled_line = next(line for line in panel.splitlines() if line.startswith("- xs init=scaled:"))
    assert flat_line.endswith("(n=1): n=1: no interval.") and "Warning" not in panel
    assert scaled_line.endswith("behind on every seed, interval excludes 0.")


def test_parabola_minimum_finds_the_optimum_between_two_tied_points():
    lrs = [1e-3, 2e-3, 4e-3, 8e-3]
    optimum = 2 ** 1.5 * 1e-3  # halfway between 2e-3 and 4e-3 in log2
    losses = [5 + 0.03 * (math.log2(lr) - math.log2(optimum)) ** 2 for lr in lrs]
    assert parabola_minimum(lrs, losses) == pytest.approx(optimum, rel=1e-9)
    assert parabola_minimum(lrs, sorted(losses)) is None  # best at the edge: no bracket


def test_a_truncated_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path, tiny_runs, capsys):
    run_dir = edited_copy(tiny_runs["baseline"], tmp_path / "killed", {})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 5.1')
    run = Run.load(run_dir)
    assert capsys.readouterr().err == (f"warning: {run_dir / 'metrics.jsonl'}:{len(lines) + 1}: skipped a truncated "
                                       "last line (a run killed mid-write)\n")
    assert run.steps == 6 and run.final_val_loss == final_val_loss(tiny_runs["baseline"])


def test_a_corrupt_line_elsewhere_is_one_error_naming_file_and_line(tmp_path, tiny_runs, capsys):
    run_dir = edited_copy(tiny_runs["baseline"], tmp_path / "corrupt", {})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:25]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        compare.main([f"runs=[{run_dir}]", f"report_dir={tmp_path / 'report'}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"[compare] error: {run_dir / 'metrics.jsonl'}:2: not a JSON line (")
    assert error.endswith("); fix or delete that line")


def report_error(capsys, run_dir, out) -> str:
    """compare runs=[run_dir]: exit code 2, one `[compare] error:` line, and no report written."""
    with pytest.raises(SystemExit) as exit_info:
        compare.main([f"runs=[{run_dir}]", f"report_dir={out}"])
    assert exit_info.value.code == 2 and not out.exists()
    lines = capsys.readouterr().err.splitlines()
    assert not any("Traceback" in line for line in lines)
    return lines[-1]


@pytest.mark.parametrize("row, line, problem", [
    ("5", 2, "5 is not a JSON object"),
    ('{"loss": 5.0, "tokens": 128, "step_time_s": 0.1}', 2, "no step (a whole number >= 0)"),
    ('{"step": "3", "loss": 5.0, "tokens": 128, "step_time_s": 0.1}', 2, 'step="3" is not a whole number >= 0'),
    ('{"step": 100000000000000000000000000000, "loss": 5.0, "tokens": 128}', 7,
     "no step_time_s (a finite number of seconds >= 0)"),
    ('{"step": 3, "tokens": 384, "eval/attnres_mc_words/acc": "high"}', 2,
     'eval/attnres_mc_words/acc="high" is not a number or null'),
    ('{"step": 3, "eval/attnres_mc_words/acc": 0.5}', 2, "no tokens (a whole number >= 0)"),
])
def test_a_row_the_report_cannot_read_is_one_error_naming_file_and_line(tmp_path, tiny_runs, capsys, row, line,
                                                                        problem):
    """Rows that parse as JSON but are no training row (each used to end in a traceback) are refused like a
    corrupt line: the file, the line and what is wrong."""
    run_dir = edited_copy(tiny_runs["baseline"], tmp_path / "odd", {})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines.insert(line - 1, row)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert report_error(capsys, run_dir, tmp_path / "report") == (
        f"[compare] error: {run_dir / 'metrics.jsonl'}:{line}: {problem}; fix or delete that line")


@pytest.mark.parametrize("text, problem", [
    ("train:\n  steps: [6\n", ":3: not valid YAML (expected ',' or ']', but got '<stream end>')"),
    ("model:\n  d_model: wide\n",
     ": not a config of this trainer (model.d_model: Value 'wide' of type 'str' could not be converted to Integer)"),
    ("- a list\n", ": not a config of this trainer (Cannot merge DictConfig with ListConfig)"),
])
def test_a_malformed_config_yaml_is_one_error_naming_the_file(tmp_path, tiny_runs, capsys, text, problem):
    run_dir = edited_copy(tiny_runs["baseline"], tmp_path / "odd", {})
    (run_dir / "config.yaml").write_text(text)
    assert report_error(capsys, run_dir, tmp_path / "report") == (
        f"[compare] error: {run_dir / 'config.yaml'}{problem}; fix it or leave this run out of the report")


def test_null_losses_are_left_out_of_the_curves(tmp_path, tiny_runs):
    """null is what the trainer writes for a NaN loss (a skipped step) or a non-finite evaluation."""
    run_dir = edited_copy(tiny_runs["baseline"], tmp_path / "nulls", {})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["step"] == 3 and "loss" in record:  # the training row, not train.eval_tasks' row
            record.update(loss=None, grad_norm=None, val_loss=None, moe_load_imbalance=None)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = Run.load(run_dir)
    assert [step for step, _ in run.moe_curve] == [1, 2, 4, 5, 6]
    assert len(run.val_curve) == 1 and run.final_val_loss == final_val_loss(tiny_runs["baseline"])
    text = build_report([run_dir, tiny_runs["block"]], tmp_path / "report", "nulls").read_text()
    assert f"{final_val_loss(tiny_runs['baseline']):.4f}" in text


def test_every_residual_variant_has_a_place_in_the_report():
    """A run of a variant the report does not order (x0 was added after the report) must not crash it."""
    from model.config import VARIANTS
    from scripts.report.depth import MAGNITUDE_VARIANTS
    from scripts.report.runs import VARIANT_ORDER

    assert set(VARIANTS) <= set(VARIANT_ORDER) and set(VARIANTS) <= set(MAGNITUDE_VARIANTS)


def test_downstream_values_are_stderr_for_one_seed_and_seed_spread_for_several():
    from scripts.report.downstream import diff_text, value_text

    assert value_text({0: (0.65, 0.1094)}) == "0.6500 ± 0.1094 (stderr)"
    assert value_text({0: (0.6, None), 1: (0.7, None), 2: (0.8, None)}) == "0.7000 ± 0.1000 (3 seeds)"
    # paired over the seeds both have: seed 2 has no baseline here
    # differences 0.1 and 0.3: sd 0.1414, standard error 0.1, t = 2, interval 0.2 ± tan(0.475 pi) 0.1
    assert diff_text({0: (0.6, None), 1: (0.9, None), 2: (0.5, None)}, {0: (0.5, None), 1: (0.6, None)}) == (
        "+0.2000 ± 0.1414 (n=2, t=+2.0, 95% CI [-1.0706, +1.4706])")
    assert diff_text({2: (0.5, None)}, {0: (0.5, None)}) == "-"
