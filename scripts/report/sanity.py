"""Checks that would expose a handicapped baseline (DESIGN.md, comparison protocol).

- One block (block size >= sublayers: every read weighs the embedding, a source of its own, against the
  running partial sum) is not the baseline: the paper measured it at about a third of Full's gain. One
  block that beats the variants selecting among depths points at access to the embedding (or a
  mis-specified baseline), not at depth attention.
- x0 (`lambda * sum + mu * embedding`, learned scalars, no attention) is the baseline-family control for
  that access: each AttnRes variant's paired gain over x0 is the share of its gain that needs selection
  over depth.
- The embedding's share of every depth read: reads that put nearly all their weight on the embedding
  are routing around something the baseline cannot (an embedding drowned in the residual sum).
"""
from __future__ import annotations

import math
import statistics

from scripts.report.depth import mean_record
from scripts.report.runs import Group
from scripts.report.stats import NOISE_SIGMAS, mean_std, pooled_std, pooled_std_of
from scripts.report.sweeps import final_losses


def is_one_block(group: Group) -> bool:
    model = group.runs[0].config.model
    return group.is_plain_block and group.block_size >= model.n_sublayers


def seed_spread(a: list[float], b: list[float], same_size: list[list[float]]) -> float | None:
    """The pooled std of the two groups; when either has a single seed, the pooled std of every group of
    the same model size that has two or more (seed noise depends on the size and budget, not the group)."""
    pooled = pooled_std(a, b)
    return pooled if pooled is not None else pooled_std_of(same_size)


def paired(a: Group, b: Group) -> list[float]:
    """a's final loss minus b's, seed by seed, over the seeds both have finished (the same seed gives
    both the same data order and the same initial weights for the parameters they share)."""
    losses_b = {run.seed: run.final_val_loss for run in b.runs if run.final_val_loss is not None}
    return [run.final_val_loss - losses_b[run.seed] for run in a.runs
            if run.final_val_loss is not None and run.seed in losses_b]


def paired_text(diffs: list[float]) -> str:
    mean, sd = mean_std(diffs)
    spread = f" ± {sd:.4f}" if sd is not None else ""
    return f"{mean:+.4f}{spread} (paired, {len(diffs)} seed{'s' if len(diffs) > 1 else ''})"


def attends_over_depth(group: Group) -> bool:
    """Full, or Block with more than one block: a read that selects among earlier depths."""
    return group.kind == "full" or (group.is_plain_block and not is_one_block(group))


def one_block_verdict(head: str, one: Group, base: Group, deep: list[Group], pooled: float | None) -> str:
    """One block keeps the embedding as its own source b_0, and every read weighs it against the running
    sum: the paper (436M) measured it at about a third of Full's gain (-0.009 against -0.029). It should
    gain less than the variants that select among depths; gaining more says the gain here is access to the
    embedding (or a handicapped baseline), not depth selection."""
    diff = statistics.fmean(final_losses(one)) - statistics.fmean(final_losses(base))
    if pooled is None:
        return (f"{head}; no group of this size has two seeds, so there is no noise estimate and this check "
                "cannot flag anything.")
    if not deep:
        if diff < -NOISE_SIGMAS * pooled:
            return (f"{head}, more than {NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}) below the "
                    "baseline, with no Full or Block run to set it against. **Warning: the sign of a "
                    "mis-specified baseline, or of a gain that is access to the embedding.** The paper measured "
                    "one block at about a third of Full's gain; add Full and `variant=x0` runs to tell which.")
        return f"{head}, within {NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}) or above the baseline."
    best = min(deep, key=lambda g: statistics.fmean(final_losses(g)))
    ahead = statistics.fmean(final_losses(one)) - statistics.fmean(final_losses(best))
    if ahead < -NOISE_SIGMAS * pooled:
        return (f"{head}, ahead of the best depth-selecting variant ({best.variant}) by {-ahead:.4f}, more than "
                f"{NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}). **Warning: the fewer the blocks, "
                "the better.** The paper has one block at about a third of Full's gain; here the gain comes from "
                "access to the embedding (or a handicapped baseline) more than from attention over depth: see "
                "the x0 control.")
    return (f"{head}; behind or level with the best depth-selecting variant ({best.variant}) within "
            f"{NOISE_SIGMAS:g} pooled std ({NOISE_SIGMAS * pooled:.4f}): consistent with the paper (one block "
            "keeps a share of AttnRes's gain: the embedding as its own source).")


def x0_lines(setting: str, base: Group, x0: Group | None, attnres: list[Group]) -> list[str]:
    """x0 reaches the embedding with two learned scalars per read and no attention: what AttnRes gains over
    it is the share of its gain that needs selection over depth."""
    if x0 is None:
        return [f"- {setting}: no x0 run, so embedding access and attention over depth cannot be told apart "
                "(add a run with `variant=x0`)."] if attnres else []
    lines = [f"- {setting}: x0 minus baseline = {paired_text(paired(x0, base))}: the gain of access to the "
             "embedding alone."]
    for group in attnres:
        over_x0, over_base = paired(group, x0), paired(group, base)
        if not over_x0 or not over_base:
            continue
        gain, selection = statistics.fmean(over_base), statistics.fmean(over_x0)
        # Paired, not pooled: the same seed gives both runs the same data and initial weights, so the
        # seed-to-seed spread that pooled std counts cancels (Full's 3 paired gains under AdamW: -0.036 ± 0.001).
        _, spread = mean_std(over_base)
        if spread is not None and gain < -NOISE_SIGMAS * spread / math.sqrt(len(over_base)):
            share = f"; the depth-selection share of its gain over the baseline is {selection / gain:.0%}"
        else:
            # A share of a gain that seed noise could have made is a ratio of two noises (it once read -251%).
            share = (f"; its gain over the baseline ({paired_text(over_base)}) is within {NOISE_SIGMAS:g} "
                     "standard errors of its paired differences, so there is no gain to split into shares")
        lines.append(f"  - {group.variant}: AttnRes's gain over x0 is {paired_text(over_x0)}{share}.")
    return lines


def one_block_lines(groups: list[Group]) -> list[str]:
    lines = []
    for setting in dict.fromkeys(g.size for g in groups):
        here = [g for g in groups if g.size == setting and final_losses(g)]
        base = next((g for g in here if g.kind == "baseline"), None)
        if base is None or all(g.kind == "baseline" for g in here):
            continue  # nothing to compare in this setting (a baseline-only sweep point)
        sublayers = base.runs[0].config.model.n_sublayers
        one = next((g for g in here if is_one_block(g)), None)
        deep = [g for g in here if attends_over_depth(g)]
        if one is None:
            lines.append(f"- {setting}: no one-block run to check the baseline against (add a run with "
                         f"`variant=block variant.block_size={sublayers}`).")
        else:
            pooled = seed_spread(final_losses(one), final_losses(base),
                                 [final_losses(g) for g in groups if g.model_size == base.model_size])
            head = f"- {setting}: one block ({one.variant}) minus baseline = {paired_text(paired(one, base))}"
            lines.append(one_block_verdict(head, one, base, deep, pooled))
        x0 = next((g for g in here if g.kind == "x0"), None)
        lines += x0_lines(setting, base, x0, ([one] if one else []) + deep)
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
             "handicapped by its recipe, or a gain that is access to the embedding rather than attention over "
             "depth.", "", *checks, ""]
    shares = embedding_share_lines(groups)
    return lines + (shares + [""] if shares else [])
