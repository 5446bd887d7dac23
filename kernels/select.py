"""Which implementation of an op runs: `impl = auto | torch | triton`.

`torch` is plain torch, no fused kernel: an op's `reference.py` (KDA: its chunkwise form, `chunk.py`).
`auto` takes Triton for CUDA tensors when triton imports, and plain torch elsewhere.
`triton` insists (on CPU it needs TRITON_INTERPRET=1, which is how the tests run the kernels).
Triton is imported only on the Triton path: the project never needs it installed.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_refusal(on_cuda: bool) -> str | None:
    """Why impl='triton' cannot run here (None when it can): checked before any work by the config."""
    if not triton_available():
        return "impl='triton' needs the triton package (pip install -e '.[gpu]')"
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        return "impl='triton' on CPU tensors runs only under TRITON_INTERPRET=1 (the Triton interpreter)"
    return None


def use_triton(impl: str, tensor: torch.Tensor) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        refusal = triton_refusal(tensor.is_cuda)
        if refusal is not None:
            raise RuntimeError(refusal)
        return True
    if impl == "auto":
        return tensor.is_cuda and triton_available()
    raise ValueError(f"impl={impl!r} is not one of {' | '.join(IMPLS)}")
