"""Trained weights read back without running code, for starting a run from them (init_from) and for the
inference layer: a Hugging Face export's safetensors (`read_hf_state`), and the check every reader of
weights runs (`check_finite`). Writing exports is inference/'s; reading them is here because training
reads them too.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_PATTERN = "model{suffix}.safetensors"
MODEL_TYPE = "attnres"
PREFIX = "model."  # AttnResForCausalLM holds our Decoder as .model
FLOAT8_CHUNK = 1 << 24  # elements widened to float32 at once: 64 MiB


class WeightsError(ValueError):
    """Weights that cannot be used; the message is one line."""


class HFExportError(WeightsError):
    """An unreadable Hugging Face export; the message is one line."""


def check_finite(state: dict[str, torch.Tensor], source: Path) -> None:
    """Every floating-point tensor read from `source` finite: one NaN or inf weight makes every output NaN."""
    for name, tensor in state.items():
        bad = non_finite_count(tensor, name, source) if tensor.is_floating_point() else 0
        if bad:
            raise WeightsError(f"{source}: tensor {name} holds {bad:,} non-finite values (NaN or inf) of "
                               f"{tensor.numel():,}; export a checkpoint whose weights are finite")


def non_finite_count(tensor: torch.Tensor, name: str, source: Path) -> int:
    """NaN and inf entries of a floating-point `tensor`. torch.isfinite has no kernel for most one-byte floats
    (float8_e4m3fn, ...), so those are counted in float32, which holds each of their values exactly, a chunk at
    a time so that a large tensor never needs four times its size at once. Loading then widens them the same
    way into the model's parameters."""
    if tensor.dtype.itemsize > 1:
        return int((~torch.isfinite(tensor)).sum())
    try:
        return sum(int((~torch.isfinite(chunk.float())).sum()) for chunk in tensor.reshape(-1).split(FLOAT8_CHUNK))
    except NotImplementedError:  # float4_e2m1fn_x2: two values packed per element, nothing widens it
        raise WeightsError(f"{source}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, which cannot be "
                           "widened into the model's parameters; store the weights as float32, bfloat16, float16 "
                           "or a float8 dtype") from None


def is_hf_export(path: Path) -> bool:
    """A directory inference.export format=hf wrote (config.json of model_type attnres), read as JSON only."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def weight_files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise HFExportError(f"{path / INDEX_FILE} could not be read ({error})") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    return [path / WEIGHTS_PATTERN.format(suffix="")]


def read_hf_state(path: Path) -> dict[str, torch.Tensor]:
    """Our Decoder's state dict from an HF export's safetensors (plain tensors: nothing in them runs code)."""
    state = {}
    for file in weight_files(path):
        if file.parent != path or not file.is_file():
            raise HFExportError(f"{file} is not a weights file of the export {path}; re-export with inference.export")
        try:
            state.update(load_file(file))
        except (OSError, SafetensorError) as error:
            raise HFExportError(f"{file} could not be read ({str(error).splitlines()[0]})") from None
    outside = [name for name in state if not name.startswith(PREFIX)]
    if outside:
        raise HFExportError(f"{path}: weight {outside[0]} is not under {PREFIX!r}; not an AttnRes export")
    return {name[len(PREFIX):]: tensor for name, tensor in state.items()}
