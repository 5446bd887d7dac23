"""ReSkip: rank a trained run's sublayers by how much later reads rely on them, skip the least important.

    python -m scripts.reskip checkpoint=RUN [batches=4] [ks=0,1,2,4,8] [random_seeds=3] [decode_tokens=16]
                             [repeats=3] [out=DIR]

Importance of sublayer i (1..L, attention = odd, MLP = even) is the depth-attention mass that the reads
after it give its output v_i:
    I_i = mean over tokens (and channel groups) of sum_{l = i+1}^{L+1} M[i->l]
where M is the run's depth-mixing matrix (model.residual.DepthTrace; h_l = sum_{i<l} M[i->l] v_i, row L+1
the final read), over `batches` of the trainer's validation windows. Under Block AttnRes a read weighs a
block as a whole; M gives each member sublayer of a block the block's weight (a block is the plain sum of
its members' outputs), and a partial sum's weight likewise to each member so far. For the baseline M is
all ones below the diagonal, so I_i = L + 1 - i: its order is the position order (last sublayers first).

For each k in ks it skips the k least important sublayers (model(..., skip=...): they do not run and the
residual state sees their absence) and measures, under three orders (AttnRes-guided by I, by position
last-first, and random permutations averaged over random_seeds):
  val_loss    mean token cross-entropy over the same `batches` validation windows
  prefill_ms  one forward of a validation batch (median of `repeats`)
  decode_ms   per token, a decode loop of `decode_tokens` tokens (batch 1) through the model's inference
              cache (model.new_inference_cache), median of `repeats`
Writes out (default RUN/reskip/): reskip.json and reskip.png (loss vs k per order; loss vs decode latency).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel.engine import cross_entropy
from scripts.cli import key, one_line_errors, parse
from scripts.depth_matrix import token_matrices
from trainer.run_dir.checkpoint import CheckpointError
from trainer.trained import load_trained


class ReSkipError(ValueError):
    """Bad arguments; one line."""


@dataclass
class ReSkipArgs:
    checkpoint: str | None = key(None, "a run directory or one of its checkpoints (required)")
    out: str | None = key(None, "where reskip.json and reskip.png go (null: RUN/reskip/)")
    batches: int = key(4, "validation batches: importance and val_loss")
    ks: str = key("0,1,2,4,8", "numbers of sublayers skipped, comma-separated")
    random_seeds: int = key(3, "random skip orders averaged")
    decode_tokens: int = key(16, "tokens per timed decode loop")
    repeats: int = key(3, "timed repeats (median)")


def importance(matrices: torch.Tensor) -> list[float]:
    """(N, L+1, L+1) depth-mixing matrices (row l-1 = the read before sublayer l) -> I_1 .. I_L."""
    # Column i holds v_i's weights; the reads after sublayer i are rows i .. L (sublayers i+1 .. L+1).
    return [matrices[:, i:, i].sum(-1).mean().item() for i in range(1, matrices.shape[-1])]


def skip_orders(scores: list[float], seeds: int) -> dict[str, list[list[int]]]:
    """Sublayers 1..L in skipping order: least important first (ties: the later sublayer first), by
    position (last first), and one random permutation per seed."""
    n = len(scores)
    guided = sorted(range(1, n + 1), key=lambda i: (scores[i - 1], -i))
    random_orders = [(torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
                     for seed in range(seeds)]
    return {"attnres": [guided], "position": [list(range(n, 0, -1))], "random": random_orders}


def validation_loss(model, batches, skip: frozenset[int]) -> float:
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            loss_sum += cross_entropy(model(inputs, skip=skip), targets).item() * targets.numel()
            tokens += targets.numel()
    return loss_sum / tokens


def _median_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_seconds(model, inputs: torch.Tensor, skip: frozenset[int], repeats: int) -> float:
    with torch.no_grad():
        return _median_seconds(lambda: model(inputs, skip=skip), repeats)


def decode_seconds_per_token(model, prompt: torch.Tensor, skip: frozenset[int], tokens: int, repeats: int) -> float:
    """Greedy decoding of `tokens` tokens, one at a time through the inference cache, from prompt (1,)."""
    def decode():
        cache = model.new_inference_cache(1, prompt.device, torch.float32)
        token = prompt.view(1, 1)
        for _ in range(tokens):
            token = model(token, cache=cache, skip=skip)[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        return _median_seconds(decode, repeats) / tokens


def measure(model, batches, skip: frozenset[int], args: ReSkipArgs) -> dict:
    inputs = batches[0][0]
    return {"val_loss": validation_loss(model, batches, skip),
            "prefill_ms": 1e3 * prefill_seconds(model, inputs, skip, args.repeats),
            "decode_ms": 1e3 * decode_seconds_per_token(model, inputs[0, 0], skip, args.decode_tokens, args.repeats)}


def _mean_rows(rows: list[dict]) -> dict:
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}


def parse_ks(text: str, n_sublayers: int) -> list[int]:
    try:
        ks = [int(k) for k in str(text).split(",") if k.strip()]
    except ValueError:
        raise ReSkipError(f"ks={text} must be comma-separated integers, e.g. ks=0,1,2,4,8") from None
    if not ks or any(not 0 <= k <= n_sublayers for k in ks):
        raise ReSkipError(f"ks={text}: every k must be in [0, {n_sublayers}] (the model's sublayers)")
    return ks


def check(args: ReSkipArgs) -> None:
    if not args.checkpoint:
        raise ReSkipError("checkpoint= is required: a run directory or one of its checkpoints")
    for key in ("batches", "random_seeds", "decode_tokens", "repeats"):
        if getattr(args, key) < 1:
            raise ReSkipError(f"{key}={getattr(args, key)} must be at least 1")


def run_reskip(args: ReSkipArgs) -> dict:
    check(args)
    run = load_trained(args.checkpoint)
    n_sublayers = run.cfg.model.n_sublayers
    ks = parse_ks(args.ks, n_sublayers)
    batches = run.validation_batches(args.batches)
    scores = importance(token_matrices(run.model, batches))
    orders = skip_orders(scores, args.random_seeds)
    results = {name: [] for name in orders}
    for k in ks:
        for name, permutations in orders.items():
            rows = [measure(run.model, batches, frozenset(order[:k]), args) for order in permutations]
            results[name].append({"k": k, **_mean_rows(rows),
                                  "skipped": [sorted(order[:k]) for order in permutations]})
    return {"checkpoint": str(run.checkpoint), "step": run.step, "variant": run.cfg.model.residual.kind,
            "block_size": run.cfg.model.residual.block_size, "n_sublayers": n_sublayers, "batches": args.batches,
            "importance": {str(i): s for i, s in enumerate(scores, 1)},
            "orders": {name: perms for name, perms in orders.items()}, "results": results,
            "decode_tokens": args.decode_tokens, "repeats": args.repeats}


def table(report: dict) -> str:
    lines = [f"{report['checkpoint']} ({report['variant']}, step {report['step']}): importance I_i "
             + " ".join(f"{i}:{s:.2f}" for i, s in report["importance"].items()),
             f"{'order':<9} {'k':>3} {'val_loss':>9} {'prefill_ms':>11} {'decode_ms/tok':>14}  skipped"]
    for name, rows in report["results"].items():
        for row in rows:
            skipped = row["skipped"][0] if name != "random" else f"mean of {len(row['skipped'])} seeds"
            lines.append(f"{name:<9} {row['k']:>3} {row['val_loss']:>9.4f} {row['prefill_ms']:>11.1f} "
                         f"{row['decode_ms']:>14.2f}  {skipped}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from scripts.report.figure import new_figure, save

    fig, (by_k, by_latency) = new_figure(2, width=5.0, height=3.8)
    for name, rows in report["results"].items():
        by_k.plot([r["k"] for r in rows], [r["val_loss"] for r in rows], marker="o", label=name)
        by_latency.plot([r["decode_ms"] for r in rows], [r["val_loss"] for r in rows], marker="o", label=name)
    by_k.set(xlabel="sublayers skipped (k)", ylabel="validation loss", title="loss vs k")
    by_latency.set(xlabel="decode latency (ms / token)", ylabel="validation loss", title="loss vs decode latency")
    by_k.legend()
    fig.suptitle(f"ReSkip: {report['variant']} step {report['step']}", fontsize=9)
    save(fig, path)


def reskip(args: ReSkipArgs) -> str:
    report = run_reskip(args)
    out = Path(args.out) if args.out else Path(report["checkpoint"]).parent.parent / "reskip"
    out.mkdir(parents=True, exist_ok=True)
    (out / "reskip.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "reskip.png")
    return f"{table(report)}\nwrote {out}/reskip.json and reskip.png"


def main(argv: list[str] | None = None) -> None:
    args = parse(ReSkipArgs, __doc__, argv)
    with one_line_errors(ReSkipError, CheckpointError, FileNotFoundError):
        print(reskip(args))


if __name__ == "__main__":
    main()
