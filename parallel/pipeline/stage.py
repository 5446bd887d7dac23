"""Pipeline chunks of the decoder, the stage message, and the cross-stage block cache.

A chunk is the rank's copy of the decoder restricted to a range of transformer blocks (plus the
embedding on chunk 0 and the final read, norm and head on the last chunk). Parameter names are the
single-process names, so checkpoints move between layouts.

Stage message (static per transition, see plan.Transition; `DepthState.carry` in
`plan.message_layout`'s order): (partial sum if a depth block straddles the cut, then depth blocks
[first_block, last_block)); the baseline sends its running sum. With the cache, the
rank running chunk k already holds blocks [0, held) from its chunk k-P for the same microbatch:
- blocks chunk k-P received are the engine's receive buffers (leaves): chunk k reuses the same
  tensors, so chunk k's backward accumulates into their .grad, which the engine reads after chunk
  k-P's backward and sends upstream;
- blocks chunk k-P produced are cached as detached leaves; the copy sent onward passes through
  AddCachedGrad, whose backward adds the leaf's .grad (filled by chunk k's backward, which always runs
  earlier) to the gradient from downstream.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from model.decoder import Decoder
from model.moe import MoE
from model.residual import DepthState
from parallel.pipeline.plan import PipelinePlan


class AddCachedGrad(torch.autograd.Function):
    """Identity forward; backward adds the gradient a later chunk left on the cached leaf."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return block.view_as(block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cached = ctx.leaf.grad
        return (grad if cached is None else grad + cached), None


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `carrier`; backward also sends `scale` as the gradient of `aux_loss`. A stage's MoE
    balance loss cannot join the last stage's loss, so it rides on the stage's output: whenever the
    schedule runs this microbatch's backward through the stage, the loss's gradient enters there (as
    Megatron's MoEAuxLossAutoScaler does)."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class DepthCache:
    """Blocks a rank keeps between its virtual stages, keyed by (microbatch, chunk); cleared every step."""

    def __init__(self):
        self.blocks: dict[tuple[int, int], list[torch.Tensor]] = {}

    def clear(self) -> None:
        self.blocks.clear()


class PipelineChunk(nn.Module):
    def __init__(self, rank_model: Decoder, plan: PipelinePlan, chunk: int, cache: DepthCache,
                 message_dtype: torch.dtype):
        super().__init__()
        self.plan, self.chunk, self.cache, self.message_dtype = plan, chunk, cache, message_dtype
        # The balance loss's weight in a microbatch's backward: 1 (the schedule then divides every
        # gradient by the microbatch count, as it does the LM loss's); the engine sets 1/tp under tp.
        self.aux_loss_scale = 1.0
        self.is_first, self.is_last = chunk == 0, chunk == plan.n_chunks - 1
        self.mixer = rank_model.mixer
        # The chunk's parameters are registered here (the stage module); the forward is the Decoder's own,
        # over this chunk's blocks, so the rank model is kept without registering it a second time.
        self.__dict__["decoder"] = rank_model
        self.embed = rank_model.embed if self.is_first else None
        self.layers = nn.ModuleDict({str(i): rank_model.layers[str(i)] for i in plan.chunk_blocks[chunk]})
        if self.is_last:
            self.final_res, self.norm, self.lm_head = rank_model.final_res, rank_model.norm, rank_model.lm_head

    def forward(self, *message: torch.Tensor, microbatch: int,
                document_starts: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`microbatch` keys the rank's block cache between its virtual stages (CachingPipelineStage passes it);
        `document_starts` (B, T) bool: the microbatch's document starts (the schedule hands them to every stage)."""
        state = self.decoder.forward_layers(self._unpack(message, microbatch), blocks=self.layers.values(),
                                            document_starts=document_starts)
        # The last stage's logits in the dtype its stage declares (runner.py's output_args): under autocast they
        # are bf16, which torch before 2.13 refuses against the declared dtype (2.11 checked).
        output = self.decoder.read_out(state).to(self.message_dtype) if self.is_last else self._pack(state, microbatch)
        return self._with_aux_loss(output)

    def _with_aux_loss(self, output):
        """The chunk's MoE balance losses, attached to its output (AttachAuxLoss) at `aux_loss_scale`."""
        losses = [block.mlp.aux_loss for block in self.layers.values()
                  if isinstance(block.mlp, MoE) and block.mlp.aux_loss.requires_grad]
        if not losses or not torch.is_grad_enabled():
            return output
        aux = torch.stack(losses).sum()
        if self.is_last:
            return AttachAuxLoss.apply(output, aux, self.aux_loss_scale)
        return (AttachAuxLoss.apply(output[0], aux, self.aux_loss_scale), *output[1:])

    def _unpack(self, message: tuple[torch.Tensor, ...], microbatch: int) -> DepthState:
        if self.is_first:
            return self.mixer.start(self.embed(message[0]))
        if self.plan.streams > 1:  # mHC's m streams arrive as m tensors: (m, B, T, d) again
            message = (torch.stack(message[:self.plan.streams]), *message[self.plan.streams:])
        state = DepthState.from_carry(message, self.plan.message_layout(self.chunk - 1),
                                      next_sublayer=self.plan.first_sublayer(self.chunk))
        if self.plan.attnres and self.plan.transition(self.chunk - 1).held_by_receiver:
            state.blocks = self.cache.blocks[(microbatch, self.chunk - self.plan.pp)] + state.blocks
        return state

    def _pack(self, state: DepthState, microbatch: int) -> tuple[torch.Tensor, ...]:
        if not self.plan.attnres:  # the running sum (mHC: its m streams), then x0's v_0
            message, _ = DepthState(blocks=state.blocks, partial=state.partial).carry()
            if self.plan.streams > 1:  # the receive buffers are (B, T, d): m tensors
                message = (*message[0].unbind(0), *message[1:])
            return self._typed(message)
        outgoing = self.plan.transition(self.chunk)
        blocks = list(state.blocks)
        if self.plan.caches_after(self.chunk):
            produced_from = 0 if self.is_first else self.plan.blocks_done(self.chunk - 1)
            kept = list(blocks)
            for i in range(produced_from, len(blocks)):
                # A block made here: the cache gets a leaf, the message a copy that returns its gradient.
                kept[i] = blocks[i].detach().requires_grad_(blocks[i].requires_grad)
                blocks[i] = AddCachedGrad.apply(blocks[i], kept[i]) if blocks[i].requires_grad else blocks[i]
            self.cache.blocks[(microbatch, self.chunk)] = kept
        sent = DepthState(blocks=blocks[outgoing.first_block:outgoing.last_block],
                          partial=state.partial if outgoing.sends_partial else None)
        message, _ = sent.carry()
        return self._typed(message)

    def _typed(self, message: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The message in the receive buffers' dtype, the stream's (fp32; bf16 with FSDP2's bf16 parameters):
        a payload of another dtype would arrive as garbage. Under autocast a block made of sublayer outputs
        (every block of Full, Block's partial sums) is bf16 while b_0 and the baseline's sum are fp32, and
        fp32 holds the bf16 values exactly."""
        return tuple(t.to(self.message_dtype).contiguous() for t in message)  # mHC's start expands one tensor


class CachingPipelineStage(PipelineStage):
    """A PipelineStage that passes its chunk the microbatch it is running (the cache key), runs its
    forwards (only) under `autocast` and measures the bytes per token of the message it sends."""

    sent_bytes_per_token: float | None = None
    # Set per step by the runner. The schedule interleaves forwards and backwards, and a backward run under
    # CPU autocast (the engine runs CPU backwards on the calling thread) would recast its matmuls, e.g.
    # those of the fp32 router, to bf16: one process runs its backwards outside autocast.
    autocast = contextlib.nullcontext

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        with self.autocast():
            output = super().forward_one_chunk(fwd_chunk_id, args, {**(kwargs or {}), "microbatch": fwd_chunk_id},
                                               save_forward_output)
        if not self.is_last:
            tensors = output if isinstance(output, tuple) else (output,)
            tokens = tensors[0].shape[0] * tensors[0].shape[1]
            self.sent_bytes_per_token = sum(t.numel() * t.element_size() for t in tensors) / tokens
        return output
