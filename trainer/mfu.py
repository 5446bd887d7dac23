"""Achieved model TFLOP/s and MFU (model FLOP utilisation) per rank.

tflops = training FLOPs per token (model/flops.py, forward + backward, no recomputation counted)
         x tokens per step per rank (global batch x seq_len / world size) / step time.
mfu    = tflops / the device's peak: `train.peak_tflops` if set, else the table below matched
         against torch.cuda.get_device_name; unknown (None, null in metrics.jsonl) on a CPU or an
         unlisted GPU.
"""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks in TFLOP/s (without 2:4 sparsity), from NVIDIA's product datasheets
# (H200, H100, A100, L40S, L4, A10, B200); training runs bf16 autocast on CUDA. First match wins, so a
# name that contains another (A100 / A10, L40S / L4, H100 NVL / H100) comes first.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),   # SXM: "NVIDIA H100 80GB HBM3"
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The peak to divide by: the override, the table's entry for this GPU, or None (unknown)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_for_device_name(torch.cuda.get_device_name(device))


def peak_for_device_name(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def achieved(flops_per_token: float, tokens_per_rank: float, step_time_s: float,
             peak_tflops: float | None) -> tuple[float, float | None]:
    """(tflops, mfu) of one step on one rank; mfu is None where the peak is unknown."""
    tflops = flops_per_token * tokens_per_rank / step_time_s / 1e12
    return tflops, (tflops / peak_tflops if peak_tflops else None)
