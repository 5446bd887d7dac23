"""A step's diagnostics (train.diag_every, written to diagnostics.jsonl): per-sublayer output RMS and depth
weights, which the forward records on the first micro-batch, with their entropies, and per-block gradient
RMS, read after the backward."""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from trainer.metrics import entropy


def step_diagnostics(model, recorded: dict) -> dict:
    """Per-sublayer output RMS and depth weights (from the first micro-batch), per-block gradient RMS."""
    grad_rms = {}
    for index, block in model.layers.items():
        squares = [p.grad.float().pow(2).sum() for p in block.parameters() if p.grad is not None]
        # Under FSDP a gradient is a DTensor shard: full_tensor() sums the shards' squares over the ranks.
        grads = [square.full_tensor() if isinstance(square, DTensor) else square for square in squares]
        count = sum(p.numel() for p in block.parameters() if p.grad is not None)
        grad_rms[index] = math.sqrt(torch.stack(grads).sum().item() / count) if grads else 0.0
    out = {"output_rms": {str(k): v for k, v in recorded.get("output_rms", {}).items()}, "grad_rms": grad_rms}
    weights = recorded.get("depth_weights")
    if weights:
        out["depth_weights"] = {str(l): {str(i): w for i, w in row.items()} for l, row in weights.items()}
        out["depth_entropy"] = {str(l): entropy(list(row.values())) for l, row in weights.items()}
    return out
