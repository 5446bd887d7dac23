"""The training loop: data -> forward/backward with accumulation -> step -> log / eval / checkpoint."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from model import build_model
from model.flops import training_flops_per_token
from parallel.compile import apply_compile
from parallel.dims import Degrees, DistInfo, build_layout, resolve_precision, set_collective_timeout
from parallel.engine import build_engine
from parallel.gradients import moe_load_imbalance, sync_moe_load
from trainer import retrofit
from trainer.config import Config, ConfigError, validate_layout
from trainer.data import SampleSampler
from trainer.diagnostics import step_diagnostics
from trainer.fault_drills import FaultDrills
from trainer.files.disk_space import is_disk_full
from trainer.hang import HangWatchdog
from trainer.metrics import MetricsLogger, StepProfiler, peak_memory_mb
from trainer.mfu import achieved, device_peak_tflops, float8_flop_share
from trainer.optim import build_optimizer, build_scheduler, tensor_parallel_slices, wsd_decay_start
from trainer.resume import check_start, complete_message, continue_schedule, resume
from trainer.rng_state import rng_state, set_rng_state
from trainer.run_dir.async_checkpoint import CheckpointSaver
from trainer.run_dir.checkpoint import CheckpointError, latest_checkpoint, model_fingerprint
from trainer.run_dir.finished import record_finished
from trainer.run_dir.lock import RunDirError, disk_full_error, lock_run_dir
from trainer.start_up import document_boundary, downstream_evaluation, open_data, run_tokenizer, write_run_files


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row."""


