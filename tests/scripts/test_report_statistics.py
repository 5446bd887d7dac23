"""The report's paired statistics and token multiplier, pinned on the committed run files under docs/results/
(controls: 200 steps, AdamW seeds 0-2 and Muon seeds 0-1; controls_long: 1000 steps, seeds 0-1) and on
synthetic curves with a known answer. Each expected number is computed here independently of scripts/report."""
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from model.flops import training_flops_per_token
from scripts.report.build import intervals_line
from scripts.report.multiplier import (BEFORE, BEYOND, Point, at_budget, baseline_tokens_to_reach, cell, decay_rule,
                                      difference_text, multiplier_points, speedup_points)
from scripts.report.runs import Group, Run, group_runs
from scripts.report.sanity import setting_lines
from scripts.report.stats import Paired, holm
from scripts.report.table import baseline_of, paired_groups
from scripts.report.trend import trend, window_steps

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
# Student's t quantiles in closed form: df=1 is the Cauchy distribution, tan(pi (p - 1/2)); df=2 is
# (2p - 1) / sqrt(2 p (1 - p)).
T975 = {1: math.tan(math.pi * 0.475), 2: 0.95 / math.sqrt(2 * 0.975 * 0.025)}


def load_groups(experiment: str):
    return group_runs([Run.load(path) for path in sorted((RESULTS / experiment / "runs").iterdir())])


@pytest.fixture(scope="module")
def controls():
    return load_groups("controls")


def group(groups, setting: str, variant: str):
    return next(g for g in groups if g.size == setting and g.variant == variant)


def final_losses_by_seed(run_group) -> dict[int, float]:
    """Read back from metrics.jsonl by hand: the last logged val_loss of each seed's run."""
    losses = {}
    for run in run_group.runs:
        rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses[run.seed] = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
    return losses


@pytest.mark.parametrize("diffs, label", [
    ((-0.035, -0.036, -0.038), "ahead on every seed, interval excludes 0"),
    ((0.012, 0.0115), "behind on every seed, interval excludes 0"),
    ((-0.061, -0.020), "not separable from 0 with n=2"),
    ((-0.02, 0.01, -0.03), "not separable from 0 with n=3"),
    ((-0.30, -0.31, -0.29, -0.33, 0.001, -0.30), "ahead on average (5 of 6 seeds), interval excludes 0"),
    ((0.012,), "n=1: no interval"),
])
def test_paired_interval_and_label_agree_with_a_t_test_by_hand(diffs, label):
    diff = Paired(diffs)
    assert diff.label() == label
    n = len(diffs)
    if n == 1:
        assert diff.interval is None and diff.text() == "+0.0120 (n=1)"
        return
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    assert diff.t == pytest.approx(mean / (sd / math.sqrt(n)), rel=1e-12)
    from scipy import stats
    quantile = T975.get(n - 1, stats.t.ppf(0.975, n - 1))
    low, high = diff.interval
    assert low == pytest.approx(mean - quantile * sd / math.sqrt(n), rel=1e-9)
    assert high == pytest.approx(mean + quantile * sd / math.sqrt(n), rel=1e-9)
    assert (low > 0 or high < 0) == ("excludes 0" in label)


