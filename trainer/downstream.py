"""train.eval_tasks: lm_eval tasks on the live model during training, at train.eval_tasks_every steps (null:
train.eval_every) and at the last step, without exporting it.

Under one process or data-parallel replicas rank 0 evaluates its own model while the other ranks wait at a
barrier. Layouts that split the model across ranks (fsdp, pp, tp, ep, cp) evaluate through their own forward,
as validation loss does: every rank runs the same tasks in lm_eval, and each batch of requests is one collective
forward of the engine (parallel/engine.py `logits`), whose whole logits every rank then scores alike; rank 0
logs them. No rank holds more of the model than it trains with; each holds one batch's logits, as one process
does. Generation recomputes the sequence each token (no inference cache spans the ranks).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from parallel.dims import barrier
from parallel.engine import Engine
from trainer.config import Config, ConfigError
from trainer.data.format import tokenizer_vocab_size
from trainer.lm_eval_adapter import AttnResLM
from trainer.lm_tasks import LOCAL_TASKS, run_tasks, task_manager_for


# The degrees that split the model across ranks; without them every rank holds all of it.
SPLITTING = ("fsdp", "pp", "tp", "ep", "cp")


class DownstreamEvaluation:
    def __init__(self, cfg: Config, tokenizer_file: str | Path | None, device: torch.device,
                 is_main: bool):
        """`tokenizer_file`: the run's tokenizer.json (its dataset's, else data.tokenizer)."""
        train, vocab_size = cfg.train, cfg.model.vocab_size
        if tokenizer_file is None:
            raise ConfigError("train.eval_tasks needs the run's tokenizer.json to turn task text into tokens, and a "
                              "Megatron prefix records none: set data.tokenizer to the tokenizer.json the data was "
                              "made with")
        if not Path(tokenizer_file).is_file():
            raise ConfigError(f"train.eval_tasks: data.tokenizer={tokenizer_file} is no file; give the tokenizer.json "
                              "the data was made with")
        self.train, self.device, self.is_main = train, device, is_main
        self.split = any(getattr(cfg.parallel, key) > 1 for key in SPLITTING)
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
    def run(self, engine: Engine, autocast) -> dict:
        """{"eval/<task>/<metric>": value, ..., "eval_tasks_time_s": seconds} on rank 0, {} on the others, once
        every rank is past it. `engine`: the live model's; `autocast`: the forward's. The caller puts the model
        back in training mode."""
        metrics = {}
        start = time.perf_counter()
        if self.split:
            lm = AttnResLM(LayoutForward(engine, autocast, self.device), self.tokenizer, self.train.seq_len,
                           batch_size=engine.eval_rows)
        elif self.is_main:
            lm = AttnResLM(engine.model, self.tokenizer, self.train.seq_len, batch_size=self.train.micro_batch)
        if self.split or self.is_main:
            with autocast():
                # Stderrs are not logged: no bootstrap resampling for the metrics that would need it.
                tables = run_tasks(lm, self.train.eval_tasks, self.manager, self.limit, bootstrap_iters=0)
            if self.is_main:
                metrics = {f"eval/{task}/{metric}": measured["value"]
                           for task, entry in tables.items() for metric, measured in entry["metrics"].items()}
                metrics["eval_tasks_time_s"] = time.perf_counter() - start
        barrier()
        return metrics


class LayoutForward:
    """The engine's collective forward as AttnResLM's model: (B, T) ids -> (B, T, vocab) logits on every rank."""

    def __init__(self, engine: Engine, autocast, device: torch.device):
        self.engine, self.autocast, self.device = engine, autocast, device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine.logits(ids, self.autocast)
