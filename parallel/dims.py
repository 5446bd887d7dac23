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


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Layout:
    """Where this rank sits in the dp x pp mesh, and the groups it talks to."""
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: object | None
    pp_group: object | None


def build_layout(info: DistInfo, dp: int | None, pp: int) -> Layout:
    """A 2-D (dp, pp) device mesh over all ranks; dp=None takes what pp leaves."""
    dp = dp if dp is not None else info.world_size // pp
    if info.world_size == 1:
        return Layout(1, 1, 0, 0, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Layout(dp, pp, mesh.get_local_rank("dp"), mesh.get_local_rank("pp"),
                  mesh.get_group("dp"), mesh.get_group("pp"))
