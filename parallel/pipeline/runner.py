"""Build this rank's pipeline stages and schedule, and run one step or one evaluation through them."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from model.decoder import Decoder
from parallel.pipeline.plan import PipelinePlan
from parallel.pipeline.stage import CachingPipelineStage, DepthCache, PipelineChunk

SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def keep_rank_parts(model: Decoder, plan: PipelinePlan, pp_rank: int) -> Decoder:
    """Delete, in place, every part of the decoder that no chunk of this rank runs. On a meta-device
    model, before materialising, this rank never allocates other stages' weights."""
    chunks = plan.chunks_of(pp_rank)
    owned = {str(b) for c in chunks for b in plan.chunk_blocks[c]}
    for key in [k for k in model.layers.keys() if k not in owned]:
        del model.layers[key]
    if 0 not in chunks:
        model.embed = None
    if plan.n_chunks - 1 not in chunks:
        model.final_res = model.norm = model.lm_head = None
    return model


def build_chunks(model: Decoder, plan: PipelinePlan, pp_rank: int,
                 message_dtype: torch.dtype | None = None) -> list[PipelineChunk]:
    """This rank's chunks of `model`, pruned to them in place (keep_rank_parts), sharing one block cache.
    The caller shards and materialises them (tp, ep, FSDP2) before PipelineRunner builds stages around them.
    `message_dtype`: what the stages send (the residual stream's dtype; None: the parameters')."""
    rank_model = keep_rank_parts(model, plan, pp_rank)
    dtype = message_dtype or next(rank_model.parameters()).dtype
    cache = DepthCache()
    return [PipelineChunk(rank_model, plan, c, cache, dtype) for c in plan.chunks_of(pp_rank)]


class PipelineRunner:
    def __init__(self, chunks: list[PipelineChunk], pp_group, device: torch.device, schedule: str,
                 microbatches: int, micro_batch: int, seq_len: int, loss_fn):
        """Stages around this rank's `chunks` (build_chunks), on `device`, and the schedule that runs them."""
        plan, dtype = chunks[0].plan, chunks[0].message_dtype
        self.plan, self.pp_group, self.chunks, self.cache = plan, pp_group, chunks, chunks[0].cache
        self.rank_model = chunks[0].decoder
        stages = [CachingPipelineStage(chunk, chunk.chunk, plan.n_chunks, device,
                                       input_args=self._example_inputs(chunk.chunk, micro_batch, seq_len, device, dtype),
                                       output_args=self._example_outputs(chunk.chunk, micro_batch, seq_len, device, dtype),
                                       group=pp_group)
                  for chunk in self.chunks]
        self.stages = stages
        cls = SCHEDULES[schedule]
        self.schedule = cls(stages if schedule in MULTI_STAGE else stages[0], n_microbatches=microbatches,
                            loss_fn=loss_fn)
        self.has_first = chunks[0].is_first
        self.has_last = chunks[-1].is_last

    def _message_count(self, chunk: int, incoming: bool) -> int:
        sender = chunk - 1 if incoming else chunk
        return self.plan.sent_vectors()[sender]

    def _example_inputs(self, chunk, micro_batch, seq_len, device, dtype):
        if chunk == 0:
            return (torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device),)
        shape = (micro_batch, seq_len, self.plan.cfg.d_model)
        return tuple(torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
                     for _ in range(self._message_count(chunk, incoming=True)))

    def _example_outputs(self, chunk, micro_batch, seq_len, device, dtype):
        # requires_grad on the examples: the engine's receive buffers copy it, and without it the
        # backward of the sending stage gets no output gradient.
        if chunk == self.plan.n_chunks - 1:
            return (torch.zeros(micro_batch, seq_len, self.plan.cfg.vocab_size, device=device, dtype=dtype,
                                requires_grad=True),)
        shape = (micro_batch, seq_len, self.plan.cfg.d_model)
        return tuple(torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
                     for _ in range(self._message_count(chunk, False)))

    def _run(self, run, inputs: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor | None,
             autocast) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the microbatches, known on every rank of the pipeline group; the last stage's
        logits of every microbatch on its rank, None on the others). Every stage's forwards run under
        `autocast()`. `starts` (B, T) bool document starts or None: the schedule splits keyword arguments into
        microbatches as it does the inputs and hands them to every stage."""
        losses: list[torch.Tensor] = []
        for stage in self.stages:
            stage.autocast = autocast
        self.cache.clear()
        try:
            masking = {} if starts is None else {"document_starts": starts}
            outputs = run(inputs if self.has_first else None, target=targets if self.has_last else None,
                          losses=losses, **masking)
        finally:
            self.cache.clear()  # memory must not grow across steps
        loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros((), device=inputs.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage's rank holds the losses
        return loss, outputs if self.has_last else None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor | None = None,
             autocast=contextlib.nullcontext) -> torch.Tensor:
        return self._run(self.schedule.step, inputs, targets, starts, autocast)[0]

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor | None = None,
             autocast=contextlib.nullcontext) -> torch.Tensor:
        return self._run(self.schedule.eval, inputs, targets, starts, autocast)[0]

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor, autocast=contextlib.nullcontext) -> torch.Tensor:
        """(B, T, vocab) logits of `inputs` (B, T) on every rank of the pipeline group: the last stage's rank
        sends them by a sum with the others' zeros, which adds nothing. The schedule's loss runs on dummy
        targets and is dropped."""
        _, outputs = self._run(self.schedule.eval, inputs, torch.zeros_like(inputs), None, autocast)
        if outputs is None:
            outputs = torch.zeros(*inputs.shape, self.plan.cfg.vocab_size, device=inputs.device,
                                  dtype=self.chunks[-1].message_dtype)
        dist.all_reduce(outputs, group=self.pp_group)
        return outputs

    def measured_bytes_per_token(self) -> dict[int, float]:
        """Bytes per token this rank's chunks actually sent in the last step, by sender chunk."""
        return {stage.stage_index: stage.sent_bytes_per_token for stage in self.stages
                if stage.sent_bytes_per_token is not None}
