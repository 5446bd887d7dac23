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


class WeightsError(ValueError):
    """Weights that cannot be used; the message is one line."""


class HFExportError(WeightsError):
    """An unreadable Hugging Face export; the message is one line."""


def check_finite(state: dict[str, torch.Tensor], source: Path) -> None:
    """Every floating-point tensor read from `source` finite: one NaN or inf weight makes every output NaN."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise WeightsError(f"{source}: tensor {name} holds {bad:,} non-finite values (NaN or inf) of "
                               f"{tensor.numel():,}; export a checkpoint whose weights are finite")


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
