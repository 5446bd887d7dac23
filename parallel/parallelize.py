"""The one place that knows both the model and the parallel layout.

`parallelize` shards a model in torchtitan's order: tensor + sequence parallelism (tp) and expert
parallelism (ep) slice its parameters in place, context parallelism (cp) links its token mixers across the
slices of a sequence, then FSDP2 (parallel/fsdp.py) shards what each rank
holds over the fsdp ranks, with the whole model as its root (pp == 1) or each of this rank's pipeline
chunks. `materialise_parallel` wraps it for every layout: a model on the meta device is sharded there
and then filled from an unsharded meta copy one init unit at a time, so a rank allocates only its part.

An engine runs one step's forward and backward over this rank's micro-batches, evaluates, clips
gradients and keeps MoE balancing consistent: DataParallelEngine when pp == 1 (DDP over the data ranks,
or FSDP2's own reduce-scatter when fsdp > 1), PipelineEngine when pp > 1 (the pipeline schedule with the
cross-stage block cache). `engine.model` is this rank's Decoder (all of it, or the parts its pipeline
chunks run, with its tp/ep slices and FSDP's DTensor shards): the optimizer and checkpoints use it, its
parameter names are the single-process names in every layout, and `engine.shards` says which parameters
are tp/ep slices of larger ones.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from model.decoder import Decoder
from model.documents import document_starts
from model.init import materialise
from model.residual import DepthGeometry
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.context import apply_context_parallel
from parallel.dims import DistInfo, Layout
from parallel.expert import apply_expert_parallel, expert_param_names
from parallel.fill import fill_shards
from parallel.fsdp import apply_fsdp
from parallel.tensor import (Shards, apply_tensor_parallel, local_sequence, reduce_replicated_grads,
                             total_balance_over_sequence)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


def rank_share(items: list, layout: Layout, lockstep: bool):
    """This rank's share of `items` (every dp-th, from dp_rank) as (item, counted) pairs. In lockstep
    every data rank runs the same number of forwards, because a forward talks to the other data ranks
    (FSDP gathers parameters, expert parallelism sends tokens to the ep peers): a rank whose share is one
    short runs its last item again and does not count it."""
    data_ranks, rank = layout.data_ranks, layout.dp_rank
    if not lockstep:
        return [(items[i], True) for i in range(rank, len(items), data_ranks)]
    rounds = -(-len(items) // data_ranks)
    return [(items[min(index, len(items) - 1)], index < len(items))
            for index in range(rank, rounds * data_ranks, data_ranks)]


def shard_model(model: Decoder, layout: Layout) -> Shards:
    """Split the model in place for tp and ep, and link its token mixers over cp (no-ops at 1)."""
    shards = Shards(mesh=layout.mesh)
    apply_tensor_parallel(model, layout, shards)
    apply_expert_parallel(model, layout, shards)
    apply_context_parallel(model, layout)
    total_balance_over_sequence(model, layout)
    return shards


def parallelize(model: Decoder, layout: Layout, precision: torch.dtype,
                fsdp_roots: list[nn.Module] | None = None) -> Shards:
    """tp, then ep, then cp, then FSDP2 over `fsdp_roots` (default: the whole model; under pp, this rank's
    chunks, which keep their parameters gathered from a microbatch's forward to its backward). The ep
    slices of the routed experts stay out of FSDP: their ranks already split them, and their gradients
    are averaged over the ranks holding the same experts (finish_gradients)."""
    shards = shard_model(model, layout)
    if layout.fsdp > 1:
        experts = set(expert_param_names(shards))
        ignored = {p for name, p in model.named_parameters() if name in experts}
        apply_fsdp(fsdp_roots or [model], layout, precision, ignored, DepthGeometry.of(model.cfg),
                   reshard_after_forward=fsdp_roots is None)
    return shards


def materialise_parallel(model: Decoder, info: DistInfo, layout: Layout, seed: int, precision: torch.dtype,
                         fsdp_roots: list[nn.Module] | None = None) -> Shards:
    """Parallelize `model` and give it its initial weights on the device. A model wholly on the meta
    device is sharded there first, then filled from an unsharded meta copy one init unit at a time
    (parallel.fill), so the host never holds more than one unit beyond this rank's shards; a model
    already (partly) built is completed on the host (model.init.materialise) and sharded as it is."""
    if not all(p.is_meta for p in model.parameters()):
        materialise(model, "cpu", model.cfg.init_stds, seed)
        return parallelize(model.to(info.device), layout, precision, fsdp_roots)
    template = copy.deepcopy(model)  # meta: costs nothing
    shards = parallelize(model, layout, precision, fsdp_roots)
    model.to_empty(device=info.device)
    fill_shards(model, template, seed, slice_of=functools.partial(shards.local_slice, layout=layout))
    return shards


def finish_gradients(model: Decoder, layout: Layout, shards: Shards, dp_averaged: bool) -> None:
    """After backward: complete the partial sums over tp, then average over the data-parallel and cp ranks
    (over dp_cp for shared parameters unless DDP or FSDP already did, over the same-expert ranks for experts:
    under ep an expert's gradient already sums its ep group's tokens)."""
    reduce_replicated_grads(model, shards, layout.tp_group)
    experts = set(expert_param_names(shards))
    for name, p in model.named_parameters():
        if name in experts:
            if p.grad is None:  # no token reached this rank's experts; its peers still reduce
                p.grad = torch.zeros_like(p)
            _all_reduce(p.grad, layout.expert_dp_group).div_(layout.dp_cp)
        elif p.grad is not None and not dp_averaged and layout.dp_cp > 1:
            _all_reduce(p.grad, layout.dp_cp_group).div_(layout.dp_cp)


def cp_document_starts(inputs: torch.Tensor, boundary: int | None, layout: Layout) -> torch.Tensor | None:
    """(B, T/cp) document starts of this rank's cp slice, found on the whole sequence (a slice's first token
    may start a document): the token mixers see the cp slice, whole under tp, not this rank's tp slice.
    None without document masking (`boundary` None)."""
    if boundary is None:
        return None
    starts = document_starts(inputs, boundary)  # (B, T)
    return starts.chunk(layout.cp, dim=1)[layout.cp_rank]  # (B, T/cp)


class DataParallelEngine:
    """pp == 1. fsdp == 1: DDP over the data ranks (none with one), on tp/ep slices. fsdp > 1: the
    fully_shard-ed Decoder, whose parameters (and so its optimizer state and checkpoint entries) are
    DTensors; FSDP's reduce-scatter averages gradients over the data ranks, and under tp it shards each
    rank's tp slices over the fsdp ranks of its tp index. `wrapped` is what runs the forward;
    `grads_dp_averaged`: the backward averages gradients over the data ranks itself; `lockstep`: a
    forward talks to other data ranks (FSDP's all-gathers, the experts' all-to-all), so evaluation keeps
    every rank running; `document_boundary`: the end-of-text id with document masking (build_engine),
    None without."""

    document_boundary: int | None = None

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, seed: int, precision: torch.dtype):
        self.info, self.layout = info, layout
        self.shards = materialise_parallel(model, info, layout, seed, precision)
        self.model = self.wrapped = model
        self.lockstep = layout.ep > 1 or layout.fsdp > 1
        if layout.dp_cp > 1 and layout.fsdp == 1:
            # Experts are averaged over their own ranks (finish_gradients). Buffers need no sync per
            # forward: the MoE bias moves the same way everywhere, and syncing would overwrite the
            # per-rank expert load counts between micro-batches.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(self.shards))
            # device_ids=None on CUDA too (a single-device module: DDP takes its device, and the batches
            # are already there), so the CPU tests run the same construction as a GPU job.
            self.wrapped = DistributedDataParallel(model, device_ids=None, process_group=layout.dp_cp_group,
                                                   forward_sync_buffers=False)
        self.grads_dp_averaged = self.wrapped is not self.model or layout.fsdp > 1

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        """Mean loss of the step over all tokens of all ranks. Under tp every rank runs its slice of
        the sequence; the loss is scaled by 1/tp so the summed gradients are the full-sequence mean. Under
        cp each rank's loss is the mean over its slice, and averaging over dp_cp makes the whole mean."""
        total = torch.zeros((), device=self.info.device)
        tp = self.layout.tp
        for index, (inputs, targets) in enumerate(micro_batches):
            starts = cp_document_starts(inputs, self.document_boundary, self.layout)
            inputs, targets = local_sequence(inputs, self.layout), local_sequence(targets, self.layout)
            last = index == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.wrapped is self.model else self.wrapped.no_sync()
            with sync:
                with autocast():
                    logits = self.wrapped(inputs, diagnostics=diagnostics if index == 0 else None,
                                          document_starts=starts)
                loss = cross_entropy(logits, targets)
                ((loss + self.model.aux_loss().to(loss.device)) / (len(micro_batches) * tp)).backward()
            total += loss.detach()
        finish_gradients(self.model, self.layout, self.shards, dp_averaged=self.grads_dp_averaged)
        total = _all_reduce(total / (len(micro_batches) * tp), self.layout.tp_group)
        return _all_reduce(total, self.layout.dp_cp_group) / self.layout.dp_cp

    @torch.no_grad()
    def evaluate(self, batches, autocast) -> tuple[float, int]:
        """(sum of loss * tokens, tokens) over this rank's share of the batches."""
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for (inputs, targets), counted in rank_share(batches, self.layout, lockstep=self.lockstep):
            starts = cp_document_starts(inputs, self.document_boundary, self.layout)
            inputs, targets = local_sequence(inputs, self.layout), local_sequence(targets, self.layout)
            with autocast():
                logits = self.model(inputs, document_starts=starts)
            if counted:
                loss_sum += cross_entropy(logits, targets).item() * targets.numel()
                tokens += targets.numel()
        self.model.train()
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        totals = _all_reduce(_all_reduce(totals, self.layout.tp_group), self.layout.cp_group)
        return totals[0].item(), int(totals[1].item())

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, max_norm, self.layout, self.shards)

    def comm_report(self) -> dict | None:
        return None


