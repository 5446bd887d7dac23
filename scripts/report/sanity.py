"""Checks that would expose a handicapped baseline (DESIGN.md, comparison protocol).

- One block (block size >= sublayers: every read sees the embedding and one running partial sum) is
  the baseline's residual sum with a learned two-way mix. The paper finds it about equal to the
  baseline; a one-block run that beats the baseline by more than 2 pooled std points at a
  mis-specified baseline (its initialisation or recipe), not at depth attention.
- The embedding's share of every depth read: reads that put nearly all their weight on the embedding
  are routing around something the baseline cannot (an embedding drowned in the residual sum).
"""
from __future__ import annotations

import statistics

from scripts.report.depth import mean_record
from scripts.report.runs import Group
from scripts.report.stats import NOISE_SIGMAS, pooled_std, pooled_std_of
from scripts.report.sweeps import final_losses


def is_one_block(group: Group) -> bool:
    model = group.runs[0].config.model
    return group.is_plain_block and group.block_size >= model.n_sublayers


def seed_spread(a: list[float], b: list[float], same_size: list[list[float]]) -> float | None:
    """The pooled std of the two groups; when either has a single seed, the pooled std of every group of
    the same model size that has two or more (seed noise depends on the size and budget, not the group)."""
    pooled = pooled_std(a, b)
    return pooled if pooled is not None else pooled_std_of(same_size)


def one_block_lines(groups: list[Group]) -> list[str]:
    lines = []
    for setting in dict.fromkeys(g.size for g in groups):
        base = next((g for g in groups if g.size == setting and g.kind == "baseline" and final_losses(g)), None)
        if base is None or all(g.kind == "baseline" for g in groups if g.size == setting):
            continue  # nothing to compare in this setting (a baseline-only sweep point)
        sublayers = base.runs[0].config.model.n_sublayers
        one = next((g for g in groups if g.size == setting and is_one_block(g) and final_losses(g)), None)
        if one is None:
            lines.append(f"- {setting}: no one-block run to check the baseline against (add a run with "
                         f"`variant=block variant.block_size={sublayers}`).")
            continue
        a, b = final_losses(one), final_losses(base)
        diff = statistics.fmean(a) - statistics.fmean(b)
        pooled = seed_spread(a, b, [final_losses(g) for g in groups if g.model_size == base.model_size])
        head = f"- {setting}: one block ({one.variant}) minus baseline = {diff:+.4f}"
        if pooled is None:
            lines.append(f"{head}; no group of this size has two seeds, so there is no noise estimate and "
                         "this check cannot flag anything.")
        elif diff < -NOISE_SIGMAS * pooled:
            lines.append(f"{head}, more than {NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}) below the "
                         "baseline. **Warning: the sign of a mis-specified baseline.** One block can only re-weight "
                         "the embedding against the running sum; a large win means the baseline's recipe "
                         "(initialisation, learning rate) handicaps the plain sum, and the other AttnRes gains in "
                         "this setting are suspect until it is fixed.")
        else:
            lines.append(f"{head}, within {NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}) or above: "
                         "consistent with the paper (one block about equals the baseline).")
    return lines


def embedding_share_lines(groups: list[Group]) -> list[str]:
    """A table of alpha_{0 -> l} (weight on the embedding) per read, one column per AttnRes group."""
    shares = {}
    for group in groups:
        weights = mean_record(group, "depth_weights")
        if weights:
            shares[f"{group.size} {group.variant}"] = {int(row): cols.get("0", 0.0) for row, cols in weights.items()}
    if not shares:
        return []
    reads = sorted({row for column in shares.values() for row in column})
    last = max(reads)
    lines = ["Embedding's share of each depth read (alpha on source 0, mean over tokens and seeds, end of training; "
             "odd reads precede attention, even ones the MLP, the last is the final read):", "",
             "| read | " + " | ".join(shares) + " |", "|---|" + "---|" * len(shares)]
    for read in reads:
        label = "final" if read == last else str(read)
        lines.append(f"| {label} | " + " | ".join(f"{column[read]:.2f}" if read in column else "-"
                                                  for column in shares.values()) + " |")
    return lines


def sanity_section(groups: list[Group]) -> list[str]:
    checks = one_block_lines(groups) or ["- No setting here has both a baseline and an AttnRes run: nothing to check."]
    lines = ["## Sanity checks", "",
             "The paper tunes the baseline and reuses its recipe; these checks would expose a baseline "
             "handicapped by its recipe.", "", *checks, ""]
    shares = embedding_share_lines(groups)
    return lines + (shares + [""] if shares else [])
