"""Read a released Kimi checkpoint directory (Kimi Linear or K3, Hugging Face layout) into our model: config.json
through trainer/kimi/config.py, the weights through the name table (trainer/kimi/names.py), tensor by tensor
from the memory-mapped safetensors (trainer/kimi/files.py). JSON and safetensors only: the release's Python
code is never imported or run.

Everything is checked from config.json and the safetensors headers before a weight is read: every tensor our
model needs is there with its shape, and every tensor there maps onto our model (K3's vision tower and
projector are skipped, with one line that says so).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from model import build_model
from parallel.fill import fill_held_regions
from trainer.kimi.config import LAYOUTS, ReleaseConfig, ReleaseConfigError, release_config
from trainer.kimi.files import ReleaseFiles, ReleaseFilesError
from trainer.kimi.quantized import QuantizedWeightError
from trainer.kimi.names import (A_LOG, EXPERTS, QUERY, SAME, SKIPPED_PREFIXES, UNUSED, Mapped, NameTableError, map_name,
                                to_ours)
from trainer.weights import WeightsError, non_finite_count

CONFIG_FILE = "config.json"
RELEASE_ERRORS = (ReleaseConfigError, ReleaseFilesError, NameTableError, QuantizedWeightError, WeightsError)


def is_release_dir(path: Path) -> bool:
    """A directory whose config.json (read as JSON only) is a Kimi release's: model_type kimi_linear or kimi_k3."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in LAYOUTS


@dataclass
class Release:
    directory: Path
    config: ReleaseConfig
    files: ReleaseFiles

    @property
    def model_config(self):
        return self.config.model

    @cached_property
    def mapped(self) -> dict[str, "Mapped"]:
        """Our tensor name -> its Mapped: plan() on the release's model built on meta, so checked against the
        files' headers once, before any weight is read."""
        return {m.ours: m for m in plan(self, build_model(self.model_config, device="meta").state_dict())}


def open_release(directory: str | Path) -> Release:
    """config.json and the weights' index of a release directory, checked; no weight is read."""
    directory = Path(directory)
    where = directory / CONFIG_FILE
    try:
        raw = json.loads(where.read_text())
    except (OSError, ValueError) as error:
        raise ReleaseConfigError(f"{where} could not be read ({str(error).splitlines()[0]})") from None
    try:
        config = release_config(raw, str(where))
    except (KeyError, TypeError) as error:
        raise ReleaseConfigError(f"{where} lacks or mistypes a key the decoder needs ({error})") from None
    return Release(directory, config, ReleaseFiles(directory, config.quantization))


def plan(release: Release, state: dict[str, torch.Tensor]) -> list[Mapped]:
    """The name table applied to `state` (our names -> tensors, meta is enough), checked against the files'
    headers: each release tensor present with the shape its transform needs, and none left over."""
    files, mapped = release.files, [map_name(name, tensor.shape, release.config) for name, tensor in state.items()]
    wanted = {stored: m for m in mapped for name in m.release for stored in files.stored_names(name)}
    present = files.names()
    missing = sorted(set(wanted) - present)
    if missing:
        raise NameTableError(f"{release.directory} has no tensor {missing[0]}, which our "
                             f"{wanted[missing[0]].ours} is read from")
    leftover = sorted(name for name in present - set(wanted) if not _skipped(release, name))
    if leftover:
        raise NameTableError(f"{release.directory} holds {leftover[0]}, which maps onto nothing this model builds; "
                             "the checkpoint is refused rather than imported without it")
    for m in mapped:
        if m.transform in (QUERY, UNUSED) or not m.release or files.quantized(m.release[0]):
            continue
        expected = list(state[m.ours].shape)
        if m.transform == EXPERTS:
            expected = [expected[2], expected[1]]  # each expert's Linear [out, in]
        found = files.shape(m.release[0])
        if m.transform != A_LOG and found != expected:
            raise NameTableError(f"{release.directory}: {m.release[0]} has shape {found}, our {m.ours} needs "
                                 f"{expected} ({release.directory / CONFIG_FILE} and the weights disagree)")
    return mapped


def _skipped(release: Release, name: str) -> bool:
    """Whether the release tensor `name` belongs to what no decoder reads (K3's vision tower and projector)."""
    return name.startswith(SKIPPED_PREFIXES) or name.removeprefix(release.config.prefix).startswith(SKIPPED_PREFIXES)


def skipped_note(release: Release) -> str | None:
    """The one line saying what of a K3 release is not imported (its vision tower and projector)."""
    skipped = [name for name in release.files.names() if _skipped(release, name)]
    if not skipped:
        return None
    return (f"{release.directory}: skipping the vision tower and projector ({len(skipped)} tensors); only the text "
            "decoder is imported")


def _check_finite(release: Release, name: str, tensor: torch.Tensor) -> torch.Tensor:
    bad = non_finite_count(tensor, name, release.directory) if tensor.is_floating_point() else 0
    if bad:
        raise WeightsError(f"{release.directory}: tensor {name} holds {bad:,} non-finite values (NaN or inf)")
    return tensor


def read_region(release: Release, mapped: Mapped, shape: tuple[int, ...],
                index: tuple[slice, ...]) -> torch.Tensor | None:
    """`index` of our tensor `mapped.ours` (whole: `shape`) from the release, reading no more of a plain tensor
    than that (None: keep ours, for an unused one). Expert stacks read only the experts in `index`, each of
    them only its rows and columns unless it is packed (MXFP4 is dequantised whole, one expert at a time)."""
    files, transform = release.files, mapped.transform
    if transform == UNUSED:
        return None
    if transform == EXPERTS:
        rows, cols = index[1], index[2]
        tensors = []
        for name in mapped.release[index[0]]:
            if files.quantized(name):
                held = files.weight(name)[cols, rows]  # dequantised whole, then the held (out, in) part
            else:
                held = files.slice(name, (cols, rows))  # (out, in) of the held part
            tensors.append(_check_finite(release, name, held))
        return to_ours(mapped, tensors, torch.Size(shape), str(release.directory))
    if transform == SAME and not files.quantized(mapped.release[0]):
        name = mapped.release[0]
        return _check_finite(release, name, files.slice(name, index))
    tensors = [_check_finite(release, name, files.weight(name)) for name in mapped.release]
    ours = to_ours(mapped, tensors, torch.Size(shape), str(release.directory))
    if ours.shape != torch.Size(shape):
        raise NameTableError(f"{release.directory}: {mapped.release[0]} gives {mapped.ours} the shape "
                             f"{list(ours.shape)}, this model's is {list(shape)}")
    return ours[index]


def read_into(model: nn.Module, release: Release) -> None:
    """Copy the release's weights into `model` (the release's model, or one that adds to it, such as depth reads,
    which keep their values), one tensor at a time, each rank reading only the part it holds
    (parallel.fill.fill_held_regions: tp/ep slices, FSDP shards, a pipeline stage's blocks)."""
    note = skipped_note(release)
    if note:
        print(note, file=sys.stderr)
    mapped = release.mapped
    fill_held_regions(model, set(mapped), lambda name, shape, index: read_region(release, mapped[name], shape, index))


def load_release_model(release: Release) -> nn.Module:
    """The release's model, fp32 on the CPU in eval mode, with its weights."""
    release.mapped  # checked before allocating anything
    model = build_model(release.model_config)
    read_into(model, release)
    return model.eval()
