"""Shard a model for its layout, in torchtitan's order.

`parallelize`: tensor + sequence parallelism (tp) and expert parallelism (ep) slice its parameters in place,
context parallelism (cp) links its token mixers across the slices of a sequence, then FSDP2
(parallel/fsdp.py) shards what each rank holds over the fsdp ranks, with the whole model as its root
(pp == 1) or each of this rank's pipeline chunks. `materialise_parallel` wraps it for every layout: a model
on the meta device is sharded there and then filled from an unsharded meta copy one init unit at a time,
so a rank allocates only its part. The engines that run the sharded model are in parallel/engine.py.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from model.decoder import Decoder
from model.init import materialise
from model.residual import DepthGeometry
from parallel.context import apply_context_parallel
from parallel.dims import DistInfo, Layout
from parallel.expert import apply_expert_parallel, expert_param_names
from parallel.fill import fill_local_parts
from parallel.fsdp import apply_fsdp
from parallel.placement import placement_of
from parallel.tensor import apply_tensor_parallel, total_balance_over_sequence


def slice_model(model: Decoder, layout: Layout) -> None:
    """Split the model in place for tp and ep (each split parameter records its placement), and link its
    token mixers over cp (no-ops at 1)."""
    apply_tensor_parallel(model, layout)
    apply_expert_parallel(model, layout)
    apply_context_parallel(model, layout)
    total_balance_over_sequence(model, layout)


def parallelize(model: Decoder, layout: Layout, precision: torch.dtype,
                fsdp_roots: list[nn.Module] | None = None) -> None:
    """tp, then ep, then cp, then FSDP2 over `fsdp_roots` (default: the whole model; under pp, this rank's
    chunks, which keep their parameters gathered from a microbatch's forward to its backward). The ep
    slices of the routed experts stay out of FSDP: their ranks already split them, and their gradients
    are averaged over the ranks holding the same experts (finish_gradients)."""
    slice_model(model, layout)
    if layout.fsdp > 1:
        experts = set(expert_param_names(model))
        ignored = {p for name, p in model.named_parameters() if name in experts}
        apply_fsdp(fsdp_roots or [model], layout, precision, ignored, DepthGeometry.of(model.cfg),
                   reshard_after_forward=fsdp_roots is None)


def materialise_parallel(model: Decoder, info: DistInfo, layout: Layout, seed: int, precision: torch.dtype,
                         fsdp_roots: list[nn.Module] | None = None) -> None:
    """Parallelize `model` and give it its initial weights on the device. A model wholly on the meta
    device is sharded there first, then filled from an unsharded meta copy one init unit at a time
    (parallel.fill), so the host never holds more than one unit beyond this rank's shards; a model
    already (partly) built is completed on the host (model.init.materialise) and sharded as it is."""
    if not all(p.is_meta for p in model.parameters()):
        materialise(model, "cpu", model.cfg.init_stds, seed)
        parallelize(model.to(info.device), layout, precision, fsdp_roots)
        return
    template = copy.deepcopy(model)  # meta: costs nothing
    parallelize(model, layout, precision, fsdp_roots)
    model.to_empty(device=info.device)
    fill_local_parts(model, template, seed, slice_of=functools.partial(_local_part, model))


def _local_part(model: Decoder, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp/ep slice of parameter `name`, given it whole (all of it when it is not split)."""
    placement = placement_of(model, name)
    return full if placement is None else placement.local(full)
