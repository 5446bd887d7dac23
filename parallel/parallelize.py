"""The one place that knows both the model and the parallel layout.

An engine runs one step's forward and backward over this rank's micro-batches, evaluates, clips
gradients and keeps MoE balancing consistent, whatever the layout: DDP when pp == 1, the pipeline
schedule (with the cross-stage block cache) when pp > 1. `engine.model` is this rank's Decoder (all
of it, or the parts its pipeline chunks run): the optimizer and checkpoints use it, and its parameter
names are the single-process names in every layout.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from model.decoder import Decoder
from parallel.dims import DistInfo, Layout


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


class DataParallelEngine:
    def __init__(self, model: Decoder, info: DistInfo, layout: Layout):
        self.info, self.layout = info, layout
        self.model = model.to(info.device)
        self.wrapped = model
        if info.world_size > 1:
            device_ids = [info.device.index] if info.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=layout.dp_group)

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        total = torch.zeros((), device=self.info.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.wrapped is self.model else self.wrapped.no_sync()
            with sync:
                with autocast():
                    logits = self.wrapped(inputs, diagnostics=diagnostics if index == 0 else None)
                loss = cross_entropy(logits, targets)
                ((loss + self.model.aux_loss().to(loss.device)) / len(micro_batches)).backward()
            total += loss.detach()
        return _all_reduce(total / len(micro_batches), self.layout.dp_group) / self.layout.dp

    @torch.no_grad()
    def evaluate(self, batches, autocast) -> tuple[float, int]:
        """(sum of loss * tokens, tokens) over this rank's share of the batches."""
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for index, (inputs, targets) in enumerate(batches):
            if index % self.layout.dp != self.layout.dp_rank:
                continue
            with autocast():
                logits = self.model(inputs)
            loss_sum += cross_entropy(logits, targets).item() * targets.numel()
            tokens += targets.numel()
        self.model.train()
        return loss_sum, tokens

    def grad_norm_group(self):
        return None  # every rank holds every parameter

    def comm_report(self) -> dict | None:
        return None


class PipelineEngine:
    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, parallel_cfg, micro_batch: int,
                 seq_len: int, microbatches: int):
        from parallel.pipeline.plan import PipelinePlan
        from parallel.pipeline.runner import PipelineRunner

        self.info, self.layout = info, layout
        self.plan = PipelinePlan(model.cfg, layout.pp, parallel_cfg.vp, parallel_cfg.pp_cache)
        self.microbatches = microbatches
        self.runner = PipelineRunner(model.to(info.device), self.plan, layout.pp_rank, layout.pp_group,
                                     info.device, parallel_cfg.schedule, microbatches, micro_batch, seq_len,
                                     loss_fn=cross_entropy)
        self.model = self.runner.rank_model

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        inputs = torch.cat([i for i, _ in micro_batches])
        targets = torch.cat([t for _, t in micro_batches])
        with autocast():
            loss = self.runner.step(inputs, targets)
        for p in self.model.parameters():  # average over data-parallel replicas of this stage
            if p.grad is not None:
                _all_reduce(p.grad, self.layout.dp_group).div_(self.layout.dp)
        return _all_reduce(loss, self.layout.dp_group) / self.layout.dp

    @torch.no_grad()
    def evaluate(self, batches, autocast) -> tuple[float, int]:
        """Groups `microbatches` batches into one pipeline evaluation; incomplete groups are dropped."""
        batches = [b for b in batches if b[0].shape[0] == batches[0][0].shape[0]] if batches else []
        groups = [batches[i:i + self.microbatches] for i in range(0, len(batches) - self.microbatches + 1,
                                                                   self.microbatches)]
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for index, group in enumerate(groups):
            if index % self.layout.dp != self.layout.dp_rank:
                continue
            inputs, targets = torch.cat([i for i, _ in group]), torch.cat([t for _, t in group])
            with autocast():
                loss_sum += self.runner.eval(inputs, targets).item() * targets.numel()
            tokens += targets.numel()
        self.model.train()
        return loss_sum, tokens

    def grad_norm_group(self):
        return self.layout.pp_group  # stages hold disjoint parameters

    def comm_report(self) -> dict:
        """The planned message layout (vectors per token per transition) and the bytes per token the
        stages of every pipeline rank measured on the tensors they sent, by sender chunk."""
        measured = [None] * self.layout.pp
        dist.all_gather_object(measured, self.runner.measured_bytes_per_token(), group=self.layout.pp_group)
        by_sender = {sender: value for rank_values in measured for sender, value in rank_values.items()}
        return {"pp": self.plan.pp, "vp": self.plan.vp, "cache": self.plan.cache,
                "vectors_per_token": self.plan.sent_vectors(),
                "measured_bytes_per_token": [by_sender[c] for c in range(self.plan.n_chunks - 1)]}


def build_engine(model: Decoder, info: DistInfo, layout: Layout, parallel_cfg, micro_batch: int, seq_len: int,
                 microbatches: int):
    if layout.pp == 1:
        return DataParallelEngine(model, info, layout)
    return PipelineEngine(model, info, layout, parallel_cfg, micro_batch, seq_len, microbatches)


def clip_grad_norm(model: Decoder, max_norm: float, group) -> float:
    """Global gradient norm over all ranks that hold different parameters (the pipeline group), then clip."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    norm = math.sqrt(_all_reduce(local, group).item())
    if math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


@torch.no_grad()
def sync_moe_load(model: Decoder, group) -> None:
    """Sum expert load over data-parallel ranks so every rank nudges its balancing bias the same way."""
    for moe in model.moe_layers():
        _all_reduce(moe.load_counts, group)

