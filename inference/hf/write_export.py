"""Write and read a Hugging Face export: `python -m inference.export checkpoint=RUN out=DIR format=hf`.

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
from safetensors.torch import save_file

from trainer.data import EOT_TOKEN
from inference.checkpoint_reader import CheckpointTensors, StateTensors
from inference.hf.bundle import write_bundle
from trainer.weights import CONFIG_FILE, INDEX_FILE, PREFIX, WEIGHTS_PATTERN

TOKENIZER_FILE = "tokenizer.json"
AUTO_MAP = {"AutoConfig": "configuration_attnres.AttnResConfig",
            "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM"}


def hf_config(model_cfg, seq_len: int, eot_id: int | None) -> dict:
    """config.json of the export, as transformers' AttnResConfig would write it."""
    from inference.hf.configuration_attnres import AttnResConfig

    config = AttnResConfig(attnres_model=dataclasses.asdict(model_cfg), max_position_embeddings=seq_len,
                           eos_token_id=eot_id, architectures=["AttnResForCausalLM"])
    config.auto_map = AUTO_MAP
    return config.to_dict()


def write_weights(tensors: CheckpointTensors | StateTensors, out: Path, max_shard_size: int | str,
                  step: int | None) -> int:
    """Our Decoder's state under AttnResForCausalLM's names, in shards of at most max_shard_size, each read from
    `tensors` only when it is written; returns the number of shard files."""
    named = {PREFIX + name: tensor for name, tensor in tensors.meta().items()}
    split = split_torch_state_dict_into_shards(named, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        shard = tensors.read([name[len(PREFIX):] for name in names])
        save_file({PREFIX + name: tensor for name, tensor in shard.items()}, out / file,
                  metadata={"format": "pt", "step": str(step)})
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


def write_hf_export(out: Path, model_cfg, state: dict[str, torch.Tensor] | CheckpointTensors, seq_len: int,
                    step: int | None, tokenizer: Path, copy, max_shard_size: int | str) -> str:
    """Every file of the export into the (new, empty) directory `out`; returns a summary of what was written.
    `state`: our Decoder's state dict, or a checkpoint's tensors to read a shard at a time."""
    eot_id = eot_id_of(tokenizer)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model_cfg, seq_len, eot_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}, indent=2) + "\n")
    code = write_bundle(out)
    shards = write_weights(StateTensors(state) if isinstance(state, dict) else state, out, max_shard_size, step)
    if tokenizer.is_file():
        write_tokenizer(tokenizer, out, seq_len, copy)
    return f"{shards} safetensors shard{'s' if shards > 1 else ''}, {len(code)} code files"
