"""Assemble report.md and its figures from run directories."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from scripts.report import curves, depth, sweeps
from scripts.report.downstream import downstream_section
from scripts.report.multiplier import multiplier_section
from scripts.report.sanity import sanity_section
from scripts.report.runs import Group, Run, group_runs
from scripts.report.stats import PowerLaw, compute_multiplier, fit_power_law
from scripts.report.table import PAIRED_NOTE, Row, build_rows, recipe_lines, to_markdown
from scripts.report.tuning import choices, each_tuned_groups, tuning_section

FLOPS_NOTE = ("FLOPs are training FLOPs (forward + backward) from `model/flops.py`: 6 x activated matmul parameters "
              "per token plus MLA attention, the KDA recurrence and the depth reads.")


LABELS = ("interval excludes 0", "not separable from 0 with n=")


def intervals_line(text: str) -> str:
    """How many 95% intervals the report labels, and what one in twenty by chance means for that many."""
    labelled = sum(text.count(label) for label in LABELS)
    excluding = text.count(LABELS[0])
    return (f"**Intervals.** This report labels {labelled} 95% intervals (a comparison shown in two places counts "
            f"twice); {excluding} of them exclude 0. At 95%, about one interval in twenty excludes 0 by chance where "
            f"there is no difference (about {labelled / 20:.1f} of {labelled} here), so one label alone is weak "
            "evidence. The table's Holm column adjusts each setting's comparisons against its baseline for their "
            "number.")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def image(path: Path, caption: str) -> str:
    return f"![{caption}]({path.name})"


def ordering(rows: list[Row]) -> list[str]:
    """Per setting, the variants from lowest to highest final loss, with each paired difference's noise label."""
    lines = []
    for size in dict.fromkeys(r.group.size for r in rows):
        ranked = sorted((r for r in rows if r.group.size == size and r.loss is not None), key=lambda r: r.loss)
        if len(ranked) < 2:
            continue
        lines.append(f"- **{size}**, lowest loss first: "
                     + " < ".join(f"{r.group.variant} {r.loss:.4f}" for r in ranked))
        lines += [f"  - {r.group.variant} minus baseline: {r.vs_baseline.text()}: {r.vs_baseline.label()}"
                  for r in ranked if r.vs_baseline is not None]
    return lines


def magnitude_lines(groups: list[Group]) -> list[str]:
    lines = []
    for group in groups:
        out, grad = depth.mean_record(group, "output_rms"), depth.mean_record(group, "grad_rms")
        if not out or not grad:
            continue
        out_values = [out[k] for k in sorted(out, key=int)]
        grad_values = [grad[k] for k in sorted(grad, key=int)]
        lines.append(f"- {group.size} {group.variant}: output RMS sublayer 1 -> {len(out_values)}: "
                     f"{out_values[0]:.3g} -> {out_values[-1]:.3g} (max/min {max(out_values) / min(out_values):.1f}x); "
                     f"gradient RMS first/last block {grad_values[0] / max(grad_values[-1], 1e-30):.2f}x")
    return lines


def task_curves_section(groups: list[Group], out_dir: Path) -> list[str]:
    """The lm_eval task metrics that train.eval_tasks scored during training, against tokens; none without them."""
    figure = curves.task_metrics_vs_tokens(groups, out_dir / "task_metrics_vs_tokens.png")
    if figure is None:
        return []
    return ["Downstream task metrics during training (`train.eval_tasks`, on the live model):", "",
            image(figure, "task metrics vs tokens"), ""]


