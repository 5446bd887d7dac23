"""The training loop: data -> forward/backward with accumulation -> step -> log / eval / checkpoint."""
from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from model import build_model
from parallel.dims import DistInfo, build_layout, barrier
from parallel.parallelize import build_engine, sync_moe_load
from trainer.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, model_fingerprint,
                                resolve_checkpoint, save_checkpoint)
from trainer.config import Config, ConfigError, validate_layout
from trainer.data import SequenceSampler, get_batch, num_windows, open_dataset, resolve_dataset, val_batches
from trainer.metrics import MetricsLogger, entropy, peak_memory_mb, summary_line
from trainer.optim import build_optimizer, build_scheduler


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.run.dir).resolve()
        train, parallel = cfg.train, cfg.parallel
        _, self.accumulation = validate_layout(cfg, info.world_size)
        self.layout = build_layout(info, parallel.dp, parallel.pp, parallel.tp, parallel.ep)
        self._check_resume_target()
        self._open_data()
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank, in every layout
        self.engine = build_engine(build_model(cfg), info, self.layout, parallel, train.micro_batch,
                                   train.seq_len, self.accumulation)
        self.model = self.engine.model
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, train)
        self.sampler = SequenceSampler(len(self.train_data), train.seq_len, cfg.seed)
        self.step = 0
        self.bad_steps_in_row = 0
        self.skipped_steps = 0
        # The optimizer joins the fingerprint: AdamW state cannot be loaded into Muon + AdamW.
        self.fingerprint = f"{model_fingerprint(cfg.model)} optim={cfg.optim.name}"
        self.resumed_from = self._resume()

    # -- set-up ----------------------------------------------------------------------------------

    def _check_resume_target(self) -> None:
        existing = latest_checkpoint(self.run_dir)
        if self.cfg.resume == "never" and existing is not None:
            raise ConfigError(f"resume=never but run.dir={self.run_dir} already holds {existing.name}; "
                              "use resume=auto to continue it or pick another run.dir")

    def _open_data(self) -> None:
        cfg = self.cfg
        if self.info.is_main:  # prepare once; the other ranks then find it in the cache
            resolved = resolve_dataset(cfg.data.path, cfg.data.cache_dir, cfg.model.vocab_size)
        barrier()
        if not self.info.is_main:
            resolved = resolve_dataset(cfg.data.path, cfg.data.cache_dir, cfg.model.vocab_size)
        self.tokenizer_file = resolved / "tokenizer.json" if resolved.is_dir() else None
        self.train_data = open_dataset(resolved, "train", cfg.model.vocab_size)
        self.val_data = open_dataset(resolved, "val", cfg.model.vocab_size)
        seq_len = cfg.train.seq_len
        if num_windows(len(self.train_data), seq_len) < cfg.train.global_batch:
            raise ConfigError(f"train.seq_len={seq_len}: the training split ({len(self.train_data)} tokens) holds "
                              f"fewer windows than train.global_batch={cfg.train.global_batch}")
        if num_windows(len(self.val_data), seq_len) == 0:
            raise ConfigError(f"train.seq_len={seq_len} is longer than the validation split ({len(self.val_data)} tokens)")

    def _resume(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            return None
        path = latest_checkpoint(self.run_dir) if resume == "auto" else resolve_checkpoint(resume)
        if path is None:
            return None
        optimizers = self.optimizer.optimizers
        extra, _ = load_checkpoint(path, self.model, optimizers, self.scheduler, self.info.rank,
                                   fingerprint=self.fingerprint, shards=self.engine.shards)
        self.step = extra["step"]
        self.skipped_steps = extra.get("skipped_steps", 0)
        self.sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"])
        return path

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict:
        cfg, train = self.cfg, self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.info.is_main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            if self.tokenizer_file is not None and self.tokenizer_file.is_file():  # for trainer.generate
                shutil.copyfile(self.tokenizer_file, self.run_dir / "tokenizer.json")
        log = MetricsLogger(cfg, self.run_dir, self.info.is_main, self.step)
        self._announce(log)
        comm_logged = False
        if self.step >= train.steps:
            log.print(f"run already complete at step {self.step}/{train.steps}; raise train.steps to continue it, "
                      "or pick another run.dir")
        record: dict = {}
        steps_this_launch = 0
        try:
            while self.step < train.steps:
                self._maybe_crash()
                record = self.train_step()
                steps_this_launch += 1
                if not comm_logged:
                    self._log_comm_volume(log)
                    comm_logged = True
                log.advance(record["loss"], record["tokens_per_s"])
                if self.step % train.eval_every == 0 or self.step == train.steps:
                    record["val_loss"] = self.evaluate()
                if self.step % train.log_every == 0 or "val_loss" in record or self.step == train.steps:
                    log.log(record)
                    log.print(summary_line(record))
                if "diagnostics" in record:
                    log.log_diagnostics(record.pop("diagnostics"))
                stopping = train.stop_after is not None and steps_this_launch >= train.stop_after
                if self.step % train.ckpt_every == 0 or self.step == train.steps or stopping:
                    path = self.save()
                    log.print(f"checkpoint {path}")
                if stopping:
                    log.print(f"stopping after {steps_this_launch} steps (train.stop_after); resume=auto continues")
                    break
        finally:
            log.close()
        return record

    def _announce(self, log: MetricsLogger) -> None:
        cfg, info = self.cfg, self.info
        n_params = sum(p.numel() for p in self.model.parameters())
        resumed = f", resumed from {self.resumed_from}" if self.resumed_from else ""
        log.print(f"run {self.run_dir}: model={cfg.model.d_model}d x {cfg.model.n_blocks} blocks "
                  f"({n_params / 1e6:.1f}M params on this rank), variant={cfg.model.residual.variant}, "
                  f"world={info.world_size} ({info.backend or 'single process'}, {info.device}; "
                  f"dp={self.layout.dp} pp={self.layout.pp} tp={self.layout.tp} ep={self.layout.ep}), "
                  f"accumulation={self.accumulation}, step {self.step}/{cfg.train.steps}{resumed}")

    def _maybe_crash(self) -> None:
        """debug.crash_at_step: die once at that step (a marker per rank stops a loop of crashes)."""
        at = self.cfg.debug.crash_at_step
        marker = self.run_dir / f".crash_injected_rank{self.info.rank}"
        if at is not None and self.step == at and not marker.exists():
            marker.touch()
            os._exit(13)

    def _log_comm_volume(self, log: MetricsLogger) -> None:
        report = self.engine.comm_report()
        if report is None:
            return
        d = self.cfg.model.d_model
        log.print(f"pipeline pp={report['pp']} vp={report['vp']} cache={report['cache']}: vectors per token "
                  f"per transition {report['vectors_per_token']} (total {sum(report['vectors_per_token'])} x d={d}); "
                  f"measured bytes per token {report['measured_bytes_per_token']}")
        log.log({"step": self.step, "pp_comm": report})

    def _autocast(self):
        if self.info.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        cfg, train = self.cfg, self.cfg.train
        start = time.perf_counter()
        windows = self.sampler.next_batch(train.global_batch, self.layout.dp_rank, self.layout.dp)
        # Diagnostics need the whole model on one rank (not pipeline stages or tp slices).
        whole_model = self.layout.pp == 1 and self.layout.tp == 1
        diagnostics = {} if (self.step + 1) % train.diag_every == 0 and whole_model else None
        micro_batches = []
        for micro in range(self.accumulation):
            chunk = windows[micro * train.micro_batch:(micro + 1) * train.micro_batch]
            micro_batches.append(tuple(t.to(self.info.device) for t in get_batch(self.train_data, chunk, train.seq_len)))
        data_time = time.perf_counter() - start
        self.model.train()
        loss = self.engine.forward_backward(micro_batches, self._autocast, diagnostics).item()
        if self.step + 1 in cfg.debug.nan_loss_steps:
            loss = float("nan")
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        grad_norm = self.engine.clip_grad_norm(train.grad_clip)
        sync_moe_load(self.model, self.layout)
        imbalance = self._moe_imbalance(self.model)
        if diagnostics is not None:
            diagnostics = self._diagnostics(self.model, diagnostics)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_steps_in_row = 0
        else:
            self.skipped_steps += 1
            self.bad_steps_in_row += 1
            if self.bad_steps_in_row >= train.max_bad_steps:
                raise NonFiniteError(f"stopping: {self.bad_steps_in_row} steps in a row had a non-finite loss or "
                                     f"gradient (last loss {loss}, grad norm {grad_norm}); lower optim.lr or resume "
                                     "from an earlier checkpoint")
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.model.update_moe_bias()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        step_time = time.perf_counter() - start
        tokens = train.global_batch * train.seq_len
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": self.step * tokens, "tokens_per_s": tokens / step_time, "step_time_s": step_time,
                  "data_time_s": data_time, "peak_mem_mb": peak_memory_mb(self.info.device),
                  "moe_load_imbalance": imbalance, "skipped_steps": self.skipped_steps}
        if diagnostics is not None:
            record["diagnostics"] = {"step": self.step, **diagnostics}
        return record

    @staticmethod
    def _moe_imbalance(model) -> float:
        layers = model.moe_layers()
        return sum(moe.load_imbalance() for moe in layers) / len(layers) if layers else 1.0

    def _diagnostics(self, model, recorded: dict) -> dict:
        """Per-sublayer output RMS and depth weights (from the first micro-batch), per-block gradient RMS."""
        grad_rms = {}
        for index, block in model.layers.items():
            grads = [p.grad.float().pow(2).sum() for p in block.parameters() if p.grad is not None]
            count = sum(p.numel() for p in block.parameters() if p.grad is not None)
            grad_rms[index] = math.sqrt(torch.stack(grads).sum().item() / count) if grads else 0.0
        out = {"output_rms": {str(k): v for k, v in recorded.get("output_rms", {}).items()}, "grad_rms": grad_rms}
        weights = recorded.get("depth_weights")
        if weights:
            out["depth_weights"] = {str(l): {str(i): w for i, w in row.items()} for l, row in weights.items()}
            out["depth_entropy"] = {str(l): entropy(list(row.values())) for l, row in weights.items()}
        return out

    def evaluate(self) -> float:
        """Mean loss over the fixed validation windows; data-parallel ranks split the batches."""
        train = self.cfg.train
        batches = [tuple(t.to(self.info.device) for t in batch)
                   for batch in val_batches(self.val_data, train.seq_len, train.micro_batch, train.eval_batches)]
        loss_sum, tokens = self.engine.evaluate(batches, self._autocast)
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        if self.layout.dp_group is not None:
            torch.distributed.all_reduce(totals, group=self.layout.dp_group)
        return (totals[0] / totals[1]).item()

    def save(self) -> Path:
        extra = {"step": self.step, "sampler": self.sampler.state_dict(), "rng": rng_state(),
                 "skipped_steps": self.skipped_steps}
        meta = {"model_fingerprint": self.fingerprint, "config": asdict(self.cfg)}
        return save_checkpoint(self.run_dir, self.step, self.model, self.optimizer.optimizers,
                               self.scheduler, extra, meta, self.cfg.train.keep_last, self.engine.shards)


KNOWN_ERRORS = (ConfigError, CheckpointError, NonFiniteError, FileNotFoundError, ValueError)
