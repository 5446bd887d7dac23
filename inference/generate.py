"""Generate text from an exported model: `python -m inference.generate model=EXPORT_DIR prompt="..." ...`

First export a checkpoint of your own run: `python -m inference.export checkpoint=runs/train out=runs/train/export`.
Generation loads only the export (model.safetensors + config.json: plain tensors and JSON, nothing that
runs code), never a training checkpoint, so an export from elsewhere is safe to load. An export whose
config.json no longer matches its model_fingerprint or the context model.safetensors was trained at, or
whose weights hold NaN or inf, is refused. A released Kimi checkpoint directory (Kimi Linear or K3 as
published: config.json, safetensors, tokenizer.json or tiktoken.model) is read in place (trainer/kimi/; its
Python code is never run), its context being config.json's max_position_embeddings.

Options (key=value, default after the =):
  model=            (required) an export directory written by inference.export, or a Kimi release directory
  checkpoint=       the older name of model=, still accepted
  prompt=           (required) the text to continue, encoded with the export's tokenizer
  max_new_tokens=64 tokens to generate (> 0); prompt + max_new_tokens must fit the trained context
                    (train.seq_len in the export's config.json)
  temperature=0.0   0 is greedy; > 0 samples from softmax(logits / temperature)
  top_p=1.0         nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]
  prefill_chunk=0   prompt tokens per prefill step (>= 0; 0 prefills the whole prompt at once)
  seed=0            sampling seed, in [0, 2**64 - 1]
  compile=False     True: torch.compile the one-token decode step (the first steps compile, then decode
                    is faster; greedy tokens are the same as without)
  variant=          optional: refuse an export of another residual variant (baseline|full|block|mhc)
  tokenizer=        tokenizer.json to use instead of the one in the export directory
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from model import build_model
from model.generation import generate
from trainer.run_dir.checkpoint import (CHECKPOINTS_DIR, DCP_METADATA, META_FILE, STEP_DIR, fingerprint_difference,
                                model_fingerprint)
from trainer.config import Config, ConfigError, config_from_saved
from trainer.data.format import tokenizer_vocab_size
from trainer.kimi.load import RELEASE_ERRORS, Release, is_release_dir, load_release_model, open_release
from inference.export import (CONFIG_FILE, MAX_CONTEXT, MODEL_FILE, TOKENIZER_FILE, ExportError, check_export_size,
                            check_trained_context, parse_key_values, read_exported_weights, read_export_config, run_cli)
from inference.kimi.tokenizer import ReleaseTokenizerError, release_tokenizer

MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed's range
# The one-line errors of reading a model directory (an export or a Kimi release).
MODEL_DIR_ERRORS = (ExportError, *RELEASE_ERRORS, ReleaseTokenizerError)


@dataclass
class GenerateArgs:
    model: str | None = None
    checkpoint: str | None = None
    prompt: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    prefill_chunk: int = 0
    seed: int = 0
    compile: bool = False
    variant: str | None = None
    tokenizer: str | None = None


class GenerateError(ValueError):
    """Bad input to generation; the message is one line."""


def validate(args: GenerateArgs) -> tuple[str, str]:
    """Check every option that needs no file; returns (key, export directory) as given."""
    if args.model and args.checkpoint and args.model != args.checkpoint:
        raise GenerateError(f"model={args.model} and checkpoint={args.checkpoint} disagree; checkpoint= is an alias "
                            "of model=, give one")
    key, export_dir = ("model", args.model) if args.model else ("checkpoint", args.checkpoint)
    if not export_dir:
        raise GenerateError("model= is required: an export directory written by python -m inference.export")
    if not args.prompt:
        raise GenerateError("prompt= is empty; give the text to continue")
    checks = (
        ("max_new_tokens", args.max_new_tokens, args.max_new_tokens > 0, "must be positive"),
        ("temperature", args.temperature, 0 <= args.temperature < math.inf,
         "must be a finite number >= 0 (0 is greedy)"),
        ("top_p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("prefill_chunk", args.prefill_chunk, args.prefill_chunk >= 0,
         "must be >= 0 (0 prefills the whole prompt at once)"),
        ("seed", args.seed, 0 <= args.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}] (2**64 - 1)"),
    )
    for name, value, allowed, rule in checks:
        if not allowed:
            raise GenerateError(f"{name}={value} {rule}")
    return key, export_dir


def _export_command(path: Path) -> str:
    """The inference.export command for a run or checkpoint directory, writing next to the run's files."""
    if STEP_DIR.fullmatch(path.name) and path.parent.name == CHECKPOINTS_DIR:
        out = path.parent.parent / f"export-{path.name}"
    else:
        out = path / "export"
    return f"python -m inference.export checkpoint={shlex.quote(str(path))} out={shlex.quote(str(out))}"


