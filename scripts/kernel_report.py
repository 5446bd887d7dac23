"""Every Triton kernel, compiled ahead of time for sm_80 and sm_90a at every tile configuration the
launchers choose for the model sizes we ship: registers, spills, shared memory, warps, occupancy, and a
roofline prediction against the H200's HBM bandwidth. Needs no GPU (triton and its bundled ptxas).

    python -m scripts.kernel_report [archs=[80,90]] [dtypes=[fp32,bf16]] [sizes=[s,m,l,kimi_linear_48b]]
                                    [json=PATH] [roofline=false] [measure=true]

Exits 1 when any kernel spills. json=PATH writes one record per compiled kernel (for the tests).
measure=true (on a CUDA device: scripts/gpu_check.sh) measures the device's copy bandwidth, then times each
roofline kernel and prints its measured time, bandwidth and that bandwidth as a fraction of the copy's.

The launches come from the launch code itself (`kernels.*.triton.*_launch` on meta tensors), for each
model size, residual setting (the block variant's default and the ablations' block settings), sequence
length (2K-8K tokens, one sequence per microbatch) and dtype; launches that share a tile configuration
(kernel, dtype, constexprs, warps) are compiled once per architecture. tests/kernels/test_aot.py
compiles the same table and requires zero spills.

Roofline: bytes each kernel moves per call at one 8K-token microbatch (every load and store it issues,
each column sweep counted as a read from HBM) over 4.8 TB/s, against the bytes the unfused torch
reference moves on the same shapes (counted op by op on meta tensors: every input read and every
output written once per aten op; views are free).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.attnres import reference as attnres_reference
from kernels.attnres import triton as attnres_fused
from kernels.launch import Launch
from scripts.cli import key, parse
from kernels.rmsnorm import reference as rmsnorm_reference
from kernels.rmsnorm import triton as rmsnorm_fused

SIZES = ("s", "m", "l", "kimi_linear_48b")
SEQ_LENS = (2048, 4096, 8192)
# The block variant's default, and the block settings of the ablation grid (configs/experiment/ablations.yaml).
RESIDUALS = {
    "default": [],
    "S=4": ["variant.block_size=4"],
    "S=4 heads=16": ["variant.block_size=4", "variant.heads=16"],
    "S=4 no key norm": ["variant.block_size=4", "variant.key_norm=false"],
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ARCHS = (80, 90)
H200_BYTES_PER_S = 4.8e12
ROOFLINE_TOKENS = 8192
NORM_EPS = 1e-5


@dataclass(frozen=True)
class Geometry:
    """What one model size and residual setting asks of the kernels."""
    d: int
    heads: int
    key_norm: bool
    phase1_calls: tuple[tuple[int, int], ...]   # (sources N, queries S) of each block's batched read
    norm_widths: tuple[int, ...]                # widths of the RMSNorms that take the fused kernel


@functools.cache
def geometry(size: str, residual: str) -> Geometry:
    from model import build_model
    from model.norms import RMSNorm
    from model.residual import DepthGeometry
    from trainer.config import load_config

    cfg = load_config([f"model={size}", "variant=block", *RESIDUALS[residual]])
    model_cfg, options = cfg.model, cfg.model.residual
    S, L = DepthGeometry.of(model_cfg).size, model_cfg.n_sublayers
    # Depth block n (1-based) reads b_0 .. b_{n-1} for its queries: sublayers (n-1)S+1 .. min(nS, L).
    calls = tuple((n, min(S, L - (n - 1) * S)) for n in range(1, math.ceil(L / S) + 1))
    model = build_model(cfg, device="meta")
    widths = sorted({m.weight.shape[0] for m in model.modules() if isinstance(m, RMSNorm) and m.impl != "torch"})
    return Geometry(model_cfg.d_model, options.heads, options.key_norm, calls, tuple(widths))


def _meta(*shape, dtype=torch.float32, device="meta") -> torch.Tensor:
    """A tensor of `shape`: shape and dtype only on the meta device, random values on a real one."""
    if device == "meta":
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.randn(*shape, device=device).to(dtype)


def attnres_launches(g: Geometry, tokens: int, dtype: torch.dtype, device: str = "meta") -> list[Launch]:
    """Forward and backward launches of every phase-1 read and of phase 2, for one microbatch of `tokens`."""
    H, HD = g.heads, g.d // g.heads
    eps = NORM_EPS if g.key_norm else None
    new = functools.partial(_meta, device=device)
    launches = []
    for n_sources, n_queries in g.phase1_calls:
        blocks = [new(tokens, g.d, dtype=dtype) for _ in range(n_sources)]
        queries = new(n_queries, H, HD)
        launches.append(attnres_fused.phase1_forward_launch(queries, eps, blocks, gpu=True)[0])
        stats = new(n_queries, tokens, H)
        launches.append(attnres_fused.phase1_backward_launch(
            queries, eps, blocks, new(n_queries, tokens, g.d), stats, stats, gpu=True)[0])
    o1, m1, partial, query = new(tokens, g.d), new(tokens, H), new(tokens, g.d, dtype=dtype), new(H, HD)
    launches.append(attnres_fused.phase2_forward_launch(o1, m1, m1, partial, query, eps, gpu=True)[0])
    launches.append(attnres_fused.phase2_backward_launch(o1, m1, m1, partial, query, partial, eps, gpu=True)[0])
    return launches


def rmsnorm_launches(g: Geometry, tokens: int, dtype: torch.dtype, device: str = "meta") -> list[Launch]:
    """Every fused RMSNorm width, at `tokens` rows (a per-head norm has more rows, which changes no
    tile: at 2K rows and more BLOCK_M is set by the tile budget)."""
    launches = []
    for width in g.norm_widths:
        x, weight = _meta(tokens, width, dtype=dtype, device=device), _meta(width, dtype=dtype, device=device)
        launches.append(rmsnorm_fused.forward_launch(x, weight, NORM_EPS, gpu=True)[0])
        launches.append(rmsnorm_fused.backward_launch(x, weight, x, NORM_EPS, gpu=True)[0])
    return launches


def tile_config(launch: Launch, dtype: str) -> tuple:
    return (launch.name, dtype, tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)


@dataclass
class Config:
    """One tile configuration: its launch (the largest problem that picks it) and who picks it."""
    launch: Launch
    dtype: str
    used_by: set

    @property
    def label(self) -> str:
        tiles = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in self.launch.constexprs.items() if k.startswith("BLOCK_"))
        extra = "" if self.launch.constexprs.get("HAS_NORM", True) else " no-norm"
        return f"{self.launch.name} {self.dtype} {tiles} w{self.launch.num_warps}{extra}"


def tile_configs(sizes=SIZES, dtypes=tuple(DTYPES)) -> list[Config]:
    """Every distinct tile configuration the launchers choose, in a stable order."""
    configs: dict[tuple, Config] = {}
    for size in sizes:
        for residual in RESIDUALS:
            g = geometry(size, residual)
            for tokens in SEQ_LENS:
                for dtype in dtypes:
                    for launch in attnres_launches(g, tokens, DTYPES[dtype]) + rmsnorm_launches(g, tokens, DTYPES[dtype]):
                        key = tile_config(launch, dtype)
                        config = configs.setdefault(key, Config(launch, dtype, set()))
                        config.used_by.add(size)
    return sorted(configs.values(), key=lambda c: c.label)


# -- roofline ----------------------------------------------------------------------------------------


class _ByteCounter(TorchDispatchMode):
    """Bytes an eager torch computation moves: every tensor input and output of each aten op once;
    ops whose output is a view of an input move nothing."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _is_view(func):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _is_view(func) -> bool:
    schema = func._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _forward_and_backward(fn, inputs):
    """Bytes of fn's forward, and of its backward (through a loss that weighs every output by one)."""
    inputs = [x.requires_grad_() for x in inputs]
    with _ByteCounter() as forward:
        outputs = fn(*inputs)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o.requires_grad]
    with _ByteCounter() as backward:
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return forward.bytes, backward.bytes


