"""An engine runs one step's forward and backward over this rank's micro-batches, totals the validation
loss, and clips gradients, whatever the layout: `DataParallelEngine` when pp == 1 (DDP over the data ranks, or FSDP2's own
reduce-scatter when fsdp > 1), `PipelineEngine` when pp > 1 (the pipeline schedule with the cross-stage block
cache). `Engine` is what the trainer may ask of either, and both subclass it for its one `clip_grad_norm`;
`build_engine` picks one.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from model.decoder import Decoder
from model.document_masking import document_starts
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.compat import DDP_NO_FORWARD_BUFFER_SYNC
from parallel.dims import Degrees, DistInfo, Layout
from parallel.expert import expert_param_names
from parallel.float8 import convert_to_float8
from parallel.gradients import all_reduce, clip_grad_norm, finish_gradients
from parallel.parallelize import materialise_parallel
from parallel.tensor import local_sequence


class Engine(Protocol):
    """What the trainer may ask of an engine. `model` is this rank's Decoder (all of it, or the parts its
    pipeline chunks run, with its tp/ep slices and FSDP's DTensor shards): the optimizer and checkpoints use
    it, and its parameter names are the single-process names in every layout; a tp/ep slice of a larger
    parameter says so itself (parallel/placement.py). `document_boundary`: the end-of-text id with document masking, None
    without."""

    model: Decoder
    layout: Layout
    document_boundary: int | None

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        """The step's mean loss over all tokens of all ranks; the gradients are complete and averaged."""

    def loss_totals(self, batches, autocast) -> tuple[float, int]:
        """(sum of loss * tokens, tokens) over the batches, totalled over the ranks that split them."""

    def logits(self, inputs: torch.Tensor, autocast) -> torch.Tensor:
        """(B, T, vocab) logits of `inputs` (B, T) on every rank, through this layout's own forward: the data
        ranks split the rows, tp and cp the sequence, and the pieces are all-gathered. Collective: every rank
        passes the same inputs, at most `eval_rows` of them. No rank holds more of the model than it trains with."""

    @property
    def eval_rows(self) -> int:
        """The rows one `logits` call runs on the ranks together (their micro-batches side by side)."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The whole model's gradient norm, after clipping it to max_norm (0: measure only): the same in
        every layout, each parameter's slices and shards found from its placement."""
        return clip_grad_norm(self.model, max_norm, self.layout)

    def comm_report(self) -> dict | None:
        """The pipeline's planned and measured message sizes; None without pp."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def rank_share(items: list, layout: Layout, lockstep: bool):
    """This rank's share of `items` (every data_ranks-th, from data_rank) as (item, counted) pairs. In lockstep
    every data rank runs the same number of forwards, because a forward talks to the other data ranks
    (FSDP gathers parameters, expert parallelism sends tokens to the ep peers): a rank whose share is one
    short runs its last item again and does not count it."""
    data_ranks, rank = layout.data_ranks, layout.data_rank
    if not lockstep:
        return [(items[i], True) for i in range(rank, len(items), data_ranks)]
    rounds = -(-len(items) // data_ranks)
    return [(items[min(index, len(items) - 1)], index < len(items))
            for index in range(rank, rounds * data_ranks, data_ranks)]


def padded(inputs: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """`inputs` (B, T) right-padded to (rows, width) by repeating its last row and column: a causal model's logits
    of the real tokens do not depend on the padding (trainer/lm_eval_adapter.py), and repeated ids are valid."""
    inputs = torch.cat([inputs, inputs[:, -1:].expand(-1, width - inputs.shape[1])], dim=1)  # (B, width)
    return torch.cat([inputs, inputs[-1:].expand(rows - inputs.shape[0], -1)])  # (rows, width)


def gather_cat(piece: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The pieces of `group`'s ranks, in rank order, concatenated along `dim`."""
    if group is None or dist.get_world_size(group) == 1:
        return piece
    pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, piece.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def whole_logits(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Every rank's (b, T/(cp*tp), vocab) logits -> the whole (b * data_ranks, T, vocab) on every rank: the tp
    slices make their cp slice, the cp slices the sequence (local_sequence's order), the data ranks the rows."""
    sequence = gather_cat(gather_cat(local, layout.tp_group, dim=1), layout.cp_group, dim=1)  # (b, T, vocab)
    return gather_cat(sequence, layout.data_group, dim=0)


def eval_width(model_cfg, degrees: Degrees, width: int, limit: int) -> int:
    """The least width >= `width` (and <= `limit`, the trained sequence length, which always fits) that these
    degrees can split: what Degrees.problems accepts."""
    step = degrees.sequence_ranks
    for candidate in range(-(-width // step) * step, limit, step):
        if not degrees.problems(model_cfg, candidate):
            return candidate
    return limit


def cp_document_starts(inputs: torch.Tensor, boundary: int | None, layout: Layout) -> torch.Tensor | None:
    """(B, T/cp) document starts of this rank's cp slice, found on the whole sequence (a slice's first token
    may start a document): the token mixers see the cp slice, whole under tp, not this rank's tp slice.
    None without document masking (`boundary` None)."""
    if boundary is None:
        return None
    starts = document_starts(inputs, boundary)  # (B, T)
    return starts.chunk(layout.cp, dim=1)[layout.cp_rank]  # (B, T/cp)


class DataParallelEngine(Engine):
    """pp == 1. fsdp == 1: DDP over the data ranks (none with one), on tp/ep slices. fsdp > 1: the
    fully_shard-ed Decoder, whose parameters (and so its optimizer state and checkpoint entries) are
    DTensors; FSDP's reduce-scatter averages gradients over the data ranks, and under tp it shards each
    rank's tp slices over the fsdp ranks of its tp index. `wrapped` is what runs the forward;
    `grads_dp_averaged`: the backward averages gradients over the data ranks itself; `lockstep`: a
    forward talks to other data ranks (FSDP's all-gathers, the experts' all-to-all), so evaluation keeps
    every rank running; `document_boundary`: the end-of-text id with document masking (build_engine),
    None without."""

    document_boundary: int | None = None

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, seed: int, precision: torch.dtype,
                 micro_batch: int, seq_len: int):
        self.info, self.layout, self.micro_batch, self.seq_len = info, layout, micro_batch, seq_len
        materialise_parallel(model, info, layout, seed, precision)
        self.model = self.wrapped = model
        self.lockstep = layout.ep > 1 or layout.fsdp > 1
        if layout.dp_cp > 1 and layout.fsdp == 1:
            # Experts are averaged over their own ranks (finish_gradients). Buffers need no sync per
            # forward: the MoE bias moves the same way everywhere, and syncing would overwrite the
            # per-rank expert load counts between micro-batches.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
            # device_ids=None on CUDA too (a single-device module: DDP takes its device, and the batches
            # are already there), so the CPU tests run the same construction as a GPU job.
            self.wrapped = DistributedDataParallel(model, device_ids=None, process_group=layout.dp_cp_group,
                                                   **DDP_NO_FORWARD_BUFFER_SYNC)
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
        finish_gradients(self.model, self.layout, dp_averaged=self.grads_dp_averaged)
        total = all_reduce(total / (len(micro_batches) * tp), self.layout.tp_group)
        return all_reduce(total, self.layout.dp_cp_group) / self.layout.dp_cp

    @torch.no_grad()
    def loss_totals(self, batches, autocast) -> tuple[float, int]:
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
        totals = all_reduce(all_reduce(totals, self.layout.tp_group), self.layout.cp_group)
        return totals[0].item(), int(totals[1].item())

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor, autocast) -> torch.Tensor:
        rows, width = inputs.shape
        wide = eval_width(self.model.cfg, self.layout.degrees, width, self.seq_len)
        share = padded(inputs, self.eval_rows, wide).chunk(self.layout.data_ranks)[self.layout.data_rank]
        self.model.eval()
        with autocast():
            local = self.model(local_sequence(share, self.layout))  # (micro_batch, wide/(cp*tp), vocab)
        self.model.train()
        return whole_logits(local, self.layout)[:rows, :width]

    @property
    def eval_rows(self) -> int:
        return self.micro_batch * self.layout.data_ranks

    def comm_report(self) -> dict | None:
        return None


class PipelineEngine(Engine):
    """pp > 1: this rank's chunks run by the schedule (parallel/pipeline/runner.py). `document_boundary`: as
    DataParallelEngine's; every stage gets its microbatch's starts from the schedule, which hands the whole
    batch's keyword arguments to every rank."""

    document_boundary: int | None = None

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, parallel_cfg, micro_batch: int,
                 seq_len: int, microbatches: int, seed: int, precision: torch.dtype):
        from parallel.pipeline.plan import PipelinePlan
        from parallel.pipeline.runner import PipelineRunner, build_chunks

        self.info, self.layout, self.micro_batch, self.seq_len = info, layout, micro_batch, seq_len
        self.plan = PipelinePlan(model.cfg, layout.pp, parallel_cfg.vp, parallel_cfg.pp_cache)
        self.microbatches = microbatches
        # The stages' messages travel in the residual stream's dtype, the embedding's: FSDP's gathered
        # parameter dtype, else the parameters' own (autocast leaves the embedding in fp32).
        stream_dtype = precision if layout.fsdp > 1 else next(model.parameters()).dtype
        # Pruned to this rank's chunks while still on meta: it never allocates the other stages' weights.
        chunks = build_chunks(model, self.plan, layout.pp_rank, stream_dtype)
        materialise_parallel(model, info, layout, seed, precision, fsdp_roots=chunks)
        # Under cp and tp the stages pass sequence slices (B, T/(cp*tp), d); 1/tp makes the tp ranks' losses sum
        # to their cp slice's mean, and the cp slices' means are averaged with the data ranks'.
        tp = layout.tp
        self.runner = PipelineRunner(chunks, layout.pp_group, info.device, parallel_cfg.schedule, microbatches,
                                     micro_batch, seq_len // layout.degrees.sequence_ranks,
                                     loss_fn=lambda logits, targets: cross_entropy(logits, targets) / tp)
        self.model = model
        for chunk in chunks:  # the tp ranks' balance losses sum to the whole one, as the LM loss's
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
        finish_gradients(self.model, self.layout, dp_averaged=self.layout.fsdp > 1)
        return all_reduce(all_reduce(loss, self.layout.tp_group), self.layout.dp_cp_group) / self.layout.dp_cp

    @torch.no_grad()
    def loss_totals(self, batches, autocast) -> tuple[float, int]:
        """Groups `microbatches` batches into one pipeline evaluation; incomplete groups are dropped."""
        batches = [b for b in batches if b[0].shape[0] == batches[0][0].shape[0]] if batches else []
        groups = [batches[i:i + self.microbatches] for i in range(0, len(batches) - self.microbatches + 1,
                                                                   self.microbatches)]
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for group, counted in rank_share(groups, self.layout, self.lockstep):
            loss = all_reduce(self.runner.eval(*self._local(group), autocast), self.layout.tp_group)
            loss = all_reduce(loss, self.layout.cp_group) / self.layout.cp
            if counted:
                count = sum(t.numel() for _, t in group)
                loss_sum += loss.item() * count
                tokens += count
        self.model.train()
        return loss_sum, tokens

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor, autocast) -> torch.Tensor:
        """The stages were built for (micro_batch, seq_len) microbatches, so every call runs a whole pipeline
        evaluation at that shape."""
        rows, width = inputs.shape
        share = padded(inputs, self.eval_rows, self.seq_len).chunk(self.layout.data_ranks)[self.layout.data_rank]
        share = local_sequence(share, self.layout)  # (microbatches * micro_batch, seq_len/(cp*tp))
        self.model.eval()
        local = self.runner.logits(share, autocast)
        self.model.train()
        return whole_logits(local, self.layout)[:rows, :width]

    @property
    def eval_rows(self) -> int:
        return self.microbatches * self.micro_batch * self.layout.data_ranks

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
                 precision: torch.dtype = torch.float32, document_boundary: int | None = None,
                 float8: bool = False) -> Engine:
    """`model` may be on the meta device (build_model(cfg, device="meta")): each engine allocates and
    initialises only what this rank keeps, from `seed` (model.init.materialise); parts already
    materialised keep their values. `precision` (parallel.dims.resolve_precision) sets FSDP2's gathered
    parameter dtype and the pipeline's message dtype; the forward's autocast is the caller's.
    `document_boundary`: the end-of-text token id to mask documents at (model/document_masking.py), or None.
    `float8`: the token mixers' and MLPs' Linear layers run float8 matmuls (parallel/float8.py), emulated off CUDA."""
    if float8:  # first: checkpointing, tp and FSDP then wrap the float8 modules
        convert_to_float8(model, tp=layout.tp, emulate=info.device.type != "cuda")
    apply_activation_checkpointing(model, activation_checkpointing)  # before any sharding wraps the blocks
    if layout.pp > 1:
        engine = PipelineEngine(model, info, layout, parallel_cfg, micro_batch, seq_len, microbatches, seed, precision)
    else:
        engine = DataParallelEngine(model, info, layout, seed, precision, micro_batch, seq_len)
    engine.document_boundary = document_boundary
    return engine
