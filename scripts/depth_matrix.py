"""The depth-mixing matrix M of a trained run (paper section 6.2): h_l = sum_{i<l} M[i->l] v_i.

    python -m scripts.depth_matrix checkpoint=runs/NAME [batches=4] [out=DIR] [rtol=1e-4]

Runs `batches` of the run's validation windows through the model with a DepthTrace, which gives M per
token as the variant computes it (rows: the reads before sublayers 1..L and the final read; columns:
v_0 = the embedding, v_1 .. v_L), and writes to out (default RUN/depth_matrix/):
  depth_matrix.json  mean M and its std across tokens, the semiseparable rank per token summarised, the
                     entropy of each row
  depth_matrix.png   mean M and its std as heatmaps
Semiseparable rank of one token's M: the largest numerical rank of any lower-left block M[l >= k, i < k]
(k = 1 .. L+1), a singular value counting when it exceeds rtol times the block's largest (default 1e-4:
far above float32 rounding, ~1e-7, far below the weights a trained model uses). Multi-head reads and
elementwise gates give one matrix per channel group; each counts as a sample. Row entropy: of the row's
absolute weights normalised to sum 1 (log l for uniform weights over l sources), mean over tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model.residual import DepthTrace
from scripts.cli import key, one_line_errors, parse
from trainer.run_dir.checkpoint import CheckpointError
from trainer.trained import load_trained

RANK_SAMPLES = 4096  # token matrices whose rank is computed (evenly spaced): SVDs of every token are slow


class DepthMatrixError(ValueError):
    """Bad arguments; one line."""


@dataclass
class DepthMatrixArgs:
    checkpoint: str | None = key(None, "a run directory or one of its checkpoints (required)")
    out: str | None = key(None, "where depth_matrix.json and .png go (null: RUN/depth_matrix/)")
    batches: int = key(4, "validation batches run through the model")
    rtol: float = key(1e-4, "a singular value counts toward the rank above rtol times the block's largest")


def semiseparable_rank(matrices: torch.Tensor, rtol: float) -> torch.Tensor:
    """(N, L+1, L+1) matrices, row l-1 = M[:, l] -> (N,) largest numerical rank of M[l >= k, i < k]."""
    size = matrices.shape[-1]
    ranks = [torch.linalg.matrix_rank(matrices[:, k - 1:, :k].double(), rtol=rtol) for k in range(1, size + 1)]
    return torch.stack(ranks, -1).amax(-1)


def row_entropy(matrices: torch.Tensor) -> torch.Tensor:
    """(N, L+1, L+1) -> (N, L+1): entropy of each row's absolute weights normalised to sum 1."""
    weights = matrices.double().abs()
    p = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


def token_matrices(model, batches) -> torch.Tensor:
    """(N, L+1, L+1) float64: M of every token (and channel group) of `batches` ((inputs, targets) pairs)."""
    collected = []
    with torch.no_grad():
        for inputs, _ in batches:
            trace = DepthTrace()
            model(inputs, trace=trace)
            collected.append(trace.matrix().flatten(0, 2).double())  # (B, T, G, L+1, L+1) -> (B*T*G, ...)
    return torch.cat(collected)


def summarise(matrices: torch.Tensor, rtol: float) -> dict:
    stride = max(1, math.ceil(matrices.shape[0] / RANK_SAMPLES))
    ranks = semiseparable_rank(matrices[::stride], rtol)
    counts = torch.bincount(ranks, minlength=int(ranks.max()) + 1)
    lower = torch.ones(matrices.shape[-2:], dtype=torch.bool).tril()

    def masked(t: torch.Tensor) -> list[list[float | None]]:
        return [[v if keep else None for v, keep in zip(row, mask)] for row, mask in zip(t.tolist(), lower.tolist())]

    return {
        "rows": "read before sublayer l = 1..L, then the final read", "columns": "v_0 (embedding), v_1 .. v_L",
        "samples": matrices.shape[0], "mean": masked(matrices.mean(0)), "std": masked(matrices.std(0)),
        "semiseparable_rank": {"rtol": rtol, "samples": ranks.numel(), "mean": ranks.double().mean().item(),
                               "median": ranks.median().item(), "max": ranks.max().item(),
                               "fraction": {str(r): c / ranks.numel() for r, c in enumerate(counts.tolist()) if c}},
        "row_entropy": row_entropy(matrices).mean(0).tolist(),
    }


def reader_extent(size: int) -> tuple[float, float, float, float]:
    """imshow extent for an (L+1) x (L+1) M: columns are sources 0..L, rows readers 1..L+1."""
    return (-0.5, size - 0.5, size + 0.5, 0.5)


def plot(summary: dict, title: str, path: Path) -> None:
    from scripts.report.figure import new_figure, save

    fig, axes = new_figure(2, width=5.0, height=4.2)
    for ax, key in zip(axes, ("mean", "std")):
        values = [[math.nan if v is None else v for v in row] for row in summary[key]]
        image = ax.imshow(values, cmap="viridis", interpolation="nearest", extent=reader_extent(len(values)))
        ax.set(xlabel="source i (0 = embedding)", ylabel="reading sublayer l (last: final read)", title=f"M {key}")
        fig.colorbar(image, ax=ax)
    rank = summary["semiseparable_rank"]
    fig.suptitle(f"{title}: semiseparable rank mean {rank['mean']:.2f}, max {rank['max']}", fontsize=9)
    save(fig, path)


def depth_matrix(args: DepthMatrixArgs) -> str:
    if not args.checkpoint:
        raise DepthMatrixError("checkpoint= is required: a run directory or one of its checkpoints")
    if args.batches < 1:
        raise DepthMatrixError(f"batches={args.batches} must be at least 1")
    if not 0 < args.rtol < 1:
        raise DepthMatrixError(f"rtol={args.rtol} must be in (0, 1)")
    run = load_trained(args.checkpoint)
    out = Path(args.out) if args.out else run.checkpoint.parent.parent / "depth_matrix"
    summary = summarise(token_matrices(run.model, run.validation_batches(args.batches)), args.rtol)
    r = run.cfg.model.residual
    summary.update(checkpoint=str(run.checkpoint), step=run.step, variant=r.kind)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth_matrix.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, f"{r.kind} step {run.step}", out / "depth_matrix.png")
    rank = summary["semiseparable_rank"]
    return (f"{run.checkpoint}: {summary['samples']} token matrices; semiseparable rank mean {rank['mean']:.2f}, "
            f"max {rank['max']} (rtol {args.rtol}); wrote {out}/depth_matrix.json and .png")


def main(argv: list[str] | None = None) -> None:
    args = parse(DepthMatrixArgs, __doc__, argv)
    with one_line_errors(DepthMatrixError, CheckpointError, FileNotFoundError):
        print(depth_matrix(args))


if __name__ == "__main__":
    main()