def fused_bytes(launch: Launch) -> int:
    """Bytes a launch's loads and stores move, from its arguments: each column sweep reads its tensors
    again (a sweep's second pass is an HBM read unless the program's tile is still in L2)."""
    name, args = launch.name, launch.args
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    if name == "_phase1_fwd":
        blocks, o, m, l, scores = args[1].numel() * args[1].element_size() * args[8], args[3], args[4], args[5], args[6]
        return 2 * blocks + size(o) + size(m) + size(l) + size(scores)
    if name == "_phase1_bwd":
        blocks = args[1].numel() * args[1].element_size() * args[9]
        d_o, d_blocks = args[3], args[6]
        return 2 * blocks + 2 * size(d_o) + size(d_blocks) + size(args[4]) + size(args[5])
    if name == "_phase2_fwd":
        o1, partial, h = args[0], args[3], args[5]
        return 2 * size(partial) + size(o1) + size(h) + 2 * size(args[1])
    if name == "_phase2_bwd":
        o1, partial, d_h, d_o1, d_partial = args[0], args[3], args[5], args[6], args[9]
        return 2 * size(partial) + 2 * size(d_h) + size(o1) + size(d_o1) + size(d_partial)
    if name == "_rms_norm_fwd":
        return 2 * size(args[0])
    if name == "_rms_norm_bwd":
        return 3 * size(args[0])
    raise KeyError(f"no byte count for kernel {name}")


