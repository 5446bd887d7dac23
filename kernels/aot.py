"""Ahead-of-time compilation of a `Launch` for an NVIDIA GPU, on a machine without one.

Triton's own binder turns the launch's arguments into the signature, the constants and the alignment
hints a launch on a GPU would specialise on (meta tensors have data_ptr 0, so every pointer counts as
16-byte aligned, as a fresh CUDA allocation is), and `triton.compile` lowers it to PTX and a cubin for
the target; the log of the `ptxas -v` that Triton runs for it (the ptxas it picks for the architecture)
reports registers and spills, which the interpreter never shows. Uses
`triton.runtime.jit.create_function_from_signature`, `JITFunction._pack_args` and the knobs
`always_compile` / `dump_ptxas_log`: not public; the same in triton 3.6 (torch 2.11's CUDA build) and 3.9
(checked by `make compat TORCH=2.11.0`, which compiles the table under 3.6).
"""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
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


@dataclass(frozen=True)
class Compiled:
    kernel: object        # triton's CompiledKernel (PTX, cubin, metadata)
    ptxas_log: str        # what `ptxas -v` printed while Triton built the cubin


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """The launch compiled for compute capability `arch` (80 or 90), always compiled anew (never from
    Triton's cache), with the log of the ptxas run that built its cubin."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch} is not one of {sorted(ARCHS)}")
    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = _binding(launch, target)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    log = io.StringIO()
    # Triton runs `ptxas -v` itself and prints its log when asked; reading it saves a second ptxas run.
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(source, target=target, options=options.__dict__)
    return Compiled(kernel, log.getvalue())


def resources(compiled: Compiled) -> Resources:
    """Registers, spills and stack from the `ptxas -v` log; shared memory and warps from Triton."""
    log = compiled.ptxas_log
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"could not read registers and spills from ptxas -v:\n{log}")
    stack, stores, loads = map(int, spills.groups())
    metadata = compiled.kernel.metadata
    return Resources(int(registers.group(1)), stores, loads, stack, metadata.shared, metadata.num_warps)
