"""Achieved model TFLOP/s and MFU (model FLOP utilisation) per rank.

tflops = training FLOPs per token (model/flops.py, forward + backward, no recomputation counted)
         x tokens per step per rank (global batch x seq_len / world size) / step time.
mfu    = tflops / the device's peak: `train.peak_tflops` if set, else the tables below matched
         against torch.cuda.get_device_name; unknown (None, null in metrics.jsonl) on a CPU or an
         unlisted GPU. With train.float8 the peak is the one at which this model's mix of float8 and bf16
         FLOPs would run: a share s of the FLOPs at the float8 peak and the rest at the bf16 peak take
         s / P8 + (1 - s) / P16 seconds per FLOP, so the peak is 1 / (s / P8 + (1 - s) / P16).
"""
from __future__ import annotations

import torch

from model import build_model
from model.config import ModelConfig
from parallel.float8 import float8_linear_names

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


# Dense float8 tensor-core peaks (e4m3, without sparsity), same datasheets: twice the bf16 peak on each of
# these; the A100 and A10 have no float8 tensor cores (train.float8 refuses them).
PEAK_FP8_TFLOPS = (
    ("H200 NVL", 1671.0),
    ("H200", 1979.0),
    ("GH200", 1979.0),
    ("H100 NVL", 1671.0),
    ("H100 PCIe", 1513.0),
    ("H100", 1979.0),
    ("B200", 4500.0),
    ("L40S", 733.0),
    ("L4", 242.5),
)


def device_peak_tflops(device: torch.device, override: float | None = None,
                       float8_share: float = 0.0) -> float | None:
    """The peak to divide by: the override, the tables' peak for this GPU and float8 share of the FLOPs
    (float8_flop_share), or None (unknown)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_for_device_name(torch.cuda.get_device_name(device), float8_share)


def peak_for_device_name(name: str, float8_share: float = 0.0) -> float | None:
    bf16 = next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)
    if not float8_share or bf16 is None:
        return bf16
    fp8 = next((peak for key, peak in PEAK_FP8_TFLOPS if key in name), None)
    return None if fp8 is None else 1 / (float8_share / fp8 + (1 - float8_share) / bf16)


def float8_flop_share(cfg: ModelConfig, tp: int, flops_per_token: float) -> float:
    """The share of the training FLOPs per token (model/flops.py) that train.float8 runs in float8: 6 per
    weight of each converted Linear (parallel/float8.py), as model/flops.py counts every matmul."""
    model = build_model(cfg, device="meta")
    weights = sum(model.get_submodule(name).weight.numel() for name in float8_linear_names(model, tp))
    return 6 * weights / flops_per_token


def achieved(flops_per_token: float, tokens_per_rank: float, step_time_s: float,
             peak_tflops: float | None) -> tuple[float, float | None]:
    """(tflops, mfu) of one step on one rank; mfu is None where the peak is unknown."""
    tflops = flops_per_token * tokens_per_rank / step_time_s / 1e12
    return tflops, (tflops / peak_tflops if peak_tflops else None)