def roofline_geometry(size: str) -> Geometry:
    """The largest call of each kernel: the block read with the most sources x queries, the widest RMSNorm."""
    g = geometry(size, "default")
    call = max(g.phase1_calls, key=lambda c: c[0] * c[1])
    return Geometry(g.d, g.heads, g.key_norm, (call,), (max(g.norm_widths),))


def roofline_launches(size: str, dtype: torch.dtype, device: str = "meta") -> list[Launch]:
    g = roofline_geometry(size)
    return attnres_launches(g, ROOFLINE_TOKENS, dtype, device) + rmsnorm_launches(g, ROOFLINE_TOKENS, dtype, device)


def unfused_bytes(size: str, dtype: torch.dtype) -> dict[str, int]:
    """Bytes the torch reference moves for what each kernel computes, on the roofline shapes."""
    g = roofline_geometry(size)
    H, HD, tokens = g.heads, g.d // g.heads, ROOFLINE_TOKENS
    (n_sources, n_queries), width = g.phase1_calls[0], g.norm_widths[0]

    def phase1(queries, *blocks):
        inv = [attnres_reference.inverse_rms(b, H, NORM_EPS) for b in blocks]
        return attnres_reference.phase1(list(blocks), queries, inv)[:3]

    def phase2(o1, m1, l1, partial, query):
        return attnres_reference.phase2(o1, m1, l1, partial, query, attnres_reference.inverse_rms(partial, H, NORM_EPS))[0]

    counts = {}
    counts["_phase1_fwd"], counts["_phase1_bwd"] = _forward_and_backward(
        phase1, [_meta(n_queries, H, HD)] + [_meta(tokens, g.d, dtype=dtype) for _ in range(n_sources)])
    counts["_phase2_fwd"], counts["_phase2_bwd"] = _forward_and_backward(
        phase2, [_meta(tokens, g.d), _meta(tokens, H), _meta(tokens, H), _meta(tokens, g.d, dtype=dtype), _meta(H, HD)])
    counts["_rms_norm_fwd"], counts["_rms_norm_bwd"] = _forward_and_backward(
        lambda x, w: rmsnorm_reference.rms_norm(x, w, NORM_EPS), [_meta(tokens, width, dtype=dtype), _meta(width, dtype=dtype)])
    return counts


def roofline_label(size: str, name: str) -> str:
    g = roofline_geometry(size)
    (n_sources, n_queries), width = g.phase1_calls[0], g.norm_widths[0]
    shape = f"N{n_sources} S{n_queries} d{g.d}" if name.startswith("_phase1") else f"d{width if 'rms' in name else g.d}"
    return f"{name} ({shape})"


