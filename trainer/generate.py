"""Generate text from a checkpoint: `python -m trainer.generate checkpoint=RUN_OR_CKPT prompt="..." ...`

checkpoint= takes a run directory (its newest checkpoint) or one checkpoint directory; the run's
trained tokenizer (tokenizer.json in the run directory, copied there by the trainer) encodes the
prompt. Options: max_new_tokens=64 temperature=0 (greedy) top_p=1.0 prefill_chunk=0 (whole prompt)
seed=0 variant= (optional: refuse a checkpoint of another residual variant) tokenizer=PATH.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model import build_model
from model.generation import generate
from trainer.checkpoint import CheckpointError, load_checkpoint, read_meta, resolve_checkpoint
from trainer.config import Config


@dataclass
class GenerateArgs:
    checkpoint: str | None = None
    prompt: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    prefill_chunk: int = 0
    seed: int = 0
    variant: str | None = None
    tokenizer: str | None = None


class GenerateError(ValueError):
    """Bad input to generation; the message is one line."""


def load_for_inference(checkpoint: str, variant: str | None = None):
    """(model, config, checkpoint path) from a run directory or a checkpoint directory."""
    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path)
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), meta["config"]))
    if variant is not None and variant != cfg.model.residual.variant:
        raise GenerateError(f"variant={variant} but checkpoint {path} holds a variant={cfg.model.residual.variant} "
                            "model; drop variant= or pick a checkpoint of that variant")
    model = build_model(cfg)
    load_checkpoint(path, model, [], None, rank=0)
    return model.eval(), cfg, path


def load_tokenizer(path: Path | None, checkpoint: Path):
    from tokenizers import Tokenizer

    candidate = Path(path) if path else checkpoint.parent.parent / "tokenizer.json"
    if not candidate.is_file():
        raise GenerateError(f"tokenizer {candidate} not found; pass tokenizer=PATH to the tokenizer.json the run "
                            "was trained with")
    try:
        return Tokenizer.from_file(str(candidate))
    except Exception as error:  # tokenizers raises plain Exceptions for unreadable files
        raise GenerateError(f"tokenizer {candidate} could not be read ({str(error).splitlines()[0]})") from None


def run(args: GenerateArgs) -> str:
    if not args.checkpoint:
        raise GenerateError("checkpoint= is required: a run directory or a checkpoint directory")
    if not args.prompt:
        raise GenerateError("prompt= is empty; give the text to continue")
    model, cfg, path = load_for_inference(args.checkpoint, args.variant)
    tokenizer = load_tokenizer(args.tokenizer, path)
    ids = tokenizer.encode(args.prompt).ids
    context = cfg.train.seq_len
    if len(ids) > context:
        raise GenerateError(f"the prompt is {len(ids)} tokens, longer than the model's context of {context} "
                            "(train.seq_len); shorten it")
    if max(ids) >= cfg.model.vocab_size:
        raise GenerateError(f"tokenizer produced id {max(ids)} outside the model's vocab of {cfg.model.vocab_size}; "
                            "is this the run's tokenizer?")
    prompt = torch.tensor([ids])
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p,
                   args.prefill_chunk or None, seed=args.seed)
    return tokenizer.decode(out[0].tolist())


def parse(argv: list[str]) -> GenerateArgs:
    try:
        overrides = OmegaConf.from_dotlist(argv)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GenerateArgs), overrides))
    except OmegaConfBaseException as error:
        raise GenerateError(str(error).splitlines()[0]) from None


def main(argv: list[str] | None = None) -> None:
    try:
        print(run(parse(sys.argv[1:] if argv is None else argv)))
    except (GenerateError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