class Trainer:
    """One run in one run directory, which it locks (trainer.run_dir.lock) from construction until fit() ends or
    close() is called, before anything reads or writes it."""

    def __init__(self, cfg: Config, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.run.dir).resolve()
        self.saver: CheckpointSaver | None = None
        self.lock = lock_run_dir(self.run_dir, info.is_main)
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory (fit does this when it ends)."""
        if self.saver is not None:
            self.saver.close()
        if self.lock is not None:
            self.lock.release()

    # -- set-up ----------------------------------------------------------------------------------

    def _set_up(self) -> None:
        cfg, info = self.cfg, self.info
        train, parallel = cfg.train, cfg.parallel
        _, self.accumulation = validate_layout(cfg, info.world_size)
        self.layout = build_layout(info, Degrees.of(parallel, info.world_size))
        retrofit.check_layout(train, cfg.init_from, info.world_size, parallel.tp, parallel.fsdp)
        check_start(cfg, self.run_dir, info.is_main)
        self.samples = open_data(cfg, info.is_main)
        self.tokenizer_json, self.tokenizer_sha256 = run_tokenizer(self.samples.blend.tokenizer_file)
        self.downstream = downstream_evaluation(cfg, self.samples.blend.tokenizer_file, info.device, info.is_main)
        torch.manual_seed(cfg.seed)  # identical random streams on every rank
        self.precision = resolve_precision(train.precision, info.device)
        # Built on meta: each engine materialises only this rank's part, with the weights one process
        # would have for cfg.seed (model.init).
        self.engine = build_engine(build_model(cfg, device="meta"), info, self.layout, parallel, train.micro_batch,
                                   train.seq_len, self.accumulation, train.activation_checkpointing, seed=cfg.seed,
                                   precision=self.precision, float8=train.float8,
                                   document_boundary=document_boundary(cfg, self.samples.blend))
        self.model = self.engine.model
        if train.compile:
            apply_compile(self.model)  # after sharding: a block compiles the tp/ep/fsdp modules it runs
        self.optimizer = build_optimizer(self.model, cfg.optim,
                                         tensor_parallel_slices(self.model, self.layout.tp_group))
        self.scheduler = build_scheduler(self.optimizer, train)
        self.sampler = SampleSampler(self.samples.pass_samples, train.seq_len, cfg.seed)
        # Once, at start: the FLOPs are a function of the config, the peak of the device.
        self.flops_per_token = training_flops_per_token(cfg.model, train.seq_len)["total"]
        float8_share = float8_flop_share(cfg.model, self.layout.tp, self.flops_per_token) if train.float8 else 0.0
        self.peak_tflops = device_peak_tflops(info.device, train.peak_tflops, float8_share)
        self.bad_steps_in_row = 0
        self.drills = FaultDrills(cfg.debug, self.run_dir, info.rank)
        # The optimizer joins the fingerprint: AdamW state cannot be loaded into Muon + AdamW.
        self.fingerprint = f"{model_fingerprint(cfg.model)} optim={cfg.optim.name}"
        decay_start = wsd_decay_start(train)
        self.pre_decay_step = decay_start if train.schedule == "wsd" and 0 < decay_start < train.steps else None
        configured_lrs = list(self.scheduler.base_lrs)  # optim.lr / muon_lr; a resume restores the checkpoint's
        self.resumed = resume(cfg, self.run_dir, info.is_main, info.rank, self.model, self.optimizer, self.scheduler,
                              self.sampler, self.fingerprint, self.layout.mesh)
        self.step, self.skipped_steps = (self.resumed.step, self.resumed.skipped_steps) if self.resumed else (0, 0)
        self._start_retrofit()
        self.saver = CheckpointSaver(cfg.checkpoint.async_mode, info.device)
        if self.resumed is not None:
            continue_schedule(self.resumed, train, self.scheduler, configured_lrs)

    def _start_retrofit(self) -> None:
        """init_from on a fresh run only; then the trainable set for the next step (trainer/retrofit.py)."""
        cfg = self.cfg
        fresh = self.resumed is None and cfg.init_from is not None
        self.init_checkpoint = retrofit.init_from(self.model, cfg.init_from) if fresh else None
        self.trainable_counts = retrofit.set_trainable(self.model, cfg.train, self.step)

    def _unfreeze_if_due(self, log: MetricsLogger) -> None:
        if self.cfg.train.unfreeze_after == self.step and self.cfg.train.trainable != "all":
            self.trainable_counts = retrofit.set_trainable(self.model, self.cfg.train, self.step)
            log.print(f"unfreezing at step {self.step} (train.unfreeze_after): "
                      + retrofit.describe_trainable(*self.trainable_counts, self.cfg.train))

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to train.steps (a finished run is left as it is); the run directory is released at the end."""
        try:
            if self.step >= self.cfg.train.steps:  # only a resumed run: train.steps > 0
                if self.info.is_main:
                    print(complete_message(self.resumed, self.cfg.train, self.run_dir), file=sys.stderr)
                return {}
            with self._disk_full_as_error():
                return self._train()
        finally:
            self.close()

    @contextlib.contextmanager
    def _disk_full_as_error(self):
        """A full disk becomes one line naming the run directory, not a traceback from inside a writer."""
        try:
            yield
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            if not is_disk_full(error):
                raise
            raise disk_full_error(self.run_dir, self.step, latest_checkpoint(self.run_dir)) from error

    def _train(self) -> dict:
        cfg, train = self.cfg, self.cfg.train
        write_run_files(cfg, self.run_dir, self.info.is_main, self.tokenizer_json, self.pre_decay_step, self.step)
        log = MetricsLogger(cfg, self.run_dir, self.info.is_main, self.step)
        self._announce(log)
        comm_logged = False
        record: dict = {}
        steps_this_launch = 0
        profiler = StepProfiler(cfg.debug.profile_steps, self.run_dir / "profile", self.info.rank, self.info.device)
        report = log.print if self.info.is_main else lambda line: sys.stderr.write(line + "\n")
        watchdog = HangWatchdog(self.run_dir / "hang", self.info.rank, train.hang_after_s, report)
        try:
            while self.step < train.steps:
                self.drills.before_step(self.step)
                watchdog.start(self.step + 1)
                self._unfreeze_if_due(log)
                profiler.before_step(self.step + 1)
                record = self.train_step()
                trace = profiler.after_step(self.step)
                if trace is not None:
                    log.print(f"profile trace {trace}")
                self.drills.after_step(self.step)
                steps_this_launch += 1
                if steps_this_launch == 1:  # past compilation and lazy initialisation
                    set_collective_timeout(cfg.parallel.collective_timeout_s)
                if not comm_logged:
                    self._log_comm_volume(log)
                    comm_logged = True
                log.advance(record["loss"], record["tokens_per_s"])
                if self.step % train.eval_every == 0 or self.step == train.steps:
                    record["val_loss"] = self.validation_loss()
                diagnostics = record.pop("diagnostics", None)  # its own file; metrics rows stay flat scalars
                if self.step % train.log_every == 0 or "val_loss" in record or self.step == train.steps:
                    log.log(record)
                    log.summary(record)
                if diagnostics is not None:
                    log.log_diagnostics(diagnostics)
                if self.downstream is not None and self.downstream.due(self.step):
                    # Before the step's checkpoint: a launch killed between the two redoes the step and its
                    # row (a resumed run drops the rows after its checkpoint). A long evaluation is no hang.
                    with watchdog.paused():
                        self._evaluate_tasks(log, record["tokens"])
                self._announce_written(log, self.saver.poll())  # the save in flight, once every rank wrote it
                stopping = train.stop_after is not None and steps_this_launch >= train.stop_after
                if (self.step % train.ckpt_every == 0 or self.step == train.steps or stopping
                        or self.step == self.pre_decay_step):
                    self._announce_written(log, self.saver.wait())  # a save still in flight ends first
                    path = self.save()
                    log.print(f"checkpoint {path}" + (" writing in the background" if self.saver.in_flight else ""))
                watchdog.finish()
                if stopping:
                    log.print(f"stopping after {steps_this_launch} steps (train.stop_after); resume=auto continues")
                    break
            self._announce_written(log, self.saver.wait())  # training ends when its last checkpoint is written
            if self.step == train.steps and self.info.is_main:
                record_finished(self.run_dir, self.step)
        finally:
            watchdog.close()
            trace = profiler.close()  # a launch stopped inside the range keeps the steps it profiled
            if trace is not None:
                log.print(f"profile trace {trace}")
            log.close()
        return record

    @staticmethod
    def _announce_written(log: MetricsLogger, published: Path | None) -> None:
        if published is not None:
            log.print(f"checkpoint {published} written")

    def _announce(self, log: MetricsLogger) -> None:
        cfg, info = self.cfg, self.info
        # Under fsdp a parameter is a DTensor whose numel is the whole tensor's; this rank holds its shard.
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self.model.parameters())
        resumed = f", resumed from {self.resumed.path}" if self.resumed else ""
        log.print(f"run {self.run_dir}: model={cfg.model.d_model}d x {cfg.model.n_blocks} blocks "
                  f"({n_params / 1e6:.1f}M params on this rank), variant={cfg.model.residual.kind}, "
                  f"world={info.world_size} ({info.backend or 'single process'}, {info.device}, "
                  f"{'bf16' if self.precision == torch.bfloat16 else 'fp32'}; "
                  f"data ranks={self.layout.data_ranks} (fsdp={self.layout.fsdp}) cp={self.layout.cp} pp={self.layout.pp} tp={self.layout.tp} "
                  f"ep={self.layout.ep}), "
                  f"accumulation={self.accumulation}, step {self.step}/{cfg.train.steps}{resumed}")
        peak = (f"peak {self.peak_tflops:g} TFLOP/s per rank" if self.peak_tflops is not None
                else f"peak of {info.device.type} unknown (mfu null; set train.peak_tflops)")
        log.print(f"model FLOPs: {self.flops_per_token / 1e9:.4g} GFLOP per training token (model/flops.py), {peak}")
        if self.init_checkpoint is not None:
            log.print(f"init_from: weights of {self.init_checkpoint}")
        log.print(retrofit.describe_trainable(*self.trainable_counts, cfg.train))

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
        if self.precision == torch.bfloat16:
            return torch.autocast(self.info.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        train = self.cfg.train
        start = time.perf_counter()
        samples = self.sampler.next_batch(train.global_batch, self.layout.data_rank, self.layout.data_ranks)
        # Diagnostics need the whole model on one rank (not pipeline stages or tp slices).
        # Diagnostics need the whole model and whole sequences on one rank (cp's first slice is not typical).
        whole_model = self.layout.pp == 1 and self.layout.degrees.sequence_ranks == 1
        diagnostics = {} if (self.step + 1) % train.diag_every == 0 and whole_model else None
        micro_batches = []
        for micro in range(self.accumulation):
            chunk = samples[micro * train.micro_batch:(micro + 1) * train.micro_batch]
            micro_batches.append(tuple(t.to(self.info.device) for t in self.samples.train_batch(chunk)))
        data_time = time.perf_counter() - start
        self.model.train()
        loss = self.drills.forward_backward(self.engine, self.step + 1, micro_batches, self._autocast, diagnostics)
        grad_norm = self.engine.clip_grad_norm(train.grad_clip)
        sync_moe_load(self.model, self.layout)
        imbalance = moe_load_imbalance(self.model, self.layout)
        if diagnostics is not None:
            diagnostics = step_diagnostics(self.model, diagnostics)
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
        retrofit.update_moe_bias(self.model, train, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        step_time = time.perf_counter() - start
        tokens = train.global_batch * train.seq_len
        tflops, mfu = achieved(self.flops_per_token, tokens / self.info.world_size, step_time, self.peak_tflops)
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": self.step * tokens, "tokens_per_s": tokens / step_time, "step_time_s": step_time,
                  "tflops": tflops, "mfu": mfu,
                  "data_time_s": data_time, "peak_mem_mb": peak_memory_mb(self.info.device),
                  "moe_load_imbalance": imbalance, "skipped_steps": self.skipped_steps}
        if diagnostics is not None:
            record["diagnostics"] = {"step": self.step, **diagnostics}
        return record

    def validation_loss(self) -> float:
        """Mean loss over the fixed validation samples; data-parallel ranks split the batches."""
        train = self.cfg.train
        batches = [tuple(t.to(self.info.device) for t in batch)
                   for batch in self.samples.val_batches(train.micro_batch, train.eval_batches)]
        loss_sum, tokens = self.engine.loss_totals(batches, self._autocast)
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        if self.layout.data_group is not None:
            torch.distributed.all_reduce(totals, group=self.layout.data_group)
        return (totals[0] / totals[1]).item()

    def _evaluate_tasks(self, log: MetricsLogger, tokens: int) -> None:
        """train.eval_tasks on the live model, before the step's checkpoint; its metrics get a row of their own
        at this step. The RNGs are put back as they were, so training goes on as it would have without it."""
        state = rng_state()
        try:
            metrics = self.downstream.run(self.engine, self._autocast)
        finally:
            set_rng_state(state)
            self.model.train()
        if metrics:
            log.log({"step": self.step, "tokens": tokens, **metrics})
            scores = ", ".join(f"{key.removeprefix('eval/')} {value:.4f}" for key, value in metrics.items()
                               if key.startswith("eval/") and value is not None)
            log.print(f"eval tasks at step {self.step}: {scores} ({metrics['eval_tasks_time_s']:.1f} s)")

    def save(self) -> Path:
        extra = {"step": self.step, "sampler": self.sampler.state_dict(), "rng": rng_state(),
                 "skipped_steps": self.skipped_steps}
        meta = {"model_fingerprint": self.fingerprint, "config": asdict(self.cfg),
                "tokenizer_sha256": self.tokenizer_sha256}
        return self.saver.save(self.run_dir, self.step, self.model, self.optimizer.optimizers, self.scheduler, extra,
                               meta, self.cfg.train.keep_last, self.layout.mesh)


KNOWN_ERRORS = (ConfigError, CheckpointError, NonFiniteError, RunDirError, FileNotFoundError, ValueError)
