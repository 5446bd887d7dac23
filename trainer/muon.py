"""Muon for sharded parameters: gather each matrix's update, orthogonalise it whole, keep this rank's part.

torch.optim.Muon's update is elementwise except for the Newton-Schulz orthogonalisation, which needs the
whole matrix. On a DTensor shard torch's own step runs the iteration through DTensor's sharded matmuls:
it runs, but a tall matrix (orthogonalised transposed) sums its bf16 partial products in another order
than one process does, and its update differs from one process's (measured in docs/BENCHMARKS.md, "Muon on
sharded parameters"). Here the
elementwise parts (momentum, Nesterov, decoupled decay, the step) stay on the local shard, and the
orthogonalisation all-gathers the update, runs torch's own iteration on the whole matrix (the same
call one process makes, so the result is one process's) and keeps this rank's shard of it, as
distributed Muon implementations do. A tensor-parallel slice (a plain tensor, `MatrixSlice`) is
all-gathered over its tp group the same way, after FSDP's gather where both split it. Every rank
orthogonalises every matrix it holds part of; spreading the matrices over the ranks would divide that
work by the fsdp (and tp) degree (left for later).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # private: pinned torch (setup.py)


@dataclass(frozen=True)
class MatrixSlice:
    """A parameter that is this rank's slice, along `dim`, of a matrix split over `group` (tensor
    parallelism): rank r of the group holds chunk r."""
    dim: int
    group: object


def whole_matrix(update: torch.Tensor, part: MatrixSlice | None) -> torch.Tensor:
    """The whole matrix of a (possibly FSDP-sharded, possibly tp-sliced) update, on every rank."""
    whole = update.full_tensor() if isinstance(update, DTensor) else update  # FSDP: this rank's tp slice
    if part is not None:
        pieces = [torch.empty_like(whole) for _ in range(dist.get_world_size(part.group))]
        dist.all_gather(pieces, whole.contiguous(), group=part.group)
        whole = torch.cat(pieces, dim=part.dim)
    return whole


def local_part(result: torch.Tensor, update: torch.Tensor, part: MatrixSlice | None) -> torch.Tensor:
    """This rank's part of `result` (the whole matrix), laid out as `update`. Every rank holds the same
    result, so each keeps its own part without communication."""
    if part is not None:
        result = result.chunk(dist.get_world_size(part.group), part.dim)[dist.get_rank(part.group)]
    if isinstance(update, DTensor):
        return distribute_tensor(result, update.device_mesh, update.placements, src_data_rank=None)
    return result


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, checks and state) with a step that accepts FSDP2's DTensor shards
    and tensor-parallel slices (`slices`: parameter -> MatrixSlice). On plain whole tensors it is torch's
    step, to the bit (tests/trainer/test_muon.py)."""

    def __init__(self, params, *args, slices: dict | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.slices = slices or {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                part = self.slices.get(param)
                whole = whole_matrix(update, part)
                result = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                # The learning-rate scale is the whole matrix's (out / in), not the slice's.
                param.add_(local_part(result, update, part), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], whole.shape))
        return loss
