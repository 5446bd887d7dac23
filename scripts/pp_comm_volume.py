"""Pipeline communication volume of AttnRes from the config alone (no weights, no processes).

Prints, in d-sized block vectors per token for one forward pass, the paper's naive volume
C(C-1)/2 * N_p, the paper's cached bound P(P-1)/2 * N_p + (V-1) * P^2 * N_p, the exact optimum
P(P-1)/2 * N_p + (V-1) * P(P-1) * N_p, and what our stages send per transition (with the embedding
b_0 and the partial sums of blocks that straddle a cut shown separately); then, beside it, what the
baseline (its running sum) and mHC (its m = 4 streams) send.

    python -m scripts.pp_comm_volume pp=4 [vp=2] [model=s] [trainer overrides...]
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from model.residual import DepthGeometry
from parallel.pipeline.plan import PipelinePlan
from scripts.cli import fail, key, one_line_errors, parse
from trainer.config import ConfigError, load_config

MHC_STREAMS = 4  # the paper's mHC (configs/variant/mhc.yaml)


@dataclass
class Args:
    pp: int | None = key(None, "pipeline stages P (required)")
    vp: int = key(1, "virtual stages per rank V")
    model: str = key("s", "configs/model/ size")


def volumes(plan: PipelinePlan) -> dict:
    p, v, c = plan.pp, plan.vp, plan.n_chunks
    n_p = plan.blocks_per_chunk()
    transitions = [plan.transition(k) for k in range(c - 1)]
    embedding = sum(1 for t in transitions if t.first_block == 0)  # b_0 rides along until a rank caches it
    partials = sum(int(t.sends_partial) for t in transitions)
    blocks = sum(t.n_blocks for t in transitions)
    return {
        "N_p": n_p,
        "naive": c * (c - 1) / 2 * n_p,
        "paper_cached": p * (p - 1) / 2 * n_p + (v - 1) * p * p * n_p,
        "optimum": p * (p - 1) / 2 * n_p + (v - 1) * p * (p - 1) * n_p,
        "ours_blocks": blocks - embedding,
        "ours_embedding": embedding,
        "ours_partial_sums": partials,
        "ours_total": blocks + partials,
        "per_transition": plan.sent_vectors(),
    }


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse(Args, __doc__, argv, trainer_overrides=True)
    with one_line_errors(ConfigError):
        cfg = load_config([f"model={args.model}", *overrides]).model
    if args.pp is None or args.pp < 1 or args.vp < 1:
        fail(f"pp={args.pp} and vp={args.vp} must be positive integers, pp= is required: e.g. pp=4 vp=2")
    print(f"model={args.model} variant={cfg.residual.kind} blocks={cfg.n_blocks} block_size={DepthGeometry.of(cfg).size} "
          f"P={args.pp} V={args.vp} d={cfg.d_model}")
    for cache in (False, True):
        plan = PipelinePlan(cfg, args.pp, args.vp, cache)
        vol = volumes(plan)
        print(f"cache={'on ' if cache else 'off'} N_p={vol['N_p']:.3g}: naive C(C-1)/2*N_p={vol['naive']:.3g}  "
              f"paper cached bound={vol['paper_cached']:.3g}  exact optimum={vol['optimum']:.3g}  | ours: "
              f"blocks={vol['ours_blocks']} + embedding b_0={vol['ours_embedding']} + partial sums="
              f"{vol['ours_partial_sums']} = {vol['ours_total']} vectors/token "
              f"({vol['ours_total'] * cfg.d_model * 4} bytes fp32); per transition {vol['per_transition']}")
    # The residual-stream variants send the same at every cut, cache or not: the baseline its sum,
    # mHC its m streams (the m-times communication the paper sets against AttnRes's blocks).
    for variant, streams in (("baseline", 1), ("mhc", MHC_STREAMS)):
        other = replace(cfg, residual=replace(cfg.residual, variant=variant, streams=streams))
        sent = PipelinePlan(other, args.pp, args.vp, cache=False).sent_vectors()
        label = "baseline" if variant == "baseline" else f"mHC m={streams}"
        print(f"{label}: {sum(sent)} vectors/token ({sum(sent) * cfg.d_model * 4} bytes fp32); per transition {sent}")


if __name__ == "__main__":
    main()
