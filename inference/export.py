"""Export a checkpoint's weights for inference: `python -m inference.export checkpoint=RUN_OR_CKPT out=DIR`

Options (key=value):
  checkpoint=     (required) a run directory (its newest checkpoint) or one checkpoint directory
                  (runs/NAME/checkpoints/step_XXXXXXXX). DCP checkpoints are pickle-based: export
                  only checkpoints you trust.
  out=            (required) the export directory to write; it must not exist or be empty
  overwrite=false replace an existing export in out (a directory holding only an export's files: anything
                  else in it is refused, never deleted)
  format=native   native: the files below, for inference.generate and inference.evaluate; hf: a Hugging Face
                  transformers model (inference/hf/write_export.py), loaded with
                  AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True); kimi: the released Kimi
                  models' layout (inference/kimi/write.py) for the engines that serve them: Kimi Linear's for the
                  baseline, K3's for Block AttnRes with K3's read (anything else is refused)
  max_shard_size=5GB  the largest safetensors file of format=hf and format=kimi (bytes, or a number with KB, MB
                  or GB); larger weights are split into shards with an index. Every format reads the checkpoint
                  about this much at a time, so the host never holds the whole model

format=native writes (a temporary directory renamed into place, so a failure leaves nothing half-written):
  out/model.safetensors  the model's weights and buffers (safetensors: plain tensors, no code); its header
                         records the step and the trained context (train.seq_len)
  out/config.json        {"config": the run's full config, "step", "source", "model_fingerprint"}
  out/tokenizer.json     a copy of the run's tokenizer, when the run has one (a regular file: a symlink
                         is refused, so a link planted in a run cannot copy its target into the export);
                         the run is the one the checkpoint lies in once links are resolved, and a tokenizer
                         other than the one the checkpoint's meta.json records (tokenizer_sha256) is refused
`python -m inference.generate model=out prompt=...` then loads only these files, and refuses a config.json
that no longer matches its model_fingerprint or the context recorded in model.safetensors.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from model.config import ModelConfig
from model.params import config_counts
from trainer.run_dir.checkpoint import CheckpointError, check_model_shapes, read_meta, resolve_checkpoint, verify_checkpoint
from trainer.files.safe_io import LinkedPathError, check_still, held_path, open_dir
from trainer.data.format import sha256_file
from trainer.kimi.config import ReleaseConfigError, export_layout
from trainer.kimi.load import is_release_dir
from trainer.kimi.names import NameTableError
from trainer.trained import run_config
from trainer.weights import WeightsError, check_finite, is_hf_export
from inference.checkpoint_reader import CheckpointTensors
from inference.hf.write_export import write_hf_export
from inference.kimi.write import write_kimi_export
from inference.safetensors_writer import write_streaming

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
EXPORT_FILES = (MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE)
# The trained context an export without a recorded one (written before exports recorded it) may claim:
# Kimi Linear's 1M tokens.
MAX_CONTEXT = 2 ** 20
HELP_FLAGS = ("-h", "--help")
FORMATS = ("native", "hf", "kimi")
SHARD_SIZE = re.compile(r"[1-9][0-9]*([KMG]B)?")
# What an export of each format writes, so overwrite=true replaces nothing else.
HF_EXPORT_SUFFIXES = (".py", ".json", ".safetensors")
KIMI_EXPORT_SUFFIXES = (".json", ".safetensors")
SIZE_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}  # as huggingface_hub reads max_shard_size


class ExportError(ValueError):
    """A bad export request or an unreadable export; the message is one line."""


@dataclass
class ExportArgs:
    checkpoint: str | None = None
    out: str | None = None
    overwrite: bool = False
    format: str = "native"
    max_shard_size: str = "5GB"


def parse_key_values(argv: list[str], schema: type, error: type[Exception]):
    """key=value arguments -> an instance of the dataclass `schema`; `error` (one line) on anything else.

    A string field takes its value verbatim (prompt=ROMEO: is the text "ROMEO:", not a YAML mapping, and
    "${...}" is not an interpolation); the others are parsed as YAML scalars (max_new_tokens=40)."""
    fields = {field.name: field for field in dataclasses.fields(schema)}
    verbatim, typed = {}, []
    for arg in argv:
        if "=" not in arg:
            raise error(f"argument {arg!r} is not key=value; valid keys: {', '.join(fields)} (--help prints the usage)")
        key, value = arg.split("=", 1)
        if key not in fields:
            raise error(f"unknown key {key!r}; valid keys: {', '.join(fields)}")
        if str(fields[key].type) in ("str", "str | None", "<class 'str'>"):  # not list[str]: a YAML list
            verbatim[key] = value
        else:
            typed.append(arg)
    try:
        parsed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(typed)))
    except OmegaConfBaseException as failure:
        where = f"{failure.full_key}: " if getattr(failure, "full_key", None) else ""
        raise error(where + str(failure).splitlines()[0]) from None
    return dataclasses.replace(parsed, **verbatim)


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory of runs/NAME/checkpoints/step_XXXXXXXX (where the trainer keeps tokenizer.json)."""
    return checkpoint.parent.parent


