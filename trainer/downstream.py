"""train.eval_tasks: lm_eval tasks on the live model during training, at train.eval_tasks_every steps (null:
train.eval_every) and at the last step, without exporting it.

Rank 0 evaluates its own whole model (one process, or one of the data-parallel replicas, which hold the same
weights), so a run on any number of replicas logs what one process would; the other ranks wait at a barrier.
Layouts that split the model across ranks (fsdp, pp, tp, ep, cp) are refused by the config check.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from parallel.dims import barrier
from trainer.config import ConfigError, TrainConfig
from trainer.data.format import tokenizer_vocab_size
from trainer.lm_eval_model import AttnResLM
from trainer.lm_tasks import LOCAL_TASKS, run_tasks, task_manager_for


class DownstreamEvaluation:
    def __init__(self, train: TrainConfig, tokenizer_file: str | Path | None, vocab_size: int, is_main: bool):
        """`tokenizer_file`: the run's tokenizer.json (its dataset's, else data.tokenizer)."""
        if tokenizer_file is None:
            raise ConfigError("train.eval_tasks needs the run's tokenizer.json to turn task text into tokens, and a "
                              "Megatron prefix records none: set data.tokenizer to the tokenizer.json the data was "
                              "made with")
        if not Path(tokenizer_file).is_file():
            raise ConfigError(f"train.eval_tasks: data.tokenizer={tokenizer_file} is no file; give the tokenizer.json "
                              "the data was made with")
        self.train, self.is_main = train, is_main
        self.every = train.eval_tasks_every or train.eval_every
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        if tokenizer_vocab_size(self.tokenizer) > vocab_size:
            raise ConfigError(f"train.eval_tasks: the tokenizer {tokenizer_file} has ids up to "
                              f"{tokenizer_vocab_size(self.tokenizer) - 1}, outside model.vocab_size={vocab_size}; "
                              "set data.tokenizer to the tokenizer.json the data was made with")
        self.manager = task_manager_for(train.eval_tasks, LOCAL_TASKS, key="train.eval_tasks")
        limit = train.eval_tasks_limit
        self.limit = int(limit) if limit is not None and limit >= 1 else limit

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.train.steps

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> dict:
        """{"eval/<task>/<metric>": value, ..., "eval_tasks_time_s": seconds} on rank 0, {} on the others, once
        every rank is past it. The caller sets the autocast and puts the model back in training mode."""
        metrics = {}
        if self.is_main:
            start = time.perf_counter()
            lm = AttnResLM(model, self.tokenizer, self.train.seq_len, batch_size=self.train.micro_batch)
            # Stderrs are not logged: no bootstrap resampling for the metrics that would need it.
            tables = run_tasks(lm, self.train.eval_tasks, self.manager, self.limit, bootstrap_iters=0)
            metrics = {f"eval/{task}/{metric}": measured["value"]
                       for task, entry in tables.items() for metric, measured in entry["metrics"].items()}
            metrics["eval_tasks_time_s"] = time.perf_counter() - start
        barrier()
        return metrics
