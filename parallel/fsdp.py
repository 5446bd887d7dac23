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
from parallel.dims import Layout


def read_block_units(blocks: list[TransformerBlock], mixer) -> list[list[TransformerBlock]]:
    """`blocks` (consecutive) cut where an AttnRes block of the two-phase read ends, and at the end."""
    sublayers_per_read_block = mixer.block_size if getattr(mixer, "two_phase", False) else 1
    units, unit = [], []
    for block in blocks:
        unit.append(block)
        if (block.attn_sublayer + 1) % sublayers_per_read_block == 0:
            units.append(unit)
            unit = []
    return units + ([unit] if unit else [])


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
               reshard_after_forward: bool = True) -> None:
    """Shard each root (a module with `layers` and `mixer`: the Decoder or a pipeline chunk) and its
    read-block units over `layout.fsdp_mesh`, in place; a chunk starts a new unit, since the two-phase
    read only batches the queries of the chunk's own sublayers."""
    policy = mixed_precision(precision)
    shard = functools.partial(fully_shard, mesh=layout.fsdp_mesh, mp_policy=policy, ignored_params=ignored,
                              reshard_after_forward=reshard_after_forward)
    for root in roots:
        for unit in read_block_units(list(root.layers.values()), root.mixer):
            shard(unit if len(unit) > 1 else unit[0])
        shard(root)
