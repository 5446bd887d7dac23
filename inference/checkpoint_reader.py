"""A checkpoint's model tensors, read a few at a time, so that an export holds about one shard of the model and
never all of it. DCP reads only the requested tensors' bytes (its metadata unpickled with the allowlist of
trainer/run_dir/safe_dcp.py), whatever layout (fsdp, tp, pp, ep) wrote them.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from model import build_model
from model.config import ModelConfig
from trainer.run_dir.checkpoint import CheckpointError
from trainer.run_dir.safe_dcp import SafeFileSystemReader, WeightsOnlyLoadPlanner

def _one_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


class CheckpointTensors:
    """The model tensors of one checkpoint directory whose config builds `model_cfg` (checked beforehand with
    check_model_shapes): `specs` (name -> (shape, dtype) of the model built from it: what loading the checkpoint
    into that model gives), and `read(names)`, loading just those."""

    def __init__(self, path: Path, model_cfg: ModelConfig):
        self.path = path
        self.specs = {name: (tensor.shape, tensor.dtype)
                      for name, tensor in build_model(model_cfg, device="meta").state_dict().items()}

    def meta(self) -> dict[str, torch.Tensor]:
        """The tensors as meta tensors (shapes and dtypes, no data)."""
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in self.specs.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` (our state-dict names), full, on the CPU, in the built model's dtype (DCP copies
        the stored values into them, as loading the checkpoint into the model does)."""
        state = {"model": {name: torch.empty(self.specs[name][0], dtype=self.specs[name][1]) for name in names}}
        try:
            with warnings.catch_warnings():  # DCP warns when no process group is up; one process is the intent here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.load(state, storage_reader=SafeFileSystemReader(self.path), planner=WeightsOnlyLoadPlanner())
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint {self.path} could not be read ({_one_line(error)})") from None
        return state["model"]


class StateTensors:
    """A state dict already in memory behind CheckpointTensors' interface (meta, read), for the writers."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def meta(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in self.state.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: self.state[name].detach().cpu().contiguous() for name in names}