def test_controls_labels_are_the_paired_t_tests(controls):
    """The issue's cases: AdamW Full is ahead on all 3 seeds (paired t about -45; the old unpaired rule said
    'inside seed noise'); Muon one block's 2 gains (-0.061, -0.020) are not separable from 0 (it said
    'outside'); Muon x0 (-0.016 on both seeds) excludes 0 (it said 'inside')."""
    cases = {("s optim=adamw", "full"): ("ahead on every seed, interval excludes 0", 3),
             ("s optim=muon muon_lr=0.02", "block S=16"): ("not separable from 0 with n=2", 2),
             ("s optim=muon muon_lr=0.02", "x0"): ("ahead on every seed, interval excludes 0", 2),
             ("s optim=adamw", "x0"): ("not separable from 0 with n=3", 3)}
    for (setting, variant), (label, n) in cases.items():
        mine, base = (final_losses_by_seed(group(controls, setting, name)) for name in (variant, "baseline"))
        diffs = [mine[seed] - base[seed] for seed in sorted(mine)]
        vs_baseline = paired_groups(group(controls, setting, variant), group(controls, setting, "baseline"))
        assert vs_baseline.diffs == pytest.approx(diffs, abs=1e-12) and vs_baseline.n == n
        assert vs_baseline.label() == label, (setting, variant)
        half = T975[n - 1] * statistics.stdev(diffs) / math.sqrt(n)
        assert (abs(statistics.fmean(diffs)) > half) == ("excludes 0" in label)
    full = paired_groups(group(controls, "s optim=adamw", "full"), group(controls, "s optim=adamw", "baseline"))
    assert [round(d, 3) for d in full.diffs] == [-0.035, -0.035, -0.038] and full.t == pytest.approx(-44.6, abs=0.1)


def test_sanity_check_says_one_block_beating_block_is_the_papers_order_reversed(controls):
    lines = setting_lines(controls)
    adamw = next(line for line in lines if line.startswith("  - block S=16 minus block S=4: -0.0325 ± 0.0034 (n=3"))
    assert adamw.endswith("ahead on every seed, interval excludes 0: **the reverse of the paper's order** (the "
                          "paper: Full 1.737 < Block 1.746 < one block (about a third of Full's gain) < baseline "
                          "1.766).")
    muon = [line for line in lines if line.startswith("  - block S=16 minus block S=4: -0.0216 ± 0.0066 (n=2")]
    assert muon and muon[0].endswith("not separable from 0 with n=2; the order is not established.")
    assert "  - **Warning: the fewer the blocks, the better.** One block beats a variant that selects among " \
           "depths" in "\n".join(lines)


def straight_in_log(tokens, a: float = 8.0, b: float = 0.2):
    """A loss linear in log tokens: linear interpolation in log tokens is exact on it."""
    return [a - b * math.log(t) for t in tokens]


def test_baseline_tokens_recover_a_known_multiplier_on_a_synthetic_curve():
    """A variant that is at every point where the baseline is with 1.3x the tokens has a multiplier of 1.3,
    wherever the baseline's curve reaches its loss; past the baseline's last evaluation it is beyond."""
    tokens = [1000 * 2 ** k for k in range(8)]
    baseline = list(zip(tokens, straight_in_log(tokens)))
    for t, loss in zip(tokens, straight_in_log([1.3 * t for t in tokens])):
        needed = baseline_tokens_to_reach(baseline, loss)
        if 1.3 * t <= tokens[-1]:
            assert needed / t == pytest.approx(1.3, rel=1e-12)
        else:
            assert needed == BEYOND
    assert baseline_tokens_to_reach(baseline, baseline[0][1] + 0.1) == BEFORE
    # A curve that rises before it falls: the first crossing counts, between the evaluations around it.
    bumpy = [(100, 6.0), (200, 5.0), (400, 5.2), (800, 4.0)]
    assert baseline_tokens_to_reach(bumpy, 5.5) == pytest.approx(math.exp((math.log(100) + math.log(200)) / 2))
    assert baseline_tokens_to_reach(bumpy, 4.6) == pytest.approx(math.exp((math.log(400) + math.log(800)) / 2))


def test_multiplier_on_the_committed_controls_matches_np_interp_in_log_tokens(controls):
    """Every committed controls baseline curve falls monotonically, so np.interp on the reversed curve is an
    independent interpolation; every evaluation of every variant, per seed."""
    checked = 0
    for variant in controls:
        base = baseline_of(variant, controls)
        if base is None or base is variant:
            continue
        bases = {run.seed: run for run in base.runs}
        for point in multiplier_points(variant, base):
            for seed, value in point.by_seed.items():
                run = next(r for r in variant.runs if r.seed == seed)
                loss = dict(run.val_curve)[point.tokens]
                curve_tokens, curve_loss = zip(*bases[seed].val_curve)
                if loss < min(curve_loss) or loss > max(curve_loss):  # np.interp would clamp: no crossing
                    assert value == (BEYOND if loss < min(curve_loss) else BEFORE)
                    continue
                expected = math.exp(np.interp(loss, curve_loss[::-1], np.log(curve_tokens[::-1])))
                assert value == pytest.approx(expected / point.tokens, rel=1e-9)
                checked += 1
    assert checked > 100


