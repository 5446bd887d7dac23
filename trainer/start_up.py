"""What a launch sets up before its first step, beside the model and engine (trainer/trainer.py) and the
checkpoint it resumes (trainer/resume.py): the data, opened on rank 0 first, and the run's tokenizer; the
end-of-text id documents are masked at; train.eval_tasks' evaluation; the files a run directory holds from
the start."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from omegaconf import OmegaConf

from parallel.dims import barrier
from trainer.config import Config, ConfigError
from trainer.data import Blend, BlendSamples, open_samples
from trainer.files.safe_io import write_file
from trainer.run_dir.checkpoint import pin_checkpoint


def open_data(cfg: Config, is_main: bool) -> BlendSamples:
    """The run's samples, indexed for train.steps of train.global_batch."""
    # Prepared (and its files hashed) once, on rank 0; the other ranks then find it in the cache.
    def open_here():
        return open_samples(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.seed)

    samples = open_here() if is_main else None
    barrier()
    samples = samples if samples is not None else open_here()
    samples.build_for_run(cfg.train.steps, cfg.train.global_batch)  # on every rank at once: collective
    return samples


def run_tokenizer(tokenizer_file: Path | None) -> tuple[bytes | None, str | None]:
    """The dataset's tokenizer.json and its sha256 (None, None without one). The bytes are copied into
    run.dir for inference.generate (verified with its dataset); the sha256 goes into every checkpoint's
    meta.json, so an export can tell it from another run's tokenizer.json."""
    if tokenizer_file is None or not tokenizer_file.is_file():
        return None, None
    tokenizer_json = tokenizer_file.read_bytes()
    return tokenizer_json, hashlib.sha256(tokenizer_json).hexdigest()


def document_boundary(cfg: Config, blend: Blend) -> int | None:
    """The end-of-text id documents are masked at (data.document_masking), from the dataset's manifest."""
    if not cfg.data.document_masking:
        return None
    if blend.eot_id is None:
        raise ConfigError(f"data.document_masking=true needs the end-of-text id, which a prepared dataset's "
                          f"manifest records and a Megatron prefix ({blend.describe()}) does not; "
                          "prepare the text with scripts.prepare_data or set data.document_masking=false")
    return blend.eot_id


def downstream_evaluation(cfg: Config, tokenizer_file: Path | None, device: torch.device, is_main: bool):
    """train.eval_tasks' evaluation (trainer/downstream.py), None without tasks."""
    if not cfg.train.eval_tasks:
        return None
    # Imported here: lm-evaluation-harness is the eval extra, which a run without train.eval_tasks needs not.
    from trainer.downstream import DownstreamEvaluation

    return DownstreamEvaluation(cfg, tokenizer_file or cfg.data.tokenizer, device, is_main)


def write_run_files(cfg: Config, run_dir: Path, is_main: bool, tokenizer_json: bytes | None,
                    pre_decay_step: int | None, step: int) -> None:
    """run.dir itself; on rank 0 its config.yaml and tokenizer.json, and a wsd run's pin on its pre-decay
    checkpoint while that is still to come."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_main:
        return
    write_file(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)), root=run_dir)
    if tokenizer_json is not None:
        write_file(run_dir / "tokenizer.json", tokenizer_json, root=run_dir)
    if pre_decay_step is not None and step < pre_decay_step:
        pin_checkpoint(run_dir, pre_decay_step)
