"""Read a release directory as the reference wants it: config.json, and every tensor the index names, with each
MXFP4 pair (weight_packed, weight_scale) dequantised by compressed-tensors into one `.weight`."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from . import mxfp4
from .reference import text_config


def read_release_checkpoint(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(directory / file), framework="pt") as shard:
            stored |= {name: shard.get_tensor(name) for name in shard.keys()}
    if set(stored) != set(weight_map):
        raise ValueError(f"the shards hold {sorted(set(stored) ^ set(weight_map))[:5]} not as the index says")
    quantization = text_config(config).get("quantization_config")
    state = {}
    for name, tensor in stored.items():
        if name.endswith(".weight_packed"):
            base = name[:-len("weight_packed")]
            state[base + "weight"] = mxfp4.decompress(tensor, stored[base + "weight_scale"], quantization)
        elif not name.endswith(".weight_scale"):
            state[name] = tensor
    return config, state