def test_controls_long_multiplier_falls_with_tokens_and_marks_the_decay():
    """The issue's reading of controls_long: one block 1.3-1.4x early and 1.09x at 0.77M tokens; its step-850+
    evaluations lie in the WSD decay (the last 200 of 1000 steps); at the end the baseline never reaches it."""
    groups = load_groups("controls_long")
    one_block = group(groups, "s", "block S=16")
    points = {p.step: p for p in multiplier_points(one_block, baseline_of(one_block, groups))}
    assert 1.3 < statistics.fmean(points[250].values) < 1.4 and not points[250].decay
    assert statistics.fmean(points[750].values) == pytest.approx(1.09, abs=0.005)
    assert points[850].decay
    assert points[1000].by_seed == {0: BEYOND, 1: BEYOND} and points[1000].text() == \
        f"{BEYOND} (seed 0, 1) †"
    run = one_block.runs[0]
    assert not run.in_decay(800) and run.in_decay(850)
    # Beside the multiplier, the paired loss difference at the same evaluation: one block is 0.094 and 0.111
    # below the baseline at step 250, close enough for the n=2 interval to exclude 0.
    base = baseline_of(one_block, groups)
    diffs = [dict(run.val_curve)[256000] - dict(base_run.val_curve)[256000]
             for run, base_run in zip(one_block.runs, base.runs)]
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    assert T975[1] * sd / math.sqrt(2) < abs(mean)
    assert difference_text(one_block, base, 250) == f"{mean:+.4f} ± {sd:.4f}: ahead on every seed, interval excludes 0"
    # A run given a longer budget than it reached is unfinished: its last evaluation is not paired with the
    # baseline's final one (step 1000 against step 2000's budget would compare budgets, not variants).
    assert paired_groups(one_block, base).n == 2
    one_block.runs[1].config.train.steps = 2000
    assert paired_groups(one_block, base).diffs == (one_block.runs[0].final_val_loss - base.runs[0].final_val_loss,)


def test_trend_is_flat_for_a_constant_multiplier_and_recovers_a_known_fall():
    """Multipliers 1.25 at every evaluation: slope 0. Straight falls of 0.05, 0.07 and 0.06 per doubling on three
    seeds: each seed's slope, standard error 0, the interval across seeds and its label; decay and incomplete
    evaluations are left out. With two seeds no interval is labelled (1 degree of freedom)."""
    tokens = [1000 * 2 ** k for k in range(6)]
    flat = trend([Point(k + 1, t, {0: 1.25, 1: 1.25}, False) for k, t in enumerate(tokens)])
    assert flat.evaluations == 6 and flat.fitted(tokens[-1]) == pytest.approx(1.25) and not flat.fits_poorly
    assert flat.text().endswith("seed 0 +0.000 ± 0.000; seed 1 +0.000 ± 0.000 (slope ± standard error); "
                                "mean +0.000: no interval across 2 seeds")
    falls = {0: 0.05, 1: 0.07, 2: 0.06}
    falling = [Point(k + 1, t, {seed: 1.5 - fall * k for seed, fall in falls.items()}, False)
               for k, t in enumerate(tokens)]
    falling += [Point(7, 64000, {0: 0.5, 1: 0.5, 2: 0.5}, True), Point(8, 128000, {0: BEYOND, 1: 1.0, 2: 1.0}, False)]
    found = trend(falling)
    assert found.last.step == 6 and found.evaluations == 6 and not found.fits_poorly
    for seed, fall in falls.items():
        assert found.lines[seed].slope == pytest.approx(-fall) and found.lines[seed].slope_se == pytest.approx(0,
                                                                                                               abs=1e-12)
    half = T975[2] * statistics.stdev([-0.05, -0.07, -0.06]) / math.sqrt(3)
    assert found.text() == (
        "steps 1-6 (6 evaluations): measured mean 1.50 at 0.00M, 1.38 at 0.00M, 1.20 at 0.03M; the line runs from "
        "1.50 to 1.20; per doubling seed 0 -0.050 ± 0.000; seed 1 -0.070 ± 0.000; seed 2 -0.060 ± 0.000 (slope ± "
        f"standard error); mean -0.060 ± 0.010 [{-0.06 - half:+.3f}, {-0.06 + half:+.3f}]: falling on every seed, "
        "interval excludes 0")
    assert trend(falling[:2]) is None


