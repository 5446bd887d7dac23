"""AR-Retrofit: start a run from another run's weights (`init_from`) and train only part of the model
(`train.trainable`, `train.unfreeze_after`).

init_from loads a trained run's model weights into a freshly built model before step 1 (never on resume):
from a run, one of its checkpoints, a Hugging Face export (inference.export format=hf, read as safetensors), or a
released Kimi checkpoint directory (Kimi Linear or K3 as published, read through trainer/kimi/; the run's model
config must compute what the release's does, up to the residual mixer: the one line of a mismatch lists the
overrides that make it so).
Every parameter and buffer of the source must exist in the target with the same shape; the target may
add only depth-read parameters (`*_res.*`, `final_res.*`), which keep their fresh initialisation: zero
pseudo-queries and unit key-norm gains make every read the uniform average of its sources, which is the
baseline's running sum divided by the number of sources, and the sublayer's RMSNorm (and the final norm)
removes that factor. So a baseline loaded into Full or Block AttnRes computes the baseline's function up
to the norms' eps (tests/trainer/test_retrofit.py measures how far).

Freezing is requires_grad=False: a frozen parameter gets no gradient, and AdamW skips parameters without
one entirely (no moment update, no weight decay), so it stays bitwise unchanged. The optimizer is built
over every parameter first, so an unfrozen parameter simply starts getting gradients; its AdamW state
starts at that step. A checkpoint holds optimizer state only for the parameters that have stepped; the
trainer sets the trainable set for the checkpoint's step before loading it, so a resume sees the same
set the saving run had.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from model import build_model
from model.norms import RMSNorm
from trainer.run_dir.checkpoint import CheckpointError, resolve_checkpoint
from trainer.config import ConfigError, TrainConfig
from trainer.kimi.config import function_differences
from trainer.kimi.load import RELEASE_ERRORS, is_release_dir, open_release, read_into
from trainer.weights import WeightsError, check_finite, is_hf_export, read_hf_state

TRAINABLE = ("all", "residual", "norms")


def is_depth_read(name: str) -> bool:
    """Parameters of an AttnRes depth read (a sublayer's attn_res / mlp_res, or the final read)."""
    return "_res." in name or name.startswith("final_res.")


def _norm_gains(model: nn.Module) -> set[str]:
    return {f"{module_name}.weight" if module_name else "weight"
            for module_name, module in model.named_modules() if isinstance(module, RMSNorm)}


def selected(model: nn.Module, mode: str) -> set[str]:
    """Names of the parameters `train.trainable=mode` trains."""
    names = [name for name, _ in model.named_parameters()]
    if mode == "all":
        return set(names)
    if mode == "residual":
        return {name for name in names if is_depth_read(name)}
    gains = _norm_gains(model)
    return {name for name in names if name in gains}


def all_trainable_at(train: TrainConfig, step: int) -> bool:
    """Whether the optimizer step after `step` completed steps trains every parameter."""
    return train.trainable == "all" or (train.unfreeze_after is not None and step >= train.unfreeze_after)


def set_trainable(model: nn.Module, train: TrainConfig, step: int) -> tuple[int, int]:
    """requires_grad for the step after `step` completed steps; returns (trainable, total) parameter counts."""
    keep = None if all_trainable_at(train, step) else selected(model, train.trainable)
    trainable = total = 0
    for name, param in model.named_parameters():
        param.requires_grad_(keep is None or name in keep)
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total


def describe_trainable(trainable: int, total: int, train: TrainConfig) -> str:
    unfreeze = f", all from step {train.unfreeze_after + 1}" if train.unfreeze_after is not None else ""
    return (f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%; "
            f"train.trainable={train.trainable}{unfreeze})")


def check_layout(train: TrainConfig, init_from: str | None, world_size: int, tp: int, fsdp: int) -> None:
    """Retrofitting copies whole tensors (a Kimi release excepted: each rank reads its own part) and freezes by
    requires_grad: refuse layouts where that is wrong."""
    if init_from is not None and (tp > 1 or fsdp > 1) and not is_release_dir(Path(init_from)):
        raise ConfigError(f"init_from={init_from} loads whole tensors; it is not supported with parallel.tp > 1 "
                          "or parallel.fsdp > 1 (retrofit on one process or with dp/pp)")
    if train.trainable != "all" and world_size > 1:
        raise ConfigError(f"train.trainable={train.trainable} needs a single process (DDP and the sharded engines "
                          "register their parameters once); use train.trainable=all with more processes")


def _source_state(path: Path) -> dict[str, torch.Tensor]:
    """The source's model state (parameters and persistent buffers): a Hugging Face export's safetensors, or a
    checkpoint through the checkpoint loader; finite, as inference.generate checks an export (one NaN weight
    would make every loss NaN)."""
    from trainer.trained import load_trained

    try:
        state = read_hf_state(path) if is_hf_export(path) else load_trained(path).model.state_dict()
        check_finite(state, path)
    except WeightsError as error:
        raise CheckpointError(f"init_from={path}: {error}") from None
    return state


def _check_source(init_path: str, source: dict[str, torch.Size], target: dict[str, torch.Tensor]) -> None:
    """Every tensor of the source (name -> shape) in the target with its shape; the target adds only depth reads."""
    for name, shape in source.items():
        if name not in target:
            raise CheckpointError(f"init_from={init_path}: {name} of the source does not exist in this model; "
                                  "the source must be the same model up to the depth reads")
        if target[name].shape != shape:
            raise CheckpointError(f"init_from={init_path}: {name} has shape {tuple(shape)} in the source and "
                                  f"{tuple(target[name].shape)} here; the source must be the same model up to the depth reads")
    added = [name for name in target if name not in source and not is_depth_read(name)]
    if added:
        raise CheckpointError(f"init_from={init_path}: this model's {added[0]} is not in the source and is not a "
                              "depth read (only *_res.* and final_res.* may be new)")


def _init_from_release(model: nn.Module, init_path: str) -> Path:
    """A Kimi release into `model`, whose config must compute the release's function up to the residual mixer
    (a retrofit adds depth reads, which keep their fresh zero queries); one tensor at a time, each rank reading
    only the part of it that the layout left there (tp/ep slices, FSDP shards, a pipeline stage's blocks)."""
    path = Path(init_path)
    try:
        release = open_release(path)
        differences = function_differences(model.cfg, release.model_config)
        if differences:
            raise ConfigError(f"init_from={init_path}: this run's model computes another function than the release's; "
                              f"set {' '.join(differences)}")
        # Checked on the whole models (meta): a rank of a layout holds only part of its own.
        source = build_model(release.model_config, device="meta").state_dict()
        _check_source(init_path, {name: tensor.shape for name, tensor in source.items()},
                      build_model(model.cfg, device="meta").state_dict())
        read_into(model, release)
    except RELEASE_ERRORS as error:
        raise CheckpointError(f"init_from={init_path}: {error}") from None
    return path


def init_from(model: nn.Module, init_path: str) -> Path:
    """Copy the weights of `init_path` (a checkpoint or run directory, a Hugging Face export or a Kimi release) into
    `model`; returns the checkpoint, export or release read."""
    if not Path(init_path).exists():
        raise ConfigError(f"init_from={init_path} does not exist; give a run directory, one of its checkpoints or "
                          "a inference.export format=hf directory")
    if is_release_dir(Path(init_path)):
        return _init_from_release(model, init_path)
    path = Path(init_path) if is_hf_export(Path(init_path)) else resolve_checkpoint(init_path)
    source = _source_state(path)
    target = model.state_dict()
    _check_source(init_path, {name: tensor.shape for name, tensor in source.items()}, target)
    with torch.no_grad():
        for name, tensor in source.items():
            target[name].copy_(tensor)
    return path


def update_moe_bias(model: nn.Module, train: TrainConfig, step: int) -> None:
    """The MoE expert bias is part of the frozen backbone's routing: it moves only while every parameter
    trains (in the optimizer step after `step` completed ones). The load counts restart each step either way."""
    if all_trainable_at(train, step):
        model.update_moe_bias()
        return
    for moe in model.moe_layers():
        moe.load_counts.zero_()
