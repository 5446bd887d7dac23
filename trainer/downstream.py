"""train.eval_tasks: lm_eval tasks on the live model during training, at train.eval_tasks_every steps (null:
train.eval_every) and at the last step, without exporting it.

Rank 0 evaluates one process's model, so every layout logs what one process would, and the other ranks wait
at a barrier. Under one process or data-parallel replicas that is rank 0's own model. Layouts that split the
model across ranks (fsdp, pp, tp, ep, cp) first gather its weights to rank 0 (parallel/gather.py) into a
model of its own, built as one process builds it.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model import build_model
from parallel.dims import Layout, barrier
from parallel.gather import whole_state_dict
from trainer.config import Config, ConfigError
from trainer.data.format import tokenizer_vocab_size
from trainer.lm_eval_adapter import AttnResLM
from trainer.lm_tasks import LOCAL_TASKS, run_tasks, task_manager_for


# The degrees that split the model across ranks; without them every rank holds all of it.
SPLITTING = ("fsdp", "pp", "tp", "ep", "cp")


class DownstreamEvaluation:
    def __init__(self, cfg: Config, tokenizer_file: str | Path | None, layout: Layout, device: torch.device,
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
        self.cfg, self.train, self.layout, self.device, self.is_main = cfg, train, layout, device, is_main
        split = any(getattr(cfg.parallel, key) > 1 for key in SPLITTING)
        # The whole model's names, shapes and dtypes, which a pipeline rank receives its peers' entries into.
        self.shapes = build_model(cfg, device="meta").state_dict() if split else None
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
        every rank is past it. `model`: this rank's part of the live model. The caller sets the autocast and
        puts the model back in training mode."""
        metrics = {}
        start = time.perf_counter()
        if self.shapes is not None:
            state = whole_state_dict(model, self.layout, self.shapes, self.device)
            model = self._one_process_model(state) if self.is_main else None
        if self.is_main:
            lm = AttnResLM(model, self.tokenizer, self.train.seq_len, batch_size=self.train.micro_batch)
            # Stderrs are not logged: no bootstrap resampling for the metrics that would need it.
            tables = run_tasks(lm, self.train.eval_tasks, self.manager, self.limit, bootstrap_iters=0)
            metrics = {f"eval/{task}/{metric}": measured["value"]
                       for task, entry in tables.items() for metric, measured in entry["metrics"].items()}
            metrics["eval_tasks_time_s"] = time.perf_counter() - start
        barrier()
        return metrics

    def _one_process_model(self, state: dict) -> torch.nn.Module:
        model = build_model(self.cfg, device=self.device)
        model.load_state_dict(state)
        return model