def test_a_fall_that_happens_early_is_said_to_fit_the_line_poorly():
    """1 + 0.4 * 2^-k: most of the fall is in the first two doublings. The quadratic term's F-test finds the
    bend (p computed here from the two fits' residuals), so the text reads the measured values, not the slope."""
    from scipy import stats

    tokens = [250_000 * 2 ** (k / 2) for k in range(8)]
    values = [1 + 0.4 * 2 ** -k for k in range(8)]
    found = trend([Point(k + 1, int(t), {0: v, 1: v + 0.01}, False) for k, (t, v) in enumerate(zip(tokens, values))])
    x = np.log2([int(t) for t in tokens])
    line_ssr = np.sum((np.array(values) - np.polyval(np.polyfit(x, values, 1), x)) ** 2)
    bend_ssr = np.sum((np.array(values) - np.polyval(np.polyfit(x, values, 2), x)) ** 2)
    expected = stats.f.sf((line_ssr - bend_ssr) / (bend_ssr / 5), 1, 5)
    assert found.lines[0].bend_p == pytest.approx(expected, rel=1e-6) and expected < 0.05
    se = math.sqrt(line_ssr / 6 / np.sum((x - x.mean()) ** 2))
    assert found.lines[0].slope_se == pytest.approx(se, rel=1e-9)
    assert found.fits_poorly and "**the line fits poorly** (a bend in log tokens fits better: seed 0 p=" in found.text()
    assert found.text().endswith("so read the measured values, not the slope")


def test_every_variant_of_long_blend_takes_the_same_window_for_its_trend():
    """x0's multiplier at step 2000 is matched to baseline tokens past the baseline's last evaluation before its
    decay (step 2250), so it is marked †; the window for every variant ends at step 1750."""
    groups = group_runs([Run.load(path) for path in sorted((RESULTS / "long_blend" / "runs").iterdir())
                         if "-lr" not in path.name])  # the grid, without long_blend_lr's sweep
    base = group(groups, "s", "baseline")
    by_variant = {g.variant: multiplier_points(g, base) for g in groups if g is not base}
    steps = window_steps(by_variant)
    assert steps == list(range(250, 2000, 250))
    x0 = {p.step: p for p in by_variant["x0"]}
    assert x0[2000].decay and x0[2000].complete and not x0[1750].decay
    for points in by_variant.values():
        assert [p.step for p in trend(points, steps).window] == steps
    assert decay_rule(base) == (
        "† here: the variant's evaluation follows an update of the LR decay (the decay's updates start at step 2401, "
        "so every evaluation after step 2400 is marked), or the baseline tokens matched exceed 2.30M, the baseline's "
        "last evaluation before its decay (step 2250), so they are interpolated towards an evaluation in the decay.")


def test_controls_long_trend_is_an_independent_least_squares_slope_per_seed():
    """Block S=4 falls by 0.044 per doubling of tokens on both seeds before the decay (steps 50-700); the slope
    by hand is cov(log2 tokens, multiplier) / var(log2 tokens) per seed, its standard error from the residuals."""
    groups = load_groups("controls_long")
    block = group(groups, "s", "block S=4")
    points = multiplier_points(block, baseline_of(block, groups))
    found = trend(points)
    stable = [p for p in points if p.step <= 700]
    x = [math.log2(p.tokens) for p in stable]
    for seed in (0, 1):
        y = [p.by_seed[seed] for p in stable]
        slope = statistics.covariance(x, y) / statistics.variance(x)
        intercept = statistics.fmean(y) - slope * statistics.fmean(x)
        residuals = [v - (slope * u + intercept) for u, v in zip(x, y)]
        se = math.sqrt(sum(r * r for r in residuals) / (len(x) - 2) / sum((u - statistics.fmean(x)) ** 2 for u in x))
        assert found.lines[seed].slope == pytest.approx(slope, rel=1e-9)
        assert found.lines[seed].slope_se == pytest.approx(se, rel=1e-9)
        assert f"seed {seed} {slope:+.3f} ± {se:.3f}" in found.text()
    assert (found.first.step, found.last.step) == (50, 700)


