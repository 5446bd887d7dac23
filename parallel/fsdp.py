"""FSDP2: parameters, gradients and optimizer state sharded over the fsdp ranks (torch `fully_shard`).

`apply_fsdp` shards the roots it is given: the whole Decoder (pp == 1) or each of this rank's pipeline
chunks (a stage's module). Inside a root the units are its transformer blocks, grouped so that no
AttnRes block straddles two units when the Block read is two-phase (its first sublayer batches the
depth queries of every sublayer of the block, so all of them must be unsharded together); the root
itself holds the rest (embedding, final read, norm, head). Parameters are DTensors sharded along dim 0
over the fsdp ranks of one replica (Replicate x Shard for HSDP, dp > 1); buffers (the MoE expert bias
and load counts) stay whole on every rank; parameters in `ignored` (the ep slices of the routed experts)
stay plain. Each backward reduce-scatters its gradients, averaged over every data rank (replicas and
shards); the optimizer then steps on this rank's shards only. Under pp the schedule holds gradient
reduction until the step's last microbatch and reduce-scatters once (torch.distributed.pipelining drives
FSDPModule stages itself), and parameters stay gathered between a microbatch's forward and backward
(reshard_after_forward=False, torchtitan's choice under pp: no second all-gather per microbatch).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model.layer import TransformerBlock
from model.residual import DepthGeometry
from parallel.compat import fsdp_hooks_reach_dataclass_outputs
from parallel.dims import Layout


def depth_block_units(blocks: list[TransformerBlock], geometry: DepthGeometry) -> list[list[TransformerBlock]]:
    """`blocks` (consecutive transformer blocks) grouped into FSDP units that never cut a depth block of the
    two-phase read (DepthGeometry.units)."""
    by_index = {block.index: block for block in blocks}
    return [[by_index[index] for index in unit] for unit in geometry.units(list(by_index))]


def mixed_precision(precision: torch.dtype) -> MixedPrecisionPolicy:
    """bf16: parameters gathered in bf16, gradients reduced in fp32 (the fp32 shards stay the master
    weights); fp32: everything fp32. gloo (torch 2.13) all-gathers, reduce-scatters and all-reduces bf16
    tensors as NCCL does, so the CPU path needs no casts around them. Inputs are not cast: the blocks pass
    a DepthState (a dataclass FSDP would copy, dropping the caller's diagnostics dict), and the bf16
    embedding already makes the residual stream bf16."""
    if precision != torch.bfloat16:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(roots: list[nn.Module], layout: Layout, precision: torch.dtype, ignored: set[nn.Parameter],
               geometry: DepthGeometry, reshard_after_forward: bool = True) -> None:
    """Shard each root (a module with `layers`: the Decoder or a pipeline chunk) and its depth-block units
    over `layout.fsdp_mesh`, in place; a chunk starts a new unit, since the two-phase read only batches the
    queries of the chunk's own sublayers."""
    fsdp_hooks_reach_dataclass_outputs()
    policy = mixed_precision(precision)
    shard = functools.partial(fully_shard, mesh=layout.fsdp_mesh, mp_policy=policy, ignored_params=ignored,
                              reshard_after_forward=reshard_after_forward)
    for root in roots:
        for unit in depth_block_units(list(root.layers.values()), geometry):
            shard(unit if len(unit) > 1 else unit[0])
        shard(root)