class PipelineEngine:
    """pp > 1: this rank's chunks run by the schedule (parallel/pipeline/runner.py). `document_boundary`: as
    DataParallelEngine's; every stage gets its microbatch's starts from the schedule, which hands the whole
    batch's keyword arguments to every rank."""

    document_boundary: int | None = None

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, parallel_cfg, micro_batch: int,
                 seq_len: int, microbatches: int, seed: int, precision: torch.dtype):
        from parallel.pipeline.plan import PipelinePlan
        from parallel.pipeline.runner import PipelineRunner, keep_rank_parts

        self.info, self.layout = info, layout
        self.plan = PipelinePlan(model.cfg, layout.pp, parallel_cfg.vp, parallel_cfg.pp_cache)
        self.microbatches = microbatches
        # Pruned while still on meta: this rank never allocates the other stages' weights.
        keep_rank_parts(model, self.plan, layout.pp_rank)
        # The stages' messages travel in the residual stream's dtype, the embedding's: FSDP's gathered
        # parameter dtype, else the parameters' own (autocast leaves the embedding in fp32).
        stream_dtype = precision if layout.fsdp > 1 else next(model.parameters()).dtype

        def parallelize_chunks(chunks):  # the runner builds the chunks, then its stages around them
            self.shards = materialise_parallel(model, info, layout, seed, precision, fsdp_roots=chunks)

        # Under cp and tp the stages pass sequence slices (B, T/(cp*tp), d); 1/tp makes the tp ranks' losses sum
        # to their cp slice's mean, and the cp slices' means are averaged with the data ranks'.
        tp = layout.tp
        self.runner = PipelineRunner(model, self.plan, layout.pp_rank, layout.pp_group, info.device,
                                     parallel_cfg.schedule, microbatches, micro_batch,
                                     seq_len // layout.degrees.sequence_ranks,
                                     loss_fn=lambda logits, targets: cross_entropy(logits, targets) / tp,
                                     parallelize_chunks=parallelize_chunks, message_dtype=stream_dtype)
        self.model = self.runner.rank_model
        for chunk in self.runner.chunks:  # the tp ranks' balance losses sum to the whole one, as the LM loss's
            chunk.aux_loss_scale = 1 / tp
        # Ranks whose forwards talk across data ranks (FSDP's all-gathers, the experts' all-to-all)
        # evaluate in lockstep.
        self.lockstep = layout.fsdp > 1 or layout.ep > 1

    def _local(self, batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's inputs and targets of the whole batch, and its document starts (None without masking)."""
        inputs = torch.cat([i for i, _ in batches])  # (microbatches * B, T)
        targets = torch.cat([t for _, t in batches])
        starts = cp_document_starts(inputs, self.document_boundary, self.layout)
        return local_sequence(inputs, self.layout), local_sequence(targets, self.layout), starts

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        loss = self.runner.step(*self._local(micro_batches), autocast)
        # FSDP's reduce-scatter already averaged over every data rank (replicas and shards).
        finish_gradients(self.model, self.layout, self.shards, dp_averaged=self.layout.fsdp > 1)
        return _all_reduce(_all_reduce(loss, self.layout.tp_group), self.layout.dp_cp_group) / self.layout.dp_cp

    @torch.no_grad()
    def evaluate(self, batches, autocast) -> tuple[float, int]:
        """Groups `microbatches` batches into one pipeline evaluation; incomplete groups are dropped."""
        batches = [b for b in batches if b[0].shape[0] == batches[0][0].shape[0]] if batches else []
        groups = [batches[i:i + self.microbatches] for i in range(0, len(batches) - self.microbatches + 1,
                                                                   self.microbatches)]
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for group, counted in rank_share(groups, self.layout, self.lockstep):
            loss = _all_reduce(self.runner.eval(*self._local(group), autocast), self.layout.tp_group)
            loss = _all_reduce(loss, self.layout.cp_group) / self.layout.cp
            if counted:
                count = sum(t.numel() for _, t in group)
                loss_sum += loss.item() * count
                tokens += count
        self.model.train()
        return loss_sum, tokens

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, max_norm, self.layout, self.shards)

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
                 microbatches: int, activation_checkpointing: str = "none", seed: int = 0,
                 precision: torch.dtype = torch.float32, document_boundary: int | None = None):
    """`model` may be on the meta device (build_model(cfg, device="meta")): each engine allocates and
    initialises only what this rank keeps, from `seed` (model.init.materialise); parts already
    materialised keep their values. `precision` (parallel.dims.resolve_precision) sets FSDP2's gathered
    parameter dtype and the pipeline's message dtype; the forward's autocast is the caller's.
    `document_boundary`: the end-of-text token id to mask documents at (model/documents.py), or None."""
    apply_activation_checkpointing(model, activation_checkpointing)  # before any sharding wraps the blocks
    if layout.pp > 1:
        engine = PipelineEngine(model, info, layout, parallel_cfg, micro_batch, seq_len, microbatches, seed, precision)
    else:
        engine = DataParallelEngine(model, info, layout, seed, precision)
    engine.document_boundary = document_boundary
    return engine