def find_export(key: str, given: str) -> Path:
    """The export directory `given` as `key`=; a training run or checkpoint is refused without reading any of it."""
    path = Path(given)
    if not path.exists():
        raise GenerateError(f"{key}={path} does not exist; give an export directory written by "
                            "python -m inference.export")
    if (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file():
        return path
    if (path / CHECKPOINTS_DIR).is_dir() or (path / META_FILE).is_file() or (path / DCP_METADATA).is_file():
        raise GenerateError(f"{key}={path} is a training run or checkpoint, which generate does not load (DCP "
                            "checkpoints are pickle-based, safe only from trusted sources); export it first with "
                            f"`{_export_command(path)}` and pass that out= as model=")
    missing = [name for name in (MODEL_FILE, CONFIG_FILE) if not (path / name).is_file()]
    raise GenerateError(f"{key}={path} is not an export directory: missing {', '.join(missing)} "
                        "(write one with python -m inference.export)")


def export_config(export_dir: Path, variant: str | None) -> Config:
    described = read_export_config(export_dir)
    try:
        cfg = config_from_saved(described["config"])
    except ConfigError as error:
        raise GenerateError(f"{export_dir / CONFIG_FILE} is not a config of this trainer ({error}); "
                            "re-export with this version") from None
    check_fingerprint(described, cfg, export_dir / CONFIG_FILE)
    if variant is not None and variant != cfg.model.residual.kind:
        raise GenerateError(f"variant={variant} but export {export_dir} holds a variant={cfg.model.residual.kind} "
                            "model; drop variant= or pick an export of that variant")
    check_trained_context(export_dir, cfg.train.seq_len)
    check_export_size(export_dir, cfg.model)
    return cfg


def check_fingerprint(described: dict, cfg: Config, file: Path) -> None:
    """config.json's config must still be the model its model_fingerprint (the trainer's, written at export)
    names: an edited option (variant.block_size) would load the same weights into another computation."""
    written = described.get("model_fingerprint")
    if not isinstance(written, str):
        raise GenerateError(f"{file} has no model_fingerprint, so its config cannot be checked; re-export with "
                            "inference.export")
    # The trainer's fingerprint: the model's, plus the optimizer (trainer/trainer.py).
    difference = fingerprint_difference(written, f"{model_fingerprint(cfg.model)} optim={cfg.optim.name}")
    if difference is not None:
        fingerprinted, configured = difference
        raise GenerateError(f"{file} says {configured} but its model_fingerprint says {fingerprinted}: the config "
                            "was edited after export; restore it or re-export with inference.export")


def load_tokenizer(path: str | None, export_dir: Path, cfg: Config):
    """The export's tokenizer, or `path`; its ids must all be rows of the model's embedding."""
    from tokenizers import Tokenizer

    candidate = Path(path) if path else export_dir / TOKENIZER_FILE
    if not candidate.is_file():
        raise GenerateError(f"tokenizer {candidate} not found; pass tokenizer=PATH to the tokenizer.json the run "
                            "was trained with")
    try:
        tokenizer = Tokenizer.from_file(str(candidate))
    except Exception as error:  # tokenizers raises plain Exceptions for unreadable files
        raise GenerateError(f"tokenizer {candidate} could not be read ({str(error).splitlines()[0]})") from None
    return check_tokenizer_vocab(tokenizer, candidate, cfg)


def check_tokenizer_vocab(tokenizer, source: Path, cfg: Config):
    """`tokenizer` (read from `source`) if every id it gives is a row of the model's embedding."""
    vocab = tokenizer_vocab_size(tokenizer)
    if vocab > cfg.model.vocab_size:
        raise GenerateError(f"tokenizer {source} has ids up to {vocab - 1}, outside the model's vocab of "
                            f"{cfg.model.vocab_size}; is this the run's tokenizer?")
    return tokenizer


@dataclass
class ModelDir:
    """A directory inference reads a model from: one of our exports, or a Kimi release (`release`), with the run
    config it stands for and its tokenizer, all checked before any weight is read."""
    path: Path
    cfg: Config
    tokenizer: object
    release: Release | None = None

    @property
    def tokenizer_file(self) -> Path | None:
        """The directory's tokenizer.json (what a prepared dataset records), None when it ships none."""
        file = self.path / TOKENIZER_FILE
        return file if file.is_file() else None

    def load(self) -> torch.nn.Module:
        """The model with the directory's weights, fp32 on the CPU in eval mode."""
        if self.release is not None:
            return load_release_model(self.release)
        return load_exported_model(self.path, self.cfg)


def release_run_config(release: Release) -> Config:
    """The run config a Kimi release stands for, as an export's config.json does: its model, and its context
    (max_position_embeddings; MAX_CONTEXT, Kimi Linear's 1M tokens, when config.json names none) as train.seq_len."""
    cfg = Config(model=release.model_config)
    return replace(cfg, train=replace(cfg.train, seq_len=release.config.context or MAX_CONTEXT))


def open_model_dir(key: str, given: str, variant: str | None, tokenizer: str | None,
                   need_tokenizer: bool = True) -> ModelDir:
    """The export or Kimi release directory `given` as `key`=, with `tokenizer` (a tokenizer.json) in place of
    its own when given; a release that ships none has the tokenizer None unless `need_tokenizer`."""
    path = Path(given)
    if not is_release_dir(path):
        export_dir = find_export(key, given)
        cfg = export_config(export_dir, variant)
        return ModelDir(export_dir, cfg, load_tokenizer(tokenizer, export_dir, cfg))
    release = open_release(path)
    cfg = release_run_config(release)
    if variant is not None and variant != cfg.model.residual.kind:
        raise GenerateError(f"variant={variant} but {path} holds a variant={cfg.model.residual.kind} model; drop "
                            "variant= or pick a checkpoint of that variant")
    if tokenizer:
        return ModelDir(path, cfg, load_tokenizer(tokenizer, path, cfg), release)
    found = release_tokenizer(path, cfg.model.vocab_size)
    if found is None and need_tokenizer:
        raise GenerateError(f"{path} ships neither tokenizer.json nor tiktoken.model; pass tokenizer=PATH")
    return ModelDir(path, cfg, None if found is None else check_tokenizer_vocab(found, path, cfg), release)


def check_prompt(ids: list[int], max_new_tokens: int, cfg: Config) -> None:
    context = cfg.train.seq_len
    if not ids:
        raise GenerateError("the prompt encodes to no tokens; give text the tokenizer covers")
    if len(ids) + max_new_tokens > context:
        room = context - len(ids)
        fix = f"lower max_new_tokens to {room} or shorten the prompt" if room > 0 else "shorten the prompt"
        raise GenerateError(f"the prompt is {len(ids)} tokens + max_new_tokens={max_new_tokens} = "
                            f"{len(ids) + max_new_tokens}, beyond the model's trained context of {context} "
                            f"(train.seq_len); {fix}")


def load_exported_model(export_dir: Path, cfg: Config):
    state = read_exported_weights(build_model(cfg, device="meta"), export_dir)
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def run(args: GenerateArgs) -> str:
    source = open_model_dir(*validate(args), args.variant, args.tokenizer)
    tokenizer, cfg = source.tokenizer, source.cfg
    ids = tokenizer.encode(args.prompt).ids
    check_prompt(ids, args.max_new_tokens, cfg)
    model = source.load()
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_p,
                   args.prefill_chunk or None, seed=args.seed, compile=args.compile)
    return tokenizer.decode(out[0].tolist())


def parse(argv: list[str]) -> GenerateArgs:
    return parse_key_values(argv, GenerateArgs, GenerateError)


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, __doc__, lambda args: run(parse(args)), (GenerateError, *MODEL_DIR_ERRORS))


if __name__ == "__main__":
    main()
