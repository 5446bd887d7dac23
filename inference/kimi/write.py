"""Our checkpoint in the released Kimi models' format: `python -m inference.export checkpoint=RUN out=DIR format=kimi`.

The directory holds what the engines that serve Kimi models read:
  config.json               Kimi Linear's flat config (the baseline) or K3's, the decoder under text_config (Block
                            AttnRes with K3's read); trainer/kimi/config.py's release_json. No vision tower and no
                            remote code (auto_map): the engines carry their own Kimi model code
  model-0000K-of-0000N.safetensors + model.safetensors.index.json (model.safetensors when one shard holds it
                            all), the release's tensor names (trainer/kimi/names.py), in the checkpoint's dtype
  tokenizer.json + tokenizer_config.json, generation_config.json (eos_token_id), when the run has a tokenizer

The checkpoint is read a shard at a time (inference/checkpoint_reader.py), so the host holds about one shard of
max_shard_size, never the model. What the format cannot hold is refused in one line before anything is written.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.config import ModelConfig
from trainer.kimi.config import ReleaseConfig, export_layout, release_json
from trainer.kimi.files import INDEX_FILE, SINGLE_FILE
from trainer.kimi.names import ABSENT, Mapped, map_name, to_release
from inference.checkpoint_reader import CheckpointTensors
from inference.hf.write_export import eot_id_of, write_tokenizer

SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"


def _release_plan(mapped: list[Mapped], meta_state: dict[str, torch.Tensor],
                  release: ReleaseConfig) -> list[tuple[str, Mapped, int]]:
    """(release name, the mapping it comes from, bytes) of every tensor the export writes, in our state's order;
    the shapes come from the transforms applied to the meta tensors (nothing is read)."""
    planned = []
    for m in mapped:
        if m.transform == ABSENT:
            continue
        for name, tensor in to_release(m, meta_state[m.ours], release):
            planned.append((name, m, tensor.numel() * tensor.element_size()))
    return planned


def _shards(planned: list[tuple[str, Mapped, int]], max_bytes: int) -> list[list[tuple[str, Mapped, int]]]:
    """Consecutive tensors packed into shards of at most max_bytes (a larger tensor alone in its own)."""
    shards, current, size = [], [], 0
    for item in planned:
        if current and size + item[2] > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[2]
    return shards + ([current] if current else [])


def write_kimi_export(out: Path, model_cfg: ModelConfig, checkpoint: CheckpointTensors, seq_len: int,
                      step: int | None, tokenizer: Path, copy, max_shard_size: int) -> str:
    """Every file of the export into the (new, empty) directory `out`; returns a summary of what was written."""
    eot_id = eot_id_of(tokenizer)
    token_ids = {"bos_token_id": None, "eos_token_id": eot_id, "pad_token_id": None}
    release = ReleaseConfig(model_cfg, export_layout(model_cfg), seq_len, token_ids, None)
    meta_state = checkpoint.meta()
    mapped = [map_name(name, tensor.shape, release) for name, tensor in meta_state.items()]
    absent = [m for m in mapped if m.transform == ABSENT]
    loaded = checkpoint.read([m.ours for m in absent])
    for m in absent:  # refused before a file is written if the format cannot hold it
        to_release(m, loaded[m.ours], release)
    shards = _shards(_release_plan(mapped, meta_state, release), max_shard_size)
    dtype = next(iter(meta_state.values())).dtype
    config = {**release_json(model_cfg, seq_len, token_ids), "dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        file = SINGLE_FILE if len(shards) == 1 else SHARD_PATTERN.format(index=index, count=len(shards))
        sources = {m.ours: m for _, m, _ in shard}  # our tensors this shard's release tensors come from
        ours = checkpoint.read(list(sources))
        wanted = {name for name, _, _ in shard}  # an expert stack may spread over shards: only this one's experts
        tensors = {}
        for source, m in sources.items():
            tensors.update((name, tensor) for name, tensor in to_release(m, ours.pop(source), release)
                           if name in wanted)
        save_file(tensors, out / file, metadata={"format": "pt", "step": str(step)})
        weight_map.update({name: file for name in tensors})
        total += sum(size for _, _, size in shard)
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
    if tokenizer.is_file():
        write_tokenizer(tokenizer, out, seq_len, copy)
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}, indent=2) + "\n")
    return (f"{len(shards)} safetensors shard{'s' if len(shards) > 1 else ''} in the {release.layout} layout "
            f"({total:,} bytes)")
