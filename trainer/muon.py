"""Muon for parameters FSDP2 shards: gather each matrix's update, orthogonalise it whole, keep this rank's rows.

torch.optim.Muon's update is elementwise except for the Newton-Schulz orthogonalisation, which needs the
whole matrix. On a DTensor shard torch's own step runs the iteration through DTensor's sharded matmuls:
it runs, but a tall matrix (orthogonalised transposed) sums its bf16 partial products in another order
than one process does, and its update differs by about 2% (measured: 1.8e-2 of the largest update after
3 steps on 2 ranks; wide and square matrices came out exact). Here the
elementwise parts (momentum, Nesterov, decoupled decay, the step) stay on the local shard, and the
orthogonalisation all-gathers the update, runs torch's own iteration on the whole matrix (the same
call one process makes, so the result is one process's) and keeps this rank's shard of it, as
distributed Muon implementations do. Every rank orthogonalises every matrix it shards; spreading the
matrices over the ranks would divide that work by the fsdp degree (left for later).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # private: pinned torch (setup.py)


def orthogonalise(update: torch.Tensor, group: dict) -> torch.Tensor:
    """Newton-Schulz of the whole matrix; for a DTensor, this rank's shard of it."""
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    result = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
    if isinstance(update, DTensor):
        # Every rank holds the same whole result: each keeps its own shard, without communication.
        return distribute_tensor(result, update.device_mesh, update.placements, src_data_rank=None)
    return result


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, checks and state) with a step that accepts FSDP2's DTensor shards.
    On plain tensors it is torch's step, to the bit (tests/trainer/test_muon.py)."""

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
                update = orthogonalise(update, group)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
