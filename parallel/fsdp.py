"""FSDP2: parameters, gradients and optimizer state sharded over the fsdp ranks (torch `fully_shard`).

Units: the transformer blocks, grouped so that no AttnRes block straddles two units when the Block
read is two-phase (its first sublayer batches the depth queries of every sublayer of the block, so all
of them must be unsharded together), then the root (embedding, final read, norm, head). Parameters
are DTensors sharded along dim 0 over the fsdp ranks of one replica (Replicate x Shard for HSDP,
dp > 1); buffers (the MoE expert bias and load counts) stay whole on every rank. Each micro-batch's
backward reduce-scatters its gradients (averaged over every data rank: replicas and shards); the
optimizer then steps on this rank's shards only.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from model.decoder import Decoder
from model.init import materialise
from model.layer import TransformerBlock
from parallel.dims import DistInfo, Layout
from parallel.parallelize import _all_reduce, clip_grad_norm, cross_entropy
from parallel.tensor import Shards


def shard_units(model: Decoder) -> list[list[TransformerBlock]]:
    """Consecutive transformer blocks, cut only where an AttnRes block ends if the two-phase read is on
    (block_size 1 or 2 sublayers: every transformer block is a unit; 4: pairs; 3: triples)."""
    sublayers_per_read_block = model.mixer.block_size if getattr(model.mixer, "two_phase", False) else 1
    units, unit = [], []
    for block in model.layers.values():
        unit.append(block)
        if (block.attn_sublayer + 1) % sublayers_per_read_block == 0:
            units.append(unit)
            unit = []
    return units + ([unit] if unit else [])


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters with fp32 gradient reduction on CUDA, fp32 elsewhere. Inputs are not cast: the
    blocks pass a DepthState (a dataclass FSDP would copy, dropping the caller's diagnostics dict), and
    the bf16 embedding already makes the residual stream bf16."""
    if device.type != "cuda":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: Decoder, layout: Layout, device: torch.device) -> Decoder:
    policy = mixed_precision(device)
    for unit in shard_units(model):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=layout.fsdp_mesh, mp_policy=policy)
    return fully_shard(model, mesh=layout.fsdp_mesh, mp_policy=policy)


def fill_shards(sharded: nn.Module, template: nn.Module, seed: int) -> None:
    """Initialise a fully_shard-ed model allocated with to_empty from `template`, an unsharded meta copy:
    the template is materialised on the host one init unit at a time (model.init.materialise), and
    each full parameter leaves only this rank's shard behind, so a rank holds its shards plus one unit
    and starts from exactly the weights one process has for the same seed."""
    params = dict(sharded.named_parameters())

    def keep_shard(name: str, full: torch.Tensor) -> torch.Tensor:
        param = params[name]
        # Every rank computes the same full tensor, so each takes its own chunk without communication.
        shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        with torch.no_grad():
            param.copy_(shard)  # same placements: a local copy
        return torch.empty_like(full, device="meta")

    materialise(template, "cpu", template.cfg.init_stds, seed, place=keep_shard)
    buffers = dict(sharded.named_buffers())
    with torch.no_grad():
        for name, buffer in template.named_buffers():  # not sharded: each rank holds them whole
            buffers[name].copy_(buffer)


class FullyShardedEngine:
    """pp == tp == ep == 1 (parallel.fsdp is refused with them for now); `model` is the fully_shard-ed
    Decoder, whose parameters (and so its optimizer state and checkpoint entries) are DTensors. A model
    on the meta device is sharded first and then filled shard by shard (fill_shards); a built one is
    sharded as it is."""

    def __init__(self, model: Decoder, info: DistInfo, layout: Layout, seed: int):
        self.info, self.layout = info, layout
        self.shards = Shards(mesh=layout.mesh)  # no tp/ep slices; DCP handles the DTensors itself
        on_meta = any(p.is_meta for p in model.parameters())
        template = copy.deepcopy(model) if on_meta else None  # meta: costs nothing
        self.model = apply_fsdp(model if on_meta else model.to(info.device), layout, info.device)
        if template is not None:
            self.model.to_empty(device=info.device)
            fill_shards(self.model, template, seed)

    def forward_backward(self, micro_batches, autocast, diagnostics: dict | None) -> torch.Tensor:
        """Mean loss of the step over all tokens of all ranks (FSDP averages gradients over the data ranks)."""
        total = torch.zeros((), device=self.info.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            with autocast():
                logits = self.model(inputs, diagnostics=diagnostics if index == 0 else None)
            loss = cross_entropy(logits, targets)
            ((loss + self.model.aux_loss().to(loss.device)) / len(micro_batches)).backward()
            total += loss.detach()
        return _all_reduce(total / len(micro_batches), self.layout.dp_group) / self.layout.dp

    @torch.no_grad()
    def evaluate(self, batches, autocast) -> tuple[float, int]:
        """(sum of loss * tokens, tokens) over this rank's share of the batches. Every forward gathers
        parameters from the other shards, so all ranks run the same number of forwards: a rank with no
        batch left in the last round runs one anyway and does not count it."""
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        data_ranks, rank = self.layout.dp, self.layout.dp_rank
        rounds = -(-len(batches) // data_ranks)
        for round_start in range(0, rounds * data_ranks, data_ranks):
            index = round_start + rank
            inputs, targets = batches[min(index, len(batches) - 1)]
            with autocast():
                loss = cross_entropy(self.model(inputs), targets).item()
            if index < len(batches):
                loss_sum += loss * targets.numel()
                tokens += targets.numel()
        self.model.train()
        return loss_sum, tokens

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, max_norm, self.layout, self.shards)

    def comm_report(self) -> dict | None:
        return None
