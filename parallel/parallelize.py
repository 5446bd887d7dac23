"""The one place that knows both the model and the parallel layout."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from model.decoder import Decoder
from parallel.dims import DistInfo, all_reduce_sum_


def parallelize(model: Decoder, info: DistInfo) -> nn.Module:
    """Data parallelism with DDP over all ranks; the single-process model is returned as is."""
    model.to(info.device)
    if info.world_size == 1:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> Decoder:
    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def sync_moe_load(model: Decoder) -> None:
    """Sum expert load over data-parallel ranks so every rank nudges its balancing bias the same way."""
    for moe in model.moe_layers():
        all_reduce_sum_(moe.load_counts)