def test_holm_matches_a_hand_computation_and_the_p_value_a_t_test():
    """p = 0.01, 0.04, 0.03, 0.005: sorted, 4 x 0.005 = 0.02, 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, 1 x 0.04 = 0.04
    raised to 0.06 (never below a smaller p's)."""
    from scipy import stats

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    diffs = (0.0181, 0.0205)
    assert Paired(diffs).p == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue, rel=1e-9)
    assert (Paired(diffs).p < 0.05) == Paired(diffs).excludes_zero


def test_compute_speedup_is_the_multiplier_times_the_flops_per_token_ratio_on_synthetic_curves():
    """A variant with Full's FLOPs per token that reaches, at t tokens, the baseline's loss at 1.3 t: multiplier
    1.3, compute-equivalent speedup 1.3 x (the baseline's FLOPs per token / Full's)."""
    groups = load_groups("controls_long")
    base_run, full_run = group(groups, "s", "baseline").runs[0], group(groups, "s", "full").runs[0]
    tokens = [50_000 * 2 ** k for k in range(6)]

    def with_curve(run, scale):
        rows = [{"step": k + 1, "tokens": t, "step_time_s": 1.0, "loss": v, "val_loss": v}
                for k, (t, v) in enumerate(zip(tokens, straight_in_log([scale * t for t in tokens])))]
        return Run(run.path, run.config, rows, [])

    base = Group("s", "baseline", [with_curve(base_run, 1.0)])
    variant = Group("s", "full", [with_curve(full_run, 1.3)])
    points = [p for p in multiplier_points(variant, base) if p.complete]
    ratio = (training_flops_per_token(base_run.config.model, base_run.config.train.seq_len)["total"]
             / training_flops_per_token(full_run.config.model, full_run.config.train.seq_len)["total"])
    assert ratio != pytest.approx(1.0, abs=1e-4) and len(points) == 5
    for point, speedup in zip(points, speedup_points(points, variant, base)):
        assert point.values == pytest.approx([1.3]) and speedup.values == pytest.approx([1.3 * ratio])


def test_the_report_states_how_many_intervals_it_labels():
    text = "\n".join(["x: not separable from 0 with n=2", "y: ahead on every seed, interval excludes 0",
                      "z: not separable from 0 with n=3 | again: not separable from 0 with n=3", "n=1: no interval"])
    assert intervals_line(text).startswith("**Intervals.** This report labels 4 95% intervals (a comparison shown "
                                           "in two places counts twice); 1 of them exclude 0. At 95%, about one "
                                           "interval in twenty excludes 0 by chance where there is no difference "
                                           "(about 0.2 of 4 here)")


def test_budget_columns_take_the_nearest_evaluation_and_name_another_step():
    """A variant evaluated every 40 steps beside columns of one evaluated every 50: its cells name their step."""
    every_50 = [Point(step, step * 1024, {0: 1.1}, False) for step in range(50, 1001, 50)]
    every_40 = [Point(step, step * 1024, {0: 1.2}, False) for step in range(40, 1001, 40)]
    columns = at_budget(every_50, 1000)
    assert [p.step for p in columns] == [250, 500, 750, 1000]
    assert [p.step for p in at_budget(every_40, 1000)] == [240, 480, 760, 1000]
    assert [cell("x", p, column) for p, column in zip(at_budget(every_40, 1000), columns)] == [
        "x (step 240)", "x (step 480)", "x (step 760)", "x"]