def clip_grad_norm(model: Decoder, max_norm: float, layout: Layout, shards: Shards) -> float:
    """Norm of the whole model's gradient, then clip to max_norm (0: measure only, as Megatron's
    clip_grad=0): slices are summed over the group that splits them (tp or ep; a DTensor's over the
    mesh dimensions it is sharded along, not those it is replicated over), and the stages' disjoint
    parameters over the pipeline group."""
    device = next(model.parameters()).device
    squares = {kind: torch.zeros((), device=device) for kind in ("tp", "ep", None)}
    dtensor_groups = {}  # kind -> the groups its squares are summed over
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        grad, kind = p.grad.detach(), shards.kind(name)
        if isinstance(grad, DTensor):  # FSDP's shard: of a tp slice too under fsdp x tp
            mesh = grad.device_mesh
            sharded = [i for i, placement in enumerate(grad.placements) if placement.is_shard()]
            tp_slice = kind == "tp"
            kind = tuple(mesh.mesh_dim_names[i] for i in sharded) + (("tp",) if tp_slice else ())
            dtensor_groups.setdefault(kind, [mesh.get_group(i) for i in sharded] + ([layout.tp_group] if tp_slice else []))
            grad = grad.to_local()
        squares[kind] = squares.get(kind, torch.zeros((), device=device)) + grad.float().pow(2).sum()
    local = (squares.pop(None) + _all_reduce(squares.pop("tp"), layout.tp_group)
             + _all_reduce(squares.pop("ep"), layout.ep_group))
    for kind, value in squares.items():
        for group in dtensor_groups[kind]:
            value = _all_reduce(value, group)
        local = local + value
    norm = math.sqrt(_all_reduce(local, layout.pp_group).item())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def moe_load_imbalance(model: Decoder, layout: Layout) -> float:
    """Mean max/mean expert load over every MoE layer of the model (1.0: none). A pipeline rank holds only
    its stages' layers, so the sums go over the pipeline group; call after sync_moe_load."""
    layers = model.moe_layers()
    device = layers[0].load_counts.device if layers else torch.device("cpu")
    totals = torch.tensor([sum(moe.load_imbalance() for moe in layers), len(layers)], dtype=torch.float64,
                          device=device)
    _all_reduce(totals, layout.pp_group)
    return (totals[0] / totals[1]).item() if totals[1] else 1.0


@torch.no_grad()
def sync_moe_load(model: Decoder, layout: Layout) -> None:
    """Sum expert load over the ranks that routed different tokens (dp, which counts the fsdp shards,
    and cp's and tp's sequence slices) so every rank nudges its balancing bias the same way."""
    for moe in model.moe_layers():
        _all_reduce(_all_reduce(moe.load_counts, layout.dp_cp_group), layout.tp_group)

