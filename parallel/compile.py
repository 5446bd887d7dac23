"""Compiled training, `train.compile=true`: torch.compile per transformer block, as torchtitan does.

Each block is compiled on its own, not the whole model: the pipeline chunks call the same block
modules, and what lies between blocks (embedding, final read, loss, the pipeline's sends and
receives, DDP's hooks) stays eager. `apply_compile` replaces each block's `forward` (an instance
attribute, as parallel/activation_checkpoint.py does), so parameter names, checkpoints, DDP and the pipeline
see the same modules. It runs after the engine has sharded the model: a block compiles the tp slices
and ep dispatch it runs, their functional collectives included.

One graph per block, not one for all: unlike torchtitan's identical blocks, a block here guards on
its own position (its sublayer numbers, how many completed blocks the depth state holds, dense or
MoE, KDA or MLA), so dynamo's recompile limit for the shared `forward` code is raised to cover the
blocks of every model compiled in the process. Graphs break where a block hands values to the host
(diagnostics): the parts around a break are compiled, the break runs eager. The MoE expert loop, which
needs its per-expert counts on the host, runs inside the graph as one opaque op (model/moe.py).

Only training forwards are compiled: evaluation (no autograd) and decoding (a cache) run the eager
block, which keeps their graphs out of the compile time and the guards.

Activation checkpointing: with `full`, the checkpoint wrapper stays outside and calls the compiled
forward, once in forward and again to recompute in backward (the compiled graph's saved tensors go
through the checkpoint's saved-tensor hooks like eager ones). `selective` picks the ops to save from
eager dispatch, which a compiled graph does not go through: trainer/config.py refuses that pair.
"""
from __future__ import annotations

import torch
from torch import nn

from model.residual import DepthState
from parallel.activation_checkpoint import _CheckpointedBlock


def apply_compile(model: nn.Module) -> None:
    """Compile the training forward of every transformer block present in `model` (a Decoder or a
    pipeline rank's part), inside its `full` activation checkpointing if it has one."""
    blocks = list(model.layers.values())
    # Every block compiled anywhere in the process shares TransformerBlock.forward's code, so each call
    # adds room for its blocks: a graph per block, and one more on diagnostics steps (their dict and host
    # reads). The code after a graph break is a resume function with its own count, no larger.
    torch._dynamo.config.recompile_limit += 2 * len(blocks)
    for block in blocks:
        checkpointed = block.__dict__.get("forward")
        if checkpointed is None:
            block.forward = _CompiledBlock(block.forward)
        elif isinstance(checkpointed, _CheckpointedBlock) and checkpointed.mode == "full":
            checkpointed.forward = _CompiledBlock(checkpointed.forward)
        else:
            raise ValueError(f"block {block.index}: torch.compile does not compose with its forward wrapper "
                             f"{type(checkpointed).__name__} (mode {getattr(checkpointed, 'mode', None)!r})")


class _CompiledBlock:
    """A block's forward, compiled where it trains."""

    def __init__(self, forward):
        self.eager = forward
        self.compiled = torch.compile(forward)

    def __call__(self, state: DepthState, mixer: nn.Module, cache=None, document_starts=None) -> DepthState:
        if cache is not None or not torch.is_grad_enabled():
            return self.eager(state, mixer, cache, document_starts)
        if document_starts is None:  # the call without masking keeps the graph it always had
            return self.compiled(state, mixer)
        return self.compiled(state, mixer, None, document_starts)