def measure_us(launch: Launch, reps: int = 20) -> float:
    """Median time of one launch on the CUDA device, in microseconds."""
    for _ in range(3):
        launch.run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch.run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bytes_per_s(device: str = "cuda", size: int = 1 << 30, reps: int = 20) -> float:
    """The device's own copy bandwidth: bytes read plus bytes written per second by `dst.copy_(src)` of
    `size` bytes (median of `reps`), the most a memory-bound kernel can hope to move."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for rep in range(reps + 2):  # the first two warm up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if rep >= 2:
            times.append(time.perf_counter() - start)
    return 2 * size / sorted(times)[len(times) // 2]


# -- report ------------------------------------------------------------------------------------------


@dataclass
class Args:
    archs: list[int] = key(list(ARCHS), "GPU architectures to compile for", choices=ARCHS)
    dtypes: list[str] = key(list(DTYPES), "dtypes of the launches", choices=tuple(DTYPES))
    sizes: list[str] = key(list(SIZES), "model sizes whose launches are compiled", choices=SIZES)
    json: str | None = key(None, "also write one JSON record per compiled kernel to this file")
    roofline: bool = key(True, "after the compiled kernels' table, the roofline table")
    measure: bool = key(False, "on a CUDA device, also time each roofline kernel and print its bandwidth")


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, __doc__, argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        print("error: TRITON_INTERPRET is set, so triton.jit builds interpreter functions that cannot be "
              "compiled for a GPU; unset it", file=sys.stderr)
        return 2
    from kernels.aot import compile_launch, resources

    configs = tile_configs(tuple(args.sizes), tuple(args.dtypes))
    print(f"{len(configs)} tile configurations x {len(args.archs)} architectures; sizes {' '.join(args.sizes)}, "
          f"sequence lengths {SEQ_LENS}, residual settings: {', '.join(RESIDUALS)}\n", file=sys.stderr)
    print("| kernel, dtype, tile, warps | arch | registers | spill stores / loads (B per thread) | "
          "shared (B) | occupancy | used by |")
    print("|---|---|---|---|---|---|---|")
    spilling, start, records = 0, time.perf_counter(), []
    for config in configs:
        for arch in args.archs:
            r = resources(compile_launch(config.launch, arch))
            spilling += r.spills > 0
            used = " ".join(s for s in SIZES if s in config.used_by)
            print(f"| {config.label} | sm_{arch} | {r.registers} | {r.spill_stores} / {r.spill_loads} | "
                  f"{r.shared} | {r.occupancy(arch):.0%} | {used} |", flush=True)
            records.append(dict(kernel=config.launch.name, label=config.label, arch=arch, used_by=sorted(config.used_by),
                                **dataclasses.asdict(r)))
    print(f"\n{spilling} of {len(configs) * len(args.archs)} compiled kernels spill "
          f"({time.perf_counter() - start:.0f} s to compile)\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if not args.roofline:
        return 1 if spilling else 0

    measure = args.measure
    if measure and not torch.cuda.is_available():
        print("kernel_report: measure=true needs a CUDA device; the roofline table has predictions only", file=sys.stderr)
        measure = False
    print(f"Roofline at {ROOFLINE_TOKENS} tokens (one call, the largest phase-1 read), H200 {H200_BYTES_PER_S / 1e12:.1f} TB/s:\n")
    if measure:
        copy = copy_bytes_per_s()
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e9:.0f} GB/s (read + write of 1 GiB)\n")
    measured_columns = " measured µs | measured GB/s | of copy |" if measure else ""
    print(f"| size | dtype | kernel | fused MB | predicted µs | unfused torch MB | fused / unfused |{measured_columns}")
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if measure else ""))
    for size in args.sizes:
        for dtype in args.dtypes:
            unfused = unfused_bytes(size, DTYPES[dtype])
            devices = roofline_launches(size, DTYPES[dtype], "cuda") if measure else [None] * len(unfused)
            for launch, on_device in zip(roofline_launches(size, DTYPES[dtype]), devices):
                fused = fused_bytes(launch)
                row = (f"| {size} | {dtype} | {roofline_label(size, launch.name)} | {fused / 1e6:.1f} | "
                       f"{fused / H200_BYTES_PER_S * 1e6:.1f} | {unfused[launch.name] / 1e6:.1f} | "
                       f"{fused / unfused[launch.name]:.2f} |")
                if on_device is not None:
                    us = measure_us(on_device)
                    row += f" {us:.1f} | {fused / us / 1e3:.0f} | {fused / us * 1e6 / copy:.0%} |"
                print(row, flush=True)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
