"""One description of a Triton kernel launch, shared by the launchers and the ahead-of-time compiler.

The autograd functions in `kernels/*/triton.py` build a `Launch` (kernel, grid, arguments, tile sizes,
warps) and run it. Built from meta tensors instead, the same `Launch` is what `kernels.aot` compiles
for a GPU on a machine without one: the signature, the tiles and the warps then come from the launch
code itself, so what is compiled ahead of time is what a GPU run would compile.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Launch:
    kernel: object                # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple                   # runtime arguments in the kernel's order (tensors and scalars)
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages)


def compiled_for_gpu(device: torch.device) -> bool:
    """Whether launches on `device` are compiled for a GPU (tiles sized for registers) or run by the
    CPU interpreter (tiles sized to keep the number of program instances small)."""
    return device.type == "cuda"
