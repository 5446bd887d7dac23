"""What differs across the torch releases setup.py allows (2.11 through 2.15), in one place.

Each difference says which release changed it. `make compat TORCH=<release>` runs a subset of the suite
on one release (docs/BENCHMARKS.md has the results).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.fsdp import _common_utils as fsdp_common
from torch.nn.parallel import DistributedDataParallel

# Functional collectives that carry gradients: torch 2.13 named them *_single_autograd and deprecated the
# *_tensor_autograd names (a FutureWarning on every call since), which are all 2.11 and 2.12 have. Same
# arguments (tensor, dim, group) and the same results.
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
reduce_scatter_autograd = (getattr(funcol, "reduce_scatter_single_autograd", None)
                           or funcol.reduce_scatter_tensor_autograd)


def _grad_tensors(output, found: list[torch.Tensor]) -> None:
    """The tensors needing gradients inside `output`: through dataclasses, lists, tuples and dicts."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            found.append(output)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            _grad_tensors(getattr(output, field.name), found)
    elif isinstance(output, (list, tuple)):
        for item in output:
            _grad_tensors(item, found)
    elif isinstance(output, dict):
        for item in output.values():
            _grad_tensors(item, found)


@functools.cache
def fsdp_hooks_reach_dataclass_outputs() -> None:
    """FSDP2 unshards a unit's parameters for its backward from a hook on each of the unit's output tensors.
    Our units return a DepthState (a dataclass). torch 2.12 finds tensors inside dataclasses
    (fsdp._common_utils.collect_grad_tensors); 2.11 took them with tree_flatten, which treats a dataclass as
    one leaf, so no hook ran and the backward read resharded parameters (`setStorage: ... storage of size
    0`). On 2.11 the hooks are registered the way 2.12 does; on later releases nothing changes."""
    if hasattr(fsdp_common, "collect_grad_tensors"):
        return
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # 2.11's private home of the hook

    flat_outputs_only = FSDPState._register_pre_backward_hook

    def register_pre_backward_hook(self, output):
        if not dataclasses.is_dataclass(output) or not torch.is_grad_enabled():
            return flat_outputs_only(self, output)
        found: list[torch.Tensor] = []
        _grad_tensors(output, found)
        for tensor in found:
            tensor.register_hook(self._pre_backward)
        return output

    FSDPState._register_pre_backward_hook = register_pre_backward_hook


# DDP's switch for broadcasting buffers at each forward: torch 2.13 added `forward_sync_buffers` and
# deprecated `broadcast_buffers`, the only one 2.11 and 2.12 have. The old switch also leaves buffers out
# of the initial sync, which changes nothing here: every rank builds the same buffers from the same seed.
DDP_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                              else {"broadcast_buffers": False})


def context_parallel_refusal() -> str | None:
    """Why parallel.cp > 1 cannot run on this torch, or None. On 2.11 a cp2 step hangs in its first backward,
    inside one rank's autograd all-gather (the *_tensor_autograd collectives; measured, `make compat
    TORCH=2.11.0`); 2.13's *_single_autograd ones train like one process. 2.12 has only the old ones."""
    if hasattr(funcol, "all_gather_single_autograd"):
        return None
    return (f"parallel.cp > 1 needs torch >= 2.13, not {torch.__version__}: before 2.13 context parallelism's "
            "autograd all-gathers hang in the first backward")
