"""(b) The device's copy bandwidth, then each fused kernel's achieved bandwidth as a fraction of it: the
roofline launches of scripts.kernel_report (model=m, bf16, one 8K-token microbatch, the largest phase-1
read and the widest RMSNorm) timed on the device, bytes from kernel_report.fused_bytes. A memory-bound
kernel near 1.0 moves its bytes as fast as a plain copy; a kernel or tile change should raise its fraction.

    python -m scripts.gpu_checks.bandwidth out=DIR [rehearse=true]    (rehearsal: the copy bandwidth of the
                                                                      host's memory, bytes of every launch)
"""
from __future__ import annotations

import torch

from scripts import kernel_report
from scripts.gpu_checks.result import Result, parse_args

SIZE, DTYPE = "m", "bf16"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("kernel_bandwidth")
    copy = kernel_report.copy_bytes_per_s(args.device.type, size=(1 << 24) if args.rehearse else (1 << 30))
    result.figures["copy_gb_per_s"] = copy / 1e9
    launches = kernel_report.roofline_launches(SIZE, kernel_report.DTYPES[DTYPE], "meta" if args.rehearse else "cuda")
    kernels = {}
    for launch in launches:
        label = kernel_report.roofline_label(SIZE, launch.name)
        moved = kernel_report.fused_bytes(launch)
        kernels[label] = {"bytes": moved, "us_at_copy_bandwidth": moved / copy * 1e6}
        if not args.rehearse:
            us = kernel_report.measure_us(launch)
            kernels[label].update(us=us, gb_per_s=moved / us / 1e3, fraction_of_copy=moved / us * 1e6 / copy)
            print(f"  {label}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s, {moved / us * 1e6 / copy:.0%} of copy")
    result.figures["kernels"] = kernels
    if args.rehearse:
        result.skip(f"achieved bandwidth of {len(launches)} fused kernels (model={SIZE} {DTYPE}) as a fraction "
                    "of the CUDA copy bandwidth")
        result.finish(args.out, f"host_copy={copy / 1e9:.1f}GB/s kernels={len(launches)}")
    fractions = {label: k["fraction_of_copy"] for label, k in kernels.items()}
    if not all(0 < f < float("inf") for f in fractions.values()):
        result.problems.append(f"a kernel's time is not positive: {fractions}")
    lowest = min(fractions, key=fractions.get)
    result.finish(args.out, f"{torch.cuda.get_device_name()} copy={copy / 1e9:.0f}GB/s lowest={fractions[lowest]:.0%} "
                            f"({lowest}) mean={sum(fractions.values()) / len(fractions):.0%} of copy")


if __name__ == "__main__":
    main()
