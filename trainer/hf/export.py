"""Write and read a Hugging Face export: `python -m trainer.export checkpoint=RUN out=DIR format=hf`.

The directory holds what `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and
`AutoTokenizer.from_pretrained(DIR)` read:
  config.json               AttnResConfig (our ModelConfig as `attnres_model`, the trained context as
                            max_position_embeddings) with `auto_map` naming the classes below
  generation_config.json    eos_token_id: the end-of-text token every document ends with in training
  *.py                      configuration_attnres.py, modeling_attnres.py and the model and reference
                            kernels they run, flattened (bundle.py)
  model.safetensors, or model-0000K-of-0000N.safetensors + model.safetensors.index.json when the weights
                            exceed max_shard_size (transformers' own convention)
  tokenizer.json + tokenizer_config.json (a fast tokenizer ending documents with <|endoftext|>)
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trainer.data import EOT_TOKEN
from trainer.hf.bundle import write_bundle

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_PATTERN = "model{suffix}.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MODEL_TYPE = "attnres"
PREFIX = "model."  # AttnResForCausalLM holds our Decoder as .model
AUTO_MAP = {"AutoConfig": "configuration_attnres.AttnResConfig",
            "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM"}


class HFExportError(ValueError):
    """An unreadable Hugging Face export; the message is one line."""


def hf_config(model_cfg, seq_len: int, eot_id: int | None) -> dict:
    """config.json of the export, as transformers' AttnResConfig would write it."""
    from trainer.hf.configuration_attnres import AttnResConfig

    config = AttnResConfig(attnres_model=dataclasses.asdict(model_cfg), max_position_embeddings=seq_len,
                           eos_token_id=eot_id, architectures=["AttnResForCausalLM"])
    config.auto_map = AUTO_MAP
    return config.to_dict()


def write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_size: int | str, step: int | None) -> int:
    """Our Decoder's state under AttnResForCausalLM's names, in shards of at most max_shard_size; returns the
    number of shard files."""
    named = {PREFIX + name: tensor for name, tensor in state.items()}
    split = split_torch_state_dict_into_shards(named, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({name: named[name] for name in names}, out / file, metadata={"format": "pt", "step": str(step)})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(split.filename_to_tensors)


def write_tokenizer(tokenizer: Path, out: Path, seq_len: int, copy) -> None:
    """tokenizer.json (through `copy`, which refuses anything but a regular file) and the config that makes
    AutoTokenizer read it as a fast tokenizer."""
    copy(tokenizer, out / TOKENIZER_FILE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT_TOKEN, "model_max_length": seq_len,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def eot_id_of(tokenizer: Path) -> int | None:
    if not tokenizer.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer)).token_to_id(EOT_TOKEN)


def write_hf_export(out: Path, model_cfg, state: dict[str, torch.Tensor], seq_len: int, step: int | None,
                    tokenizer: Path, copy, max_shard_size: int | str) -> str:
    """Every file of the export into the (new, empty) directory `out`; returns a summary of what was written."""
    eot_id = eot_id_of(tokenizer)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model_cfg, seq_len, eot_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}, indent=2) + "\n")
    code = write_bundle(out)
    shards = write_weights(state, out, max_shard_size, step)
    if tokenizer.is_file():
        write_tokenizer(tokenizer, out, seq_len, copy)
    return f"{shards} safetensors shard{'s' if shards > 1 else ''}, {len(code)} code files"


def is_hf_export(path: Path) -> bool:
    """A directory trainer.export format=hf wrote (config.json of model_type attnres), read as JSON only."""
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
            raise HFExportError(f"{file} is not a weights file of the export {path}; re-export with trainer.export")
        try:
            state.update(load_file(file))
        except (OSError, SafetensorError) as error:
            raise HFExportError(f"{file} could not be read ({str(error).splitlines()[0]})") from None
    outside = [name for name in state if not name.startswith(PREFIX)]
    if outside:
        raise HFExportError(f"{path}: weight {outside[0]} is not under {PREFIX!r}; not an AttnRes export")
    return {name[len(PREFIX):]: tensor for name, tensor in state.items()}
