"""FSDP2: parameters, gradients and optimizer state sharded over the fsdp ranks (torch `fully_shard`).

Units: the transformer blocks, grouped so that no AttnRes block straddles two units when the Block
read is two-phase (its first sublayer batches the depth queries of every sublayer of the block, so all
of them must be unsharded together), then the root (embedding, final read, norm, head). Parameters
are DTensors sharded along dim 0 over the fsdp ranks of one replica (Replicate x Shard for HSDP,
dp > 1); buffers (the MoE expert bias and load counts) stay whole on every rank. Each micro-batch's
backward reduce-scatters its gradients (averaged over every data rank: replicas and shards); the
optimizer then steps on this rank's shards only. Under pp each pipeline chunk is sharded instead
(shard_pipeline_chunks: one reduce-scatter per step); under ep the experts' ep slices stay out of it.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model.decoder import Decoder
from model.layer import TransformerBlock
from parallel.dims import DistInfo, Layout
from parallel.expert import expert_param_names
from parallel.fill import fill_shards
from parallel.parallelize import DataParallelEngine, shard_model


def shard_units(model: Decoder) -> list[list[TransformerBlock]]:
    """Consecutive transformer blocks, cut only where an AttnRes block ends if the two-phase read is on
    (block_size 1 or 2 sublayers: every transformer block is a unit; 4: pairs; 3: triples)."""
    return read_block_units(list(model.layers.values()), model.mixer)


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


def apply_fsdp(model: Decoder, layout: Layout, precision: torch.dtype, ignored: set[nn.Parameter]) -> Decoder:
    """`ignored`: parameters FSDP leaves as they are (the ep slices of the routed experts)."""
    policy = mixed_precision(precision)
    for unit in shard_units(model):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=layout.fsdp_mesh, mp_policy=policy,
                    ignored_params=ignored)
    return fully_shard(model, mesh=layout.fsdp_mesh, mp_policy=policy, ignored_params=ignored)


def shard_pipeline_chunks(chunks: list[nn.Module], rank_model: Decoder, template: Decoder | None, layout: Layout,
                          device: torch.device, precision: torch.dtype, seed: int) -> None:
    """FSDP2 under pp: each of this rank's pipeline chunks (a stage's module) becomes an FSDP root over
    the fsdp ranks of its stage, with its read-block units of transformer blocks inside (a chunk starts a
    new unit: the two-phase read only batches the queries of the chunk's own sublayers). The pipeline
    schedule then holds gradient reduction until the step's last microbatch and reduce-scatters once
    (torch.distributed.pipelining drives FSDPModule stages itself). Parameters stay gathered between a
    microbatch's forward and backward (reshard_after_forward=False, torchtitan's choice under pp: no
    second all-gather per microbatch). `rank_model` (on meta, holding only this rank's parts) is then
    allocated and filled from `template`, its unsharded meta copy, shard by shard; with no template
    (a model built whole) it is sharded as it is."""
    policy = mixed_precision(precision)
    if template is None:
        rank_model.to(device)
    for chunk in chunks:
        for unit in read_block_units(list(chunk.layers.values()), chunk.mixer):
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=layout.fsdp_mesh, mp_policy=policy,
                        reshard_after_forward=False)
        fully_shard(chunk, mesh=layout.fsdp_mesh, mp_policy=policy, reshard_after_forward=False)
    if template is not None:
        rank_model.to_empty(device=device)
        fill_shards(rank_model, template, seed)


class FullyShardedEngine(DataParallelEngine):
    """pp == 1 (PipelineEngine shards its chunks itself). `model` is the fully_shard-ed Decoder, whose
    parameters (and so its optimizer state and checkpoint entries) are DTensors. Under tp FSDP shards
    each rank's tp slices over the fsdp ranks of its tp index (the tp peers run their sequence slices,
    as under DDP). Under ep the routed experts are ep slices left out of fully_shard (plain tensors,
    whole on the fsdp ranks of one ep index, their gradients averaged over those ranks after the step
    as under DDP); every other parameter is sharded over fsdp and replicated over all dp ranks (HSDP).
    A model on the meta device is sliced and sharded first and then filled shard by shard
    (fill_shards); a built one is sharded as it is."""

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, seed: int, precision: torch.dtype):
        self.info, self.layout = info, layout
        on_meta = any(p.is_meta for p in model.parameters())
        template = copy.deepcopy(model) if on_meta else None  # meta: costs nothing
        # The tp/ep slices (checkpoints place them on the mesh); DCP handles FSDP's DTensors itself.
        self.shards = shard_model(model if on_meta else model.to(info.device), layout)
        experts = set(expert_param_names(self.shards))
        ignored = {p for name, p in model.named_parameters() if name in experts}
        self.model = apply_fsdp(model, layout, precision, ignored)
        if template is not None:
            self.model.to_empty(device=info.device)
            fill_shards(self.model, template, seed, slice_of=functools.partial(self.shards.local_slice, layout=layout))
        # Steps and evaluation are DataParallelEngine's: FSDP's reduce-scatter averages over the data
        # ranks, and every forward all-gathers from the other shards.
        self.wrapped, self.grads_dp_averaged, self.lockstep = self.model, True, True

