"""Process-group setup: one place picks the backend and the device."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun job if there is one: NCCL on CUDA devices, gloo on CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size == 1:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), world_size, local_rank, device, backend)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a no-op in a single process)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def all_reduce_sum_(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
