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

from scripts.report.depth import mean_record
from scripts.report.runs import Group
from scripts.report.stats import Paired
from scripts.report.sweeps import final_losses
from scripts.report.table import paired_groups

# The paper (436M activated, its Table 4 and section 5): Full 1.737 < Block S=4 1.746 < one block, which keeps
# about a third of Full's gain (-0.009 against -0.029) < baseline 1.766.
PAPER_ORDER = "the paper: Full 1.737 < Block 1.746 < one block (about a third of Full's gain) < baseline 1.766"


def is_one_block(group: Group) -> bool:
    model = group.runs[0].config.model
    return group.is_plain_block and group.block_size >= model.n_sublayers


def attends_over_depth(group: Group) -> bool:
    """Full, or Block with more than one block: a read that selects among earlier depths."""
    return group.kind == "full" or (group.is_plain_block and not is_one_block(group))


def stated(diff: Paired) -> str:
    return f"{diff.text()}: {diff.label()}"


def order_line(behind: Group, ahead: Group, diff: Paired) -> str:
    """`behind` minus `ahead`, which the paper has ahead: whether these runs keep that order, reverse it, or
    cannot tell."""
    head = f"  - {behind.variant} minus {ahead.variant}: {stated(diff)}"
    if diff.n == 1:
        return f"{head}; one seed cannot order them."
    if not diff.excludes_zero:
        return f"{head}; the order is not established."
    if diff.mean > 0:
        return f"{head}: the paper's order."
    return f"{head}: **the reverse of the paper's order** ({PAPER_ORDER})."


def one_block_lines(setting: str, one: Group, base: Group, deep: list[Group]) -> list[str]:
    """One block keeps the embedding as its own source b_0, and every read weighs it against the running
    sum: the paper measured it at about a third of Full's gain. It should gain less than the variants that
    select among depths; gaining more says the gain here is access to the embedding (or a handicapped
    baseline), not depth selection."""
    over_base = paired_groups(one, base)
    lines = [f"- {setting}: one block ({one.variant}) minus baseline: {stated(over_base)}."]
    orders = [(one, d) for d in deep] + [(block, full) for block in deep if block.kind == "block"
                                         for full in deep if full.kind == "full"]
    checked = [(behind, ahead, diff) for behind, ahead in orders if (diff := paired_groups(behind, ahead))]
    lines += [order_line(behind, ahead, diff) for behind, ahead, diff in checked]
    if any(behind is one and diff.excludes_zero and diff.mean < 0 for behind, _, diff in checked):
        lines.append("  - **Warning: the fewer the blocks, the better.** One block beats a variant that selects "
                     "among depths: here the gain comes from access to the embedding (or a handicapped baseline) "
                     "more than from attention over depth: see the x0 control.")
    elif not deep and over_base.excludes_zero and over_base.mean < 0:
        lines.append("  - **Warning: the sign of a mis-specified baseline, or of a gain that is access to the "
                     "embedding.** The paper measured one block at about a third of Full's gain; add Full and "
                     "`variant=x0` runs to tell which.")
    return lines


def x0_lines(setting: str, base: Group, x0: Group | None, attnres: list[Group]) -> list[str]:
    """x0 reaches the embedding with two learned scalars per read and no attention: what AttnRes gains over
    it is the share of its gain that needs selection over depth."""
    if x0 is None:
        return [f"- {setting}: no x0 run, so embedding access and attention over depth cannot be told apart "
                "(add a run with `variant=x0`)."] if attnres else []
    x0_gain = paired_groups(x0, base)
    if x0_gain is None:
        return [f"- {setting}: x0 and the baseline have no finished seed in common: nothing to pair."]
    lines = [f"- {setting}: x0 minus baseline: {stated(x0_gain)}: the gain of access to the embedding alone."]
    for group in attnres:
        over_x0, over_base = paired_groups(group, x0), paired_groups(group, base)
        if over_x0 is None or over_base is None:
            continue
        if over_base.excludes_zero and over_base.mean < 0:
            share = (f"; the depth-selection share of its gain over the baseline is "
                     f"{over_x0.mean / over_base.mean:.0%}")
        else:
            # A share of a gain that seed noise could have made is a ratio of two noises (it once read -251%).
            share = (f"; its gain over the baseline ({over_base.text()}) is {over_base.label()}, so there is no "
                     "gain to split into shares")
        lines.append(f"  - {group.variant} minus x0: {stated(over_x0)}{share}.")
    return lines


def setting_lines(groups: list[Group]) -> list[str]:
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
        elif paired_groups(one, base) is not None:
            lines += one_block_lines(setting, one, base, deep)
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
    checks = setting_lines(groups) or ["- No setting here has both a baseline and an AttnRes run: nothing to check."]
    lines = ["## Sanity checks", "",
             "The paper tunes the baseline and reuses its recipe; these checks would expose a baseline "
             "handicapped by its recipe, or a gain that is access to the embedding rather than attention over "
             "depth.", "", *checks, ""]
    shares = embedding_share_lines(groups)
    return lines + (shares + [""] if shares else [])
