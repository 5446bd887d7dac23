"""Activation checkpointing per transformer block: `train.activation_checkpointing = none | full | selective`.

The model does not know about it: `apply_activation_checkpointing` replaces each block's `forward`
(an instance attribute, so parameter names, the pipeline chunks and DDP see the same modules) with one
that runs the block under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`.

- full: a block keeps only its inputs for backward; backward recomputes the whole block.
- selective: a block keeps the outputs of the ops in SAVED_OPS and recomputes everything else
  (norms, activations, depth reads, elementwise ops, MoE routing and sorting). Saved: its matrix
  products, aten.mm (every nn.Linear and x @ W on 2-D rows: projections, routers, experts) and
  aten.addmm, aten.bmm (batched matmul and einsum: the KDA chunk products, MLA attention on the
  math path, mHC stream mixing); the scaled-dot-product attention kernels (MLA); and the functional
  collectives of tp (sequence all-gather, reduce-scatter) and ep (token all-to-all), so their
  communication is not repeated in backward.

Works under DDP, the pipeline engine (its chunks call the same block modules), tp and ep: the
recomputation runs the same ops, collectives included, in the same order on every rank.

The functional boundary. A block's forward mutates the DepthState it is given (the mixer's write
replaces `partial`, appends completed blocks; the reads append key norms to `block_inv_rms` and
leave batched phase-1 reads for later sublayers in `phase1`). A recomputation must neither append
twice nor start from a state the forward already advanced, so the checkpointed function is pure in
tensors: it takes the state's tensors (`DepthState.carry`: partial, blocks, block_inv_rms, phase1
entries) as inputs, rebuilds a fresh DepthState from them (`DepthState.from_carry`), runs the block,
and returns only what the block produced, carried the same way (the new partial, the appended blocks
and key norms, the phase-1 entries it added). The caller's
DepthState is then updated from those outputs, once. mHC's `pending_write` lives only between a read
and its write inside one block, so it is None at every block boundary (`carry` checks).

Side effects a recomputation must not repeat, handled by `_Recompute` (entered only around it):
- diagnostics: the recomputation records into a scratch dict (the same ops run, so the recomputed
  tensors line up with the saved ones; nothing reaches the caller's dict twice);
- MoE: `load_counts` is incremented into a scratch copy and `aux_loss` is restored, so the expert
  load equals `none`'s and the loss the trainer already built keeps its tensor.
Blocks run with a decoding cache (inference) or without autograd run unchanged.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from model.moe import MoE
from model.residual import DepthState

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
SAVED_OPS = frozenset((
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # tp's sequence gather / scatter and ep's token dispatch: saving them keeps their communication
    # out of the recomputation (ep's small all-to-all of expert counts still runs again).
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
))


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every transformer block present in `model` (a Decoder or a pipeline rank's part)."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r} is not valid; allowed: {' | '.join(MODES)}")
    for block in model.layers.values():
        block.__dict__.pop("forward", None)  # applied again: the new mode replaces the old, never nests
        if mode != "none":
            block.forward = _CheckpointedBlock(block, block.forward, mode)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Recompute:
    """Entered around one block's recomputation in backward: undoes the forward's side effects."""

    def __init__(self, block: nn.Module):
        self.moes = [m for m in block.modules() if isinstance(m, MoE)]
        self.inner = contextlib.nullcontext()  # selective: the SAC recompute mode
        self.active = False

    def __enter__(self):
        self.active = True
        self.kept = [(moe, moe.load_counts, moe.aux_loss) for moe in self.moes]
        for moe in self.moes:
            moe.load_counts = moe.load_counts.clone()  # the recomputation counts its tokens here
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            for moe, counts, aux_loss in self.kept:
                moe.load_counts, moe.aux_loss = counts, aux_loss
            self.active = False


class _CheckpointedBlock:
    """A transformer block's forward run under checkpointing across a functional boundary."""

    def __init__(self, block: nn.Module, forward, mode: str):
        self.block, self.forward, self.mode = block, forward, mode

    def __call__(self, state: DepthState, mixer, cache=None, document_starts=None) -> DepthState:
        if cache is not None or not torch.is_grad_enabled():
            return self.forward(state, mixer, cache, document_starts)
        inputs, in_layout = state.carry()  # refuses a pending mHC write at the boundary
        # Read now: `state` has moved on by the time backward recomputes.
        sublayer, reads, diagnostics = state.next_sublayer, state.reads, state.diagnostics
        recompute = _Recompute(self.block)
        produced = {}  # filled by the forward run only: the output layout and the phase-1 keys left

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            recorded = {} if recompute.active and diagnostics is not None else diagnostics
            given = DepthState.from_carry(tensors, in_layout, next_sublayer=sublayer, reads=reads,
                                          diagnostics=recorded)
            received = dict(given.phase1)
            inner = self.forward(given, mixer, None, document_starts)
            # Only what the block made leaves the boundary: phase-1 entries it received and did not
            # consume stay outside, unchanged.
            made = DepthState(blocks=inner.blocks[in_layout.n_blocks:], partial=inner.partial,
                              block_inv_rms=inner.block_inv_rms[in_layout.n_inv_rms:],
                              phase1={k: v for k, v in inner.phase1.items() if v is not received.get(k)})
            outputs, out_layout = made.carry()
            if not recompute.active:
                produced.update(layout=out_layout, phase1=sorted(inner.phase1), next_sublayer=inner.next_sublayer)
            return outputs

        outputs = checkpoint(run, *inputs, use_reentrant=False, context_fn=self._contexts(recompute))
        made = DepthState.from_carry(outputs, produced["layout"])
        state.blocks = list(state.blocks) + made.blocks
        state.partial = made.partial
        state.block_inv_rms = list(state.block_inv_rms) + made.block_inv_rms
        state.phase1 = {k: made.phase1[k] if k in made.phase1 else state.phase1[k] for k in produced["phase1"]}
        state.next_sublayer = produced["next_sublayer"]
        return state

    def _contexts(self, recompute: _Recompute):
        if self.mode == "full":
            return lambda: (contextlib.nullcontext(), recompute)

        def selective():
            forward_mode, recompute_mode = create_selective_checkpoint_contexts(_save_matmuls)
            recompute.inner = recompute_mode
            return forward_mode, recompute

        return selective