def safetensors_ready(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage: safetensors refuses shared (tied) tensors, so a
    second name of a storage gets its own copy and every name still loads with strict=True."""
    ready, seen = {}, set()
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        ready[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return ready


def _is_export(out: Path, format: str) -> bool:
    if format == "kimi":
        return is_release_dir(out)
    return is_hf_export(out) if format == "hf" else (out / MODEL_FILE).is_file()


def _written_by_export(name: str, format: str) -> bool:
    if format == "kimi":
        return name.endswith(KIMI_EXPORT_SUFFIXES)
    return name.endswith(HF_EXPORT_SUFFIXES) if format == "hf" else name in EXPORT_FILES


def shard_bytes(max_shard_size: str) -> int:
    """max_shard_size (checked by check_format) in bytes."""
    unit = max_shard_size[-2:]
    return int(max_shard_size[:-2]) * SIZE_UNITS[unit] if unit in SIZE_UNITS else int(max_shard_size)


def _check_out(out: Path, overwrite: bool, format: str) -> None:
    """out may be new, empty, or (with overwrite) an export of `format` and nothing else: replacing it removes
    the whole directory, so a directory holding anything more is refused rather than emptied."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"out={out} is a file; give a directory to create")
    if out.is_dir() and any(out.iterdir()):
        if not _is_export(out, format):
            kind = f"a format={format} export" if format != "native" else "an export"
            raise ExportError(f"out={out} is a non-empty directory that is not {kind}; pick another out")
        foreign = sorted(f"{entry.name}/" if entry.is_dir() and not entry.is_symlink() else entry.name
                         for entry in out.iterdir()
                         if not _written_by_export(entry.name, format) or (entry.is_dir() and not entry.is_symlink()))
        if foreign:
            suffixes = {"hf": HF_EXPORT_SUFFIXES, "kimi": KIMI_EXPORT_SUFFIXES}.get(format)
            owned = ", ".join(f"*{suffix}" for suffix in suffixes) if suffixes else ", ".join(EXPORT_FILES)
            raise ExportError(f"out={out} holds {', '.join(foreign)} besides an export; an export replaces only "
                              f"{owned}: move the rest away or pick another out")
        if not overwrite:
            raise ExportError(f"out={out} already holds an export; pass overwrite=true to replace it")


def check_format(format: str, max_shard_size: str) -> None:
    if format not in FORMATS:
        raise ExportError(f"format={format!r} is not one of {' | '.join(FORMATS)}")
    if not SHARD_SIZE.fullmatch(max_shard_size):
        raise ExportError(f"max_shard_size={max_shard_size!r} is not a size: give bytes (1000000) or a number "
                          "with KB, MB or GB (5GB)")


def _check_tokenizer(tokenizer: Path, meta: dict) -> None:
    """The run's tokenizer.json is copied only when it is a regular file: a symlink would copy whatever it
    points at (a key, a password file) into an export meant to be shared. A checkpoint that records the
    sha256 of the tokenizer it was trained with gets that one or none: another would encode text into ids
    the model never learnt."""
    if tokenizer.is_symlink():
        raise ExportError(f"{tokenizer} is a symlink (to {os.readlink(tokenizer)}); export copies only regular "
                          "files: replace the link with a copy of the tokenizer")
    if tokenizer.exists() and not tokenizer.is_file():
        raise ExportError(f"{tokenizer} is not a regular file; export copies only a regular tokenizer.json")
    recorded = meta.get("tokenizer_sha256")
    found = sha256_file(tokenizer) if recorded is not None and tokenizer.is_file() else recorded
    if found != recorded:
        raise ExportError(f"{tokenizer} is not the tokenizer this checkpoint was trained with (its sha256 is "
                          f"{found}, meta.json records {recorded}); put the run's own tokenizer.json back, or "
                          "export from the run directory it was trained in")


def _copy_regular_file(source: Path, target: Path) -> None:
    """Copy `source`, refusing a symlink or special file even if one replaced it since _check_tokenizer."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise ExportError(f"{source} cannot be copied as a regular file ({error.strerror})") from None
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ExportError(f"{source} is not a regular file; export copies only a regular tokenizer.json")
        with target.open("xb") as writer:
            shutil.copyfileobj(reader, writer)


def _make_tmp(out: Path) -> tuple[Path, int]:
    """The temporary directory beside out, and a descriptor holding it (safe_io.open_dir): the export is
    written through its held_path, so a link planted at its name meanwhile receives nothing."""
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp, open_dir(out.parent, tmp.name)
    except (OSError, LinkedPathError) as error:
        raise ExportError(f"out={out} cannot be written ({error})") from None


def _put_in_place(tmp: Path, held: Path, out: Path) -> None:
    """Rename tmp, the directory `held` holds, to out; an export being replaced is moved aside first, so out
    is never half-written."""
    try:
        check_still(held, tmp, tmp)
    except LinkedPathError as error:
        raise ExportError(f"out={out} was not written: {error}") from None
    old = out.with_name(f".old-{out.name}-{os.getpid()}")
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write(tmp: Path, held: Path, out: Path, write_files) -> str:
    """write_files(held), then tmp (which `held` holds) renamed into place as out; returns what write_files
    says it wrote."""
    try:
        written = write_files(held)
        _put_in_place(tmp, held, out)
        return written
    except OSError as error:
        raise ExportError(f"out={out} cannot be written ({error})") from None


def _write_native(tmp: Path, tensors: CheckpointTensors, meta: dict, tokenizer: Path, batch_bytes: int) -> str:
    """model.safetensors written tensor by tensor as the checkpoint is read (about batch_bytes at a time)."""
    write_streaming(tmp / MODEL_FILE, tensors.specs, {"format": "pt", "step": str(meta.get("step")),
                                                      "seq_len": str(meta["config"]["train"]["seq_len"])},
                    tensors.read, batch_bytes)
    described = {"config": meta["config"], "step": meta.get("step"), "source": str(tensors.path.resolve()),
                 "model_fingerprint": meta.get("model_fingerprint")}
    (tmp / CONFIG_FILE).write_text(json.dumps(described, indent=2) + "\n")
    if tokenizer.is_file():
        _copy_regular_file(tokenizer, tmp / TOKENIZER_FILE)
    return f"{(tmp / MODEL_FILE).stat().st_size:,} bytes in {MODEL_FILE}"


def _write_format(tmp: Path, format: str, tensors: CheckpointTensors, model_cfg: ModelConfig, meta: dict,
                  tokenizer: Path, max_shard_size: str) -> str:
    seq_len, step, size = meta["config"]["train"]["seq_len"], meta.get("step"), shard_bytes(max_shard_size)
    if format == "native":
        return _write_native(tmp, tensors, meta, tokenizer, size)
    if format == "hf":
        return write_hf_export(tmp, model_cfg, tensors, seq_len, step, tokenizer, _copy_regular_file, size)
    return write_kimi_export(tmp, model_cfg, tensors, seq_len, step, tokenizer, _copy_regular_file, size)


def _open_checkpoint(path: Path, format: str) -> tuple[ModelConfig, CheckpointTensors]:
    """The checkpoint's files verified, its model config, and its tensors ready to be read a few at a time; the
    Kimi format's refusals (a variant it cannot hold) come here, before anything is read or written."""
    meta = verify_checkpoint(path)
    model_cfg = run_config(path, meta).model
    check_model_shapes(path, model_cfg)
    if format == "kimi":
        try:
            export_layout(model_cfg)
        except ReleaseConfigError as error:
            raise ExportError(str(error)) from None
    return model_cfg, CheckpointTensors(path, model_cfg)


def export(checkpoint: str, out: str, overwrite: bool = False, format: str = "native",
           max_shard_size: str = "5GB") -> str:
    """Write the export of `checkpoint` to `out` in `format`; returns the one-line summary."""
    check_format(format, max_shard_size)
    # Resolved first: the run directory whose tokenizer.json goes with a linked step_N is the one it lies in,
    # not the one beside the link.
    path = resolve_checkpoint(Path(checkpoint).resolve())
    meta = read_meta(path)
    out_dir = Path(out)
    _check_out(out_dir, overwrite, format)
    tokenizer = run_dir_of(path) / TOKENIZER_FILE
    _check_tokenizer(tokenizer, meta)
    model_cfg, tensors = _open_checkpoint(path, format)
    tmp, handle = _make_tmp(out_dir)  # before reading weights, so an unwritable out fails at once
    held = held_path(handle)
    try:
        written = _write(tmp, held, out_dir, lambda into: _write_format(into, format, tensors, model_cfg, meta,
                                                                        tokenizer, max_shard_size))
    except NameTableError as error:
        raise ExportError(str(error)) from None
    finally:
        os.close(handle)
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename; a link there is left
    parameters = config_counts(model_cfg).total
    if tokenizer.is_file():
        note = ""
    elif format != "native":
        note = f"; no {TOKENIZER_FILE} in {run_dir_of(path)}, so the export has no tokenizer"
    else:
        note = f"; no {TOKENIZER_FILE} in {run_dir_of(path)}, pass tokenizer= to generate"
    return (f"exported step {meta.get('step')} of {path} to {out_dir} (format={format}): {parameters:,} parameters, "
            f"{written}{note}")


def read_export_config(export_dir: Path) -> dict:
    """config.json of an export (JSON only: nothing in it can run code)."""
    try:
        described = json.loads((export_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"{export_dir / CONFIG_FILE} could not be read ({str(error).splitlines()[0]})") from None
    if not isinstance(described, dict) or not isinstance(described.get("config"), dict):
        raise ExportError(f"{export_dir / CONFIG_FILE} has no \"config\" object; re-export with inference.export")
    step = described.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ExportError(f"{export_dir / CONFIG_FILE} has step {step!r}; expected an integer >= 0")
    for key in ("source", "model_fingerprint"):
        if not isinstance(described.get(key, ""), str):
            raise ExportError(f"{export_dir / CONFIG_FILE} has a {key} that is not a string")
    return described


def _unreadable(file: Path, error: Exception) -> ExportError:
    return ExportError(f"{file} could not be read ({str(error).splitlines()[0]})")


def check_trained_context(export_dir: Path, seq_len: int) -> None:
    """config.json's train.seq_len (the context generation may fill) must be the one model.safetensors
    recorded at export: an edited config.json would let generation run past the trained context. An export
    written before exports recorded it may claim at most MAX_CONTEXT."""
    file, config = export_dir / MODEL_FILE, export_dir / CONFIG_FILE
    try:
        with safe_open(file, "pt") as weights:
            recorded = (weights.metadata() or {}).get("seq_len")
    except (OSError, SafetensorError) as error:
        raise _unreadable(file, error) from None
    if recorded is None and not 0 < seq_len <= MAX_CONTEXT:
        raise ExportError(f"{config} has train.seq_len={seq_len}, not a trained context (1 to {MAX_CONTEXT:,} "
                          "tokens); restore it or re-export with inference.export")
    if recorded is not None and recorded != str(seq_len):
        raise ExportError(f"{config} has train.seq_len={seq_len} but {file} was trained at seq_len={recorded}; "
                          "restore config.json or re-export with inference.export")


def check_export_size(export_dir: Path, model_cfg: ModelConfig) -> None:
    """model.safetensors' own tensor sizes (its header: nothing is loaded) against the size of the model
    config.json builds, counted from the config alone: a config edited to a far larger model (its fingerprint
    recomputed) is refused here, before that model is built, rather than building it until memory runs out."""
    file = export_dir / MODEL_FILE
    try:
        with safe_open(file, "pt") as weights:
            held = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    except (OSError, SafetensorError) as error:
        raise _unreadable(file, error) from None
    built = config_counts(model_cfg).state
    if held != built:
        raise ExportError(f"{file} holds {held:,} weights but {export_dir / CONFIG_FILE} builds a model of {built:,} "
                          f"(model.n_blocks={model_cfg.n_blocks}, model.d_model={model_cfg.d_model}); restore "
                          "config.json or re-export with inference.export")


def read_exported_weights(model: torch.nn.Module, export_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, checked against `model` (built from the export's config.json, on the meta device so
    that nothing is sized by the config before the weights confirm it): every tensor present, of the model's
    shape, and finite."""
    file = export_dir / MODEL_FILE
    try:
        state = load_file(file)
    except (OSError, SafetensorError) as error:
        raise _unreadable(file, error) from None
    expected = model.state_dict()
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    reshaped = [f"{name} {tuple(state[name].shape)} vs {tuple(tensor.shape)}" for name, tensor in expected.items()
                if name in state and state[name].shape != tensor.shape]
    if missing or unexpected or reshaped:
        found = (("missing", missing), ("unexpected", unexpected), ("shape", reshaped))
        problems = [f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                    for label, names in found if names]
        raise ExportError(f"{file} does not match the model of {CONFIG_FILE} ({'; '.join(problems)})")
    try:
        check_finite(state, file)
    except WeightsError as error:
        raise ExportError(str(error)) from None
    return state


def run_cli(argv: list[str] | None, usage: str, work, errors: tuple[type[Exception], ...]) -> None:
    """The shape of our key=value CLIs: --help/-h prints `usage` and exits 0; otherwise print what
    work(argv) returns, and any of `errors` becomes one `error: ...` line and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in HELP_FLAGS for arg in argv):
        print(usage.strip())
        return
    try:
        print(work(argv))
    except errors as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def _export_cli(argv: list[str]) -> str:
    args = parse_key_values(argv, ExportArgs, ExportError)
    if not args.checkpoint or not args.out:
        raise ExportError("checkpoint= and out= are required, e.g. checkpoint=runs/train out=runs/train/export")
    return export(args.checkpoint, args.out, args.overwrite, args.format, args.max_shard_size)


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, __doc__, _export_cli, (ExportError, CheckpointError))


if __name__ == "__main__":
    main()