def moe_section(groups: list[Group], out_dir: Path) -> list[str]:
    """The load-imbalance curves and, per group, the imbalance over the last quarter of logged steps."""
    figure = curves.moe_imbalance(groups, out_dir / "moe_imbalance.png")
    if figure is None:
        return []
    lines = ["## MoE load balance", "", image(figure, "MoE load imbalance"), ""]
    for group in groups:
        tails = []
        for run in group.runs:
            values = [imbalance for _, imbalance in run.moe_curve]
            tails += values[len(values) * 3 // 4:]
        if tails:
            lines.append(f"- {group.size} {group.variant}: max/mean expert load over the last quarter of logged "
                         f"steps {statistics.fmean(tails):.2f} (worst {max(tails):.2f})")
    return lines + [""]


def lr_section(groups: list[Group], out_dir: Path) -> list[str]:
    """Loss against learning rate for every variant trained at several, and each one's best."""
    families = sweeps.lr_families(groups)
    if not families:
        return []
    lines = ["## Learning-rate sweep", "", image(sweeps.lr_sweep(families, out_dir / "lr_sweep.png"), "lr sweep"), ""]
    for name, members in families.items():
        means = [statistics.fmean(sweeps.final_losses(g)) for g in members]
        best = members[means.index(min(means))]
        losses = ", ".join(f"{g.lr:g}: {mean:.4f}" for g, mean in zip(members, means))
        edge = " (at the edge of the sweep: widen it)" if best in (members[0], members[-1]) else ""
        vertex = sweeps.parabola_minimum([g.lr for g in members], means)
        fit = f"; a parabola in log lr through it and its neighbours has its minimum at {vertex:.3g}" if vertex else ""
        lines.append(f"- {name}: best lr {best.lr:g}{edge}{fit}; mean final loss by lr: {losses}")
    return lines + [""]


def scaling_section(groups: list[Group], out_dir: Path) -> list[str]:
    """Fit L = A C^-alpha per variant family with at least three sizes."""
    points: dict[str, list[tuple[float, float]]] = {}
    for group in groups:
        losses = sweeps.final_losses(group)
        if losses:
            compute = statistics.fmean(run.tokens * run.flops_per_token for run in group.runs)
            points.setdefault(group.runs[0].family, []).append((compute, statistics.fmean(losses)))
    fits: dict[str, PowerLaw] = {family: fit_power_law(*zip(*pts)) for family, pts in points.items()
                                 if len({c for c, _ in pts}) >= 3}
    if not fits:
        return []
    lines = ["## Scaling", "", image(sweeps.scaling(points, fits, out_dir / "scaling.png"), "scaling fit"), "",
             "| variant | A | alpha | sizes |", "|---|---|---|---|"]
    lines += [f"| {family} | {fit.A:.4g} | {fit.alpha:.4f} | {len(points[family])} |" for family, fit in fits.items()]
    if "baseline" in fits:
        lines.append("")
        for family, pts in points.items():
            if family != "baseline":
                compute, loss = max(pts)
                multiplier = compute_multiplier(fits["baseline"], loss, compute)
                lines.append(f"- {family} at the largest size: the baseline's fit needs {multiplier:.2f}x the compute "
                             f"to reach its loss {loss:.4f} (the paper: 1.25x for Block)")
    return lines + [""]


def matrix_section(groups: list[Group], out_dir: Path) -> list[str]:
    """The depth-mixing matrix M of every variant (scripts.depth_matrix), side by side."""
    found = depth.matrix_panels(groups, out_dir / "depth_matrix.png")
    if found is None:
        return []
    figure, rows = found
    return ["## Depth-mixing matrix M (paper section 6.2)", "",
            "h_l = sum_i M[i->l] v_i: each variant's mean M over validation tokens at its last checkpoint "
            "(`python -m scripts.depth_matrix`), drawn as each read's shares (a row over the sum of its |weights|), "
            "rows = readers (the last: the final read), columns = sources (0: the embedding). Semiseparable rank: the largest numerical rank of a lower-left block "
            "M[l >= k, i < k] per token (rtol 1e-4); entropy: of each row's |weights| normalised, mean over "
            "reads after the first.", "", image(figure, "depth-mixing matrices"), "",
            "| size | variant | runs | semiseparable rank (mean) | max | row entropy |", "|---|---|---|---|---|---|",
            *rows, ""]


def runs_line(runs: list[Run], missing: list[str]) -> str:
    line = f"{len(runs)} runs: " + ", ".join(f"`{run.path}`" for run in runs) + "."
    if missing:
        line += (f" Not started yet, so not in this report ({len(missing)}): "
                 + ", ".join(f"`{path}`" for path in missing) + ".")
    return line


def build_report(run_dirs: list[str | Path], out_dir: str | Path, title: str, missing: list[str] = (),
                 tuning_key: str | None = None, tuning_dirs: list[str | Path] = ()) -> Path:
    """Write out_dir/report.md and its PNG figures; returns the report's path. `missing`: planned runs not
    started, named in the report. With `tuning_key`, the sweep in `tuning_dirs` chooses each arm's value of it:
    the report shows the sweep and adds the "each tuned" setting beside the shared ones."""
    runs = [Run.load(path) for path in run_dirs]  # a run the report cannot read fails before anything is written
    sweep = [Run.load(path) for path in tuning_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    chosen = choices(sweep, tuning_key) if tuning_key else {}
    compared = groups + (each_tuned_groups(runs, tuning_key, chosen) if tuning_key else [])
    rows = build_rows(compared)
    lines = [f"# {title}", "", runs_line(runs, list(missing)), "",
             *(tuning_section(sweep, tuning_key, chosen) if tuning_key else []),
             "## Final validation loss", "", to_markdown(rows), "", PAIRED_NOTE, "", *ordering(rows), "",
             *recipe_lines(groups),
             *sanity_section(compared),
             *multiplier_section(compared, out_dir),
             *downstream_section(groups),
             "## Loss curves", "", FLOPS_NOTE, "",
             image(curves.loss_vs_tokens(groups, out_dir / "loss_vs_tokens.png"), "validation loss vs tokens"),
             image(curves.loss_vs_compute(groups, out_dir / "loss_vs_compute.png"), "validation loss vs compute"), "",
             *task_curves_section(groups, out_dir),
             *moe_section(groups, out_dir),
             "## Output and gradient magnitude (end of training)", ""]
    for size in dict.fromkeys(g.size for g in groups):
        figure = depth.magnitudes(groups, size, out_dir / f"magnitudes_{slug(size)}.png")
        if figure is not None:
            lines += [image(figure, f"{size} magnitudes"), ""]
    lines += magnitude_lines(groups) + ["", "## Depth attention (end of training)", ""]
    entropy_rows = []
    for group in groups:
        mean_entropy = depth.depth_heatmaps(group, out_dir / f"depth_{slug(group.size)}_{slug(group.variant)}.png")
        if mean_entropy is not None:
            lines += [image(out_dir / f"depth_{slug(group.size)}_{slug(group.variant)}.png", group.variant), ""]
            entropy_rows.append(f"| {group.size} | {group.variant} | {mean_entropy['pre-attention']:.3f} "
                                f"| {mean_entropy['pre-MLP']:.3f} |")
    if entropy_rows:
        lines += ["Mean row entropy (nats; uniform over n sources is ln n):", "",
                  "| size | variant | pre-attention | pre-MLP |", "|---|---|---|---|", *entropy_rows, ""]
        importance = depth.layer_importance(groups, out_dir / "layer_importance.png")
        lines += ["Layer importance I_i = sum over later reads of alpha_{i->l}:", "",
                  image(importance, "layer importance"), ""]
    else:
        lines += ["No run recorded depth-attention weights (baseline and mHC have none).", ""]
    lines += matrix_section(groups, out_dir)
    for size in sweeps.sweep_sizes(groups):
        figure = sweeps.block_size_sweep(groups, size, out_dir / f"block_size_sweep_{slug(size)}.png")
        lines += [f"## Block-size sweep ({size})", "", image(figure, "block-size sweep"), ""]
    lines += lr_section(groups, out_dir)
    lines += scaling_section(groups, out_dir)
    lines[4:4] = [intervals_line("\n".join(lines)), ""]  # after the title and the list of runs
    report = out_dir / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report
