"""Optimizer (AdamW, or Muon + AdamW) and the warmup + WSD / cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from parallel.placement import placed_parameters
from trainer.config import OptimConfig, TrainConfig
from trainer.muon import MatrixSlice, Muon


class OptimizerGroup(torch.optim.Optimizer):
    """Several optimizers stepped as one.

    An Optimizer subclass so a single LambdaLR drives it: param_groups are the inner optimizers' own group
    dicts, so the scheduler scales each group's own base lr (AdamW's lr, Muon's muon_lr) in place.
    DCP's get_state_dict / set_state_dict need the real optimizers: pass `.optimizers`.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # Optimizer.__init__ is skipped on purpose: it would keep a second copy of every param group,
        # which goes stale when an inner load_state_dict replaces the inner groups.
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def __repr__(self) -> str:
        return f"OptimizerGroup({', '.join(type(opt).__name__ for opt in self.optimizers)})"

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for opt, opt_state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            opt.load_state_dict(opt_state)


def _is_output_head(name: str) -> bool:
    # Any prefix (DDP's "module.") is fine: the head is the only module called lm_head.
    return "lm_head" in name.split(".")


def split_parameters(model: nn.Module, use_muon: bool) -> tuple[list, list, list]:
    """(muon, decay, no_decay) trainable parameters.

    Weight decay goes on matrices only: never on 1-D parameters (norm weights, biases, AttnRes queries,
    A_log, dt_bias) nor on the embedding, whose rows of rare tokens decay towards 0 between their updates.
    With use_muon, every 2-D matrix except the embedding and the output head goes to Muon (the standard
    split: those two are lookups/classifiers, not hidden linear maps). The 3-D stacked expert weights stay
    on AdamW: torch.optim.Muon refuses non-2-D parameters, and orthogonalising each expert's slice would
    need a custom Muon (which would also have to swap dims in its out/in lr scaling: the slices are
    (in, out), the transpose of nn.Linear's weight).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or id(param) in embeddings:
            no_decay.append(param)
        elif use_muon and param.ndim == 2 and not _is_output_head(name):
            muon.append(param)
        else:
            decay.append(param)
    return muon, decay, no_decay


def tensor_parallel_slices(model: nn.Module, tp_group) -> dict[nn.Parameter, MatrixSlice]:
    """The parameters that are tp slices of larger matrices (their placement, parallel/placement.py), for
    Muon to gather."""
    return {param: MatrixSlice(placement.dim, tp_group) for _, param, placement in placed_parameters(model)
            if placement is not None and placement.axis == "tp" and param.ndim == 2}


def build_optimizer(model: nn.Module, cfg: OptimConfig, slices: dict | None = None) -> OptimizerGroup:
    """AdamW over everything, or (optim.name=muon) Muon at muon_lr for the hidden matrices and AdamW at lr
    for the rest. Always an OptimizerGroup, AdamW first, so the trainer handles both the same way.
    `slices` (tensor_parallel_slices): which of Muon's matrices are tp slices, orthogonalised whole."""
    muon_params, decay, no_decay = split_parameters(model, use_muon=cfg.name == "muon")
    adamw_groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if params
    ]
    optimizers = [torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=False)]
    if muon_params:
        # adjust_lr_fn=None is Keller Jordan's scaling, lr * sqrt(max(1, out/in)), which muon_lr=0.02 is
        # tuned for. Muon's decoupled decay multiplies by (1 - muon_lr * weight_decay) each step. FSDP2's
        # shards and the tp slices are orthogonalised whole (trainer/muon.py).
        optimizers.append(Muon(muon_params, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                               weight_decay=cfg.weight_decay, slices=slices))
    return OptimizerGroup(optimizers)


def _decay_progress(step: int, start: int, steps: int) -> float:
    """Fraction of the decay phase [start, steps) done after step `step`: 1 at the last step, 0 before start."""
    span = steps - start
    if span <= 0:
        return 0.0
    return min(1.0, max(0.0, (step - start + 1) / span))


def wsd_decay_start(train: TrainConfig) -> int:
    """Steps a wsd run takes before its decay (all at the peak LR once warmed up). The checkpoint after
    exactly this many steps is where the run can be extended: under a larger train.steps every LR it has
    used stays the same, so training on from it matches a run given the larger train.steps from the start."""
    return train.steps - round(train.decay_fraction * train.steps)


def lr_multiplier(step: int, train: TrainConfig) -> float:
    """LR multiplier for optimizer step `step` (0 is the first update; LambdaLR passes its last_epoch).

    Warmup ramps linearly as (step + 1) / warmup_steps, so the first update already moves at 1/warmup and
    step warmup_steps - 1 is at 1. The tail follows train.steps (not stop_after) and reaches min_lr_ratio
    exactly at the last step, train.steps - 1:
      wsd:    1 until the last round(decay_fraction * steps) steps, then linear down to min_lr_ratio;
      cosine: cosine from 1 (end of warmup) down to min_lr_ratio.
    Where warmup and decay overlap (very short runs) the smaller value wins.
    """
    warmup = min(1.0, (step + 1) / train.warmup_steps) if train.warmup_steps > 0 else 1.0
    floor = train.min_lr_ratio
    if train.schedule == "wsd":
        progress = _decay_progress(step, wsd_decay_start(train), train.steps)
        tail = 1.0 - (1.0 - floor) * progress
    else:
        progress = _decay_progress(step, train.warmup_steps, train.steps)
        tail = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min(warmup, tail)


def schedules_agree(step: int, first: TrainConfig, second: TrainConfig) -> bool:
    """Both schedules give step `step` the same LR multiplier (up to float noise)."""
    return math.isclose(lr_multiplier(step, first), lr_multiplier(step, second), rel_tol=1e-9, abs_tol=1e-12)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig) -> LambdaLR:
    """One LambdaLR over all param groups: each keeps its own base lr, scaled by lr_multiplier.
    Call scheduler.step() after every optimizer.step()."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, train_cfg))


def set_schedule_step(scheduler: LambdaLR, step: int, base_lrs: list[float] | None = None) -> None:
    """Put the scheduler at `step` under its own lr_lambda (and, given base_lrs, new peak lrs per param
    group) and set the optimizer's lrs to match.

    A checkpoint restores the lr its own schedule gave for the next step and its own peaks; a resumed run
    whose schedule or peaks differ (a longer train.steps, a new optim.lr) takes its next lr from this launch.
    """
    if base_lrs is not None:
        scheduler.base_lrs = list(base_lrs)
        for group, lr in zip(scheduler.optimizer.param_groups, base_lrs, strict=True):
            group["initial_lr"] = lr
    lrs = [base * multiplier(step) for base, multiplier in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler.last_epoch = step
    scheduler._last_lr = lrs  # what get_last_lr() reports; LambdaLR has no public setter
