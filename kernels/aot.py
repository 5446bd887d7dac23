"""Ahead-of-time compilation of a `Launch` for an NVIDIA GPU, on a machine without one.

Triton's own binder turns the launch's arguments into the signature, the constants and the alignment
hints a launch on a GPU would specialise on (meta tensors have data_ptr 0, so every pointer counts as
16-byte aligned, as a fresh CUDA allocation is), and `triton.compile` lowers it to PTX and a cubin for
the target. `ptxas -v` (the one Triton picks for the architecture) then reports registers and spills,
which the interpreter never shows. Uses `triton.runtime.jit.create_function_from_signature` and
`JITFunction._pack_args`: not public, read from triton 3.9.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels.launch import Launch

# Compute capability -> the name ptxas takes: Hopper's wgmma and TMA need the "a" variant.
ARCHS = {80: "sm_80", 90: "sm_90a"}
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}  # bytes a thread block may use on A100 / H100-H200


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_stores: int     # bytes per thread
    spill_loads: int
    stack: int            # bytes per thread
    shared: int           # bytes per program
    num_warps: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def occupancy(self, arch: int) -> float:
        """Resident warps per SM over the maximum (64), bounded by registers, shared memory and threads."""
        threads = 32 * self.num_warps
        allocated = -(-max(self.registers, 1) // 8) * 8  # registers are allocated per thread in steps of 8
        by_registers = REGISTERS_PER_SM // (allocated * threads)
        by_shared = SHARED_PER_SM[arch] // self.shared if self.shared else by_registers
        by_threads = MAX_THREADS_PER_SM // threads
        programs = min(by_registers, by_shared, by_threads)
        return programs * threads / MAX_THREADS_PER_SM


def _binding(launch: Launch, target: GPUTarget):
    backend = make_backend(target)
    kernel = launch.kernel
    options = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(*launch.args, **options)
    return kernel._pack_args(backend, options, bound, specialization, parsed)


def compile_key(launch: Launch, arch: int) -> tuple:
    """What Triton would cache the launch's binary under: equal keys compile to the same binary."""
    options, signature, constexprs, attrs = _binding(launch, GPUTarget("cuda", arch, 32))
    return (launch.name, arch, tuple(signature.items()), tuple(sorted(constexprs.items())),
            tuple(sorted((k, str(v)) for k, v in attrs.items())), options.num_warps, options.num_stages)


def compile_launch(launch: Launch, arch: int):
    """The launch compiled for compute capability `arch` (80 or 90): a triton CompiledKernel."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch} is not one of {sorted(ARCHS)}")
    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = _binding(launch, target)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def resources(compiled, arch: int) -> Resources:
    """Registers, spills and stack from `ptxas -v` on the compiled PTX; shared memory and warps from Triton."""
    with tempfile.TemporaryDirectory() as scratch:
        ptx = os.path.join(scratch, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        result = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={ARCHS[arch]}", ptx,
                                 "-o", os.path.join(scratch, "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    log = result.stderr + result.stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"could not read registers and spills from ptxas -v:\n{log}")
    stack, stores, loads = map(int, spills.groups())
    return Resources(int(registers.group(1)), stores, loads, stack, compiled.metadata.shared,
                     compiled.metadata.num_warps)
