"""The training loop: data -> forward/backward with accumulation -> step -> log / eval / checkpoint."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from model import build_model
from model.flops import training_flops_per_token
from model.params import count_parameters
from parallel.compile import apply_compile
from parallel.dims import Degrees, DistInfo, barrier, build_layout, resolve_precision, set_collective_timeout
from parallel.engine import build_engine
from parallel.gradients import moe_load_imbalance, sync_moe_load
from trainer.run_dir.async_checkpoint import CheckpointSaver
from trainer.run_dir.checkpoint import (CHECKPOINTS_DIR, META_FILE, CheckpointError, checkpoint_path, latest_checkpoint, load_checkpoint,
                                model_fingerprint, newest_verified_checkpoint, pin_checkpoint, pinned_names, read_meta,
                                remove_partial_saves, unfinished_checkpoints,
                                resolve_checkpoint)
from trainer.config import Config, ConfigError, TrainConfig, validate_layout
from trainer.data import SampleSampler, open_samples
from trainer.metrics import MetricsLogger, StepProfiler, entropy, peak_memory_mb
from trainer.mfu import achieved, device_peak_tflops, float8_flop_share
from trainer.hang import HangWatchdog
from trainer.run_dir.finished import FINISHED_FILE, finished_step, record_finished
from trainer.files.disk_space import is_disk_full
from trainer.run_dir.lock import RunDirError, check_room, disk_full_error, lock_run_dir
from trainer import retrofit
from trainer.files.safe_io import write_file
from trainer.optim import (build_optimizer, build_scheduler, lr_multiplier, schedules_agree, set_schedule_step,
                           tensor_parallel_slices, wsd_decay_start)

SCHEDULE_KEYS = ("steps", "schedule", "warmup_steps", "decay_fraction", "min_lr_ratio")


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row."""


def _bytes_to_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG's state as JSON values (checkpoints hold no pickles); set_rng_state restores it exactly.
    torch's states are byte tensors (base64 here); numpy's and Python's are tuples of ints and a float."""
    bit_generator, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": _bytes_to_text(torch.get_rng_state()),
             "numpy": {"bit_generator": bit_generator, "key": key.tolist(), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["bit_generator"], np.array(numpy["key"], dtype=np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])


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
        self._check_resume_target()
        self._open_data()
        self.downstream = self._downstream_evaluation()
        torch.manual_seed(cfg.seed)  # identical random streams on every rank
        self.precision = resolve_precision(train.precision, info.device)
        # Built on meta: each engine materialises only this rank's part, with the weights one process
        # would have for cfg.seed (model.init).
        self.engine = build_engine(build_model(cfg, device="meta"), info, self.layout, parallel, train.micro_batch,
                                   train.seq_len, self.accumulation, train.activation_checkpointing, seed=cfg.seed,
                                   precision=self.precision, document_boundary=self._document_boundary(),
                                   float8=train.float8)
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
        self.step = 0
        self.bad_steps_in_row = 0
        self.skipped_steps = 0
        # The optimizer joins the fingerprint: AdamW state cannot be loaded into Muon + AdamW.
        self.fingerprint = f"{model_fingerprint(cfg.model)} optim={cfg.optim.name}"
        decay_start = wsd_decay_start(train)
        self.pre_decay_step = decay_start if train.schedule == "wsd" and 0 < decay_start < train.steps else None
        configured_lrs = list(self.scheduler.base_lrs)  # optim.lr / muon_lr; a resume restores the checkpoint's
        self.resumed_from = self._resume()
        self._start_retrofit()
        self.saver = CheckpointSaver(cfg.checkpoint.async_mode, info.device)
        self.resumed_train = self._checkpoint_train_config()
        self._continue_schedule(configured_lrs)

    def _start_retrofit(self) -> None:
        """init_from on a fresh run only; then the trainable set for the next step (trainer/retrofit.py)."""
        cfg = self.cfg
        fresh = self.resumed_from is None and cfg.init_from is not None
        self.init_checkpoint = retrofit.init_from(self.model, cfg.init_from) if fresh else None
        self.trainable_counts = retrofit.set_trainable(self.model, cfg.train, self.step)

    def _unfreeze_if_due(self, log: MetricsLogger) -> None:
        if self.cfg.train.unfreeze_after == self.step and self.cfg.train.trainable != "all":
            self.trainable_counts = retrofit.set_trainable(self.model, self.cfg.train, self.step)
            log.print(f"unfreezing at step {self.step} (train.unfreeze_after): "
                      + retrofit.describe_trainable(*self.trainable_counts, self.cfg.train))

    def _check_resume_target(self) -> None:
        """Every rank reads the run directory's state the same way, so a refusal here stops them all."""
        existing = latest_checkpoint(self.run_dir)
        if self.cfg.resume == "never" and existing is not None:
            raise ConfigError(f"resume=never but run.dir={self.run_dir} already holds {existing.name}; "
                              "use resume=auto to continue it or pick another run.dir")
        finished = finished_step(self.run_dir)
        if finished and existing is None and self.cfg.resume in ("auto", "never"):
            raise ConfigError(f"run.dir={self.run_dir} finished at step {finished} ({FINISHED_FILE}) and holds no "
                              "checkpoint: training it again would start at step 0 and replace its metrics; "
                              "pick another run.dir")
        pinned_names(self.run_dir / CHECKPOINTS_DIR)
        if self.info.is_main:
            # A save killed by a full disk leaves its partial directory, holding the room the next save needs.
            for partial in remove_partial_saves(self.run_dir):
                print(f"run.dir={self.run_dir}: removed {partial.name}, a checkpoint save that did not finish",
                      file=sys.stderr)
            for unfinished in unfinished_checkpoints(self.run_dir):
                print(f"run.dir={self.run_dir}: {unfinished.name} has no {META_FILE} (deleted after it was "
                      "written?) and is not resumed from", file=sys.stderr)
        barrier()
        check_room(self.run_dir, count_parameters(build_model(self.cfg, device="meta"))["total"])

    def _open_data(self) -> None:
        cfg = self.cfg
        # Prepared (and its files hashed) once, on rank 0; the other ranks then find it in the cache.
        def open_data():
            return open_samples(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.seed)

        samples = open_data() if self.info.is_main else None
        barrier()
        self.samples = samples if samples is not None else open_data()
        self.tokenizer_file = self.samples.blend.tokenizer_file
        # Copied into run.dir for inference.generate (verified with its dataset); its sha256 goes into every
        # checkpoint's meta.json, so an export can tell it from another run's tokenizer.json.
        usable = self.tokenizer_file is not None and self.tokenizer_file.is_file()
        self.tokenizer_json = self.tokenizer_file.read_bytes() if usable else None
        self.tokenizer_sha256 = hashlib.sha256(self.tokenizer_json).hexdigest() if usable else None
        self.samples.build_for_run(cfg.train.steps, cfg.train.global_batch)  # on every rank at once: collective

    def _downstream_evaluation(self):
        """train.eval_tasks' evaluation (trainer/downstream.py), None without tasks."""
        if not self.cfg.train.eval_tasks:
            return None
        # Imported here: lm-evaluation-harness is the eval extra, which a run without train.eval_tasks needs not.
        from trainer.downstream import DownstreamEvaluation

        return DownstreamEvaluation(self.cfg, self.tokenizer_file or self.cfg.data.tokenizer, self.layout,
                                    self.info.device, self.info.is_main)

    def _document_boundary(self) -> int | None:
        """The end-of-text id documents are masked at (data.document_masking), from the dataset's manifest."""
        if not self.cfg.data.document_masking:
            return None
        eot_id = self.samples.blend.eot_id
        if eot_id is None:
            raise ConfigError(f"data.document_masking=true needs the end-of-text id, which a prepared dataset's "
                              f"manifest records and a Megatron prefix ({self.samples.blend.describe()}) does not; "
                              "prepare the text with scripts.prepare_data or set data.document_masking=false")
        return eot_id

    def _resume(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            path = self._newest_verified_checkpoint()
            if path is None:
                return None
        else:
            path = resolve_checkpoint(resume)  # the user named it: a corrupt one is an error, not skipped
        optimizers = self.optimizer.optimizers
        # Optimizer state exists for what the checkpoint's last step trained: load into that set.
        retrofit.set_trainable(self.model, self.cfg.train, max(0, read_meta(path)["step"] - 1))
        extra, meta = load_checkpoint(path, self.model, optimizers, self.scheduler, self.info.rank,
                                      fingerprint=self.fingerprint, mesh=self.layout.mesh,
                                      verify=resume != "auto")
        self._restore_extra(path, extra, meta["step"])
        return path

    def _restore_extra(self, path: Path, extra: dict, step: int) -> None:
        """This rank's trainer state from the checkpoint's extra file, each field checked before it is used:
        a step that is not the checkpoint's would train at the wrong learning rate and misname checkpoints."""
        name = f"checkpoint {path}: extra/rank_{self.info.rank}.json"
        if not isinstance(extra, dict) or extra.get("step") != step or isinstance(extra.get("step"), bool):
            found = extra.get("step") if isinstance(extra, dict) else extra
            raise CheckpointError(f"{name} has step {found!r}; the checkpoint is of step {step}")
        skipped, sampler = extra.get("skipped_steps", 0), extra.get("sampler")
        if not isinstance(skipped, int) or isinstance(skipped, bool) or not 0 <= skipped <= step:
            raise CheckpointError(f"{name} has skipped_steps {skipped!r}; expected an integer in [0, {step}]")
        counters = ("consumed_samples", "seed", "seq_len", "pass_samples")
        if not isinstance(sampler, dict) or not all(type(sampler.get(key)) is int and sampler[key] >= 0
                                                    for key in counters):
            raise CheckpointError(f"{name} has no usable sampler state; expected integers >= 0 for "
                                  f"{', '.join(counters)}")
        self.sampler.load_state_dict(sampler)
        try:
            set_rng_state(extra.get("rng"))
        except Exception as error:  # torch, numpy and random each reject a bad state with their own error types
            raise CheckpointError(f"{name} has an unusable rng state ({type(error).__name__}: "
                                  f"{str(error).splitlines()[0] if str(error) else ''})") from None
        self.step, self.skipped_steps = step, skipped

    def _newest_verified_checkpoint(self) -> Path | None:
        """resume=auto: the newest checkpoint that verifies, saying which newer ones were skipped and why."""
        path, skipped = newest_verified_checkpoint(self.run_dir)
        if self.info.is_main:
            for _, why in skipped:
                print(f"resume=auto: skipping {why}", file=sys.stderr)
        if path is None and skipped:
            # Starting over would overwrite them step by step; let the user decide.
            raise CheckpointError(f"resume=auto: none of the {len(skipped)} checkpoints in {self.run_dir / 'checkpoints'} "
                                  "verifies (see above); move them away to start the run over")
        return path

    def _checkpoint_train_config(self) -> TrainConfig | None:
        """The train config the resumed checkpoint was written with (None: no checkpoint, or one without it)."""
        if self.resumed_from is None:
            return None
        saved = read_meta(self.resumed_from).get("config", {}).get("train")
        if saved is None:
            return None
        return TrainConfig(**{f.name: saved[f.name] for f in fields(TrainConfig) if f.name in saved})

    def _continue_schedule(self, configured_lrs: list[float]) -> None:
        """Go on with this launch's LR schedule from the resumed step, refusing an LR jump.

        The rule: the schedule may change on resume only where it agrees with the checkpoint's own schedule
        on the last step the checkpoint took. Otherwise the LR would jump, e.g. train.steps raised on a
        finished or decaying wsd run takes the LR from its decayed value back to the peak. Such a run is
        extended from its pre-decay checkpoint (saved and kept for every wsd run), where both schedules are
        still at the peak. A new peak (optim.lr, optim.muon_lr) would jump too, and would otherwise be
        ignored silently (the checkpoint restores its own). train.allow_lr_change=true accepts a jump.
        """
        if self.resumed_from is None:
            return
        old, new = self.resumed_train, self.cfg.train
        if not new.allow_lr_change:
            if old is not None and self.step > 0 and not schedules_agree(self.step - 1, old, new):
                raise ConfigError(self._lr_jump_message(old))
            if self.scheduler.base_lrs != configured_lrs:
                raise ConfigError(self._peak_change_message(configured_lrs))
        set_schedule_step(self.scheduler, self.step, base_lrs=configured_lrs)

    def _peak_change_message(self, configured_lrs: list[float]) -> str:
        def peaks(lrs: list[float]) -> str:
            return "/".join(f"{lr:.3g}" for lr in dict.fromkeys(lrs))

        return (f"resuming {self.resumed_from} with peak lr {peaks(configured_lrs)} (optim.lr, optim.muon_lr) but it "
                f"was trained at {peaks(self.scheduler.base_lrs)}; drop the override, or set "
                "train.allow_lr_change=true to train on at the new peak")

    def _lr_jump_message(self, old: TrainConfig) -> str:
        new, step, base_lr = self.cfg.train, self.step, self.scheduler.base_lrs[0]
        changed = ", ".join(f"train.{key}={getattr(new, key)} (checkpoint: {getattr(old, key)})"
                            for key in SCHEDULE_KEYS if getattr(old, key) != getattr(new, key))
        pre_decay = self._pre_decay_checkpoint(old)
        fix = (f"to extend a wsd run, resume from its pre-decay checkpoint: resume={pre_decay} run.dir=<a new dir>"
               if pre_decay else "start a new run.dir instead")
        return (f"resuming {self.resumed_from} with {changed or 'this schedule'} would move the lr from "
                f"{base_lr * lr_multiplier(step - 1, old):.3g} at step {step} to "
                f"{base_lr * lr_multiplier(step, new):.3g} at step {step + 1}; {fix}, or set "
                "train.allow_lr_change=true to accept the jump")

    def _pre_decay_checkpoint(self, old: TrainConfig) -> Path | None:
        """The resumed run's checkpoint from just before its wsd decay, if it holds one this schedule can
        continue from without an LR jump."""
        start = wsd_decay_start(old)
        path = checkpoint_path(self.resumed_from.parent.parent, start)
        usable = (old.schedule == "wsd" and 0 < start < self.step and (path / META_FILE).is_file()
                  and schedules_agree(start - 1, old, self.cfg.train))
        return path if usable else None

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to train.steps (a finished run is left as it is); the run directory is released at the end."""
        try:
            if self.step >= self.cfg.train.steps:
                self._report_complete()
                return {}
            with self._disk_full_as_error():
                return self._train()
        finally:
            self.close()

    def _report_complete(self) -> None:
        if not self.info.is_main:
            return
        old = self.resumed_train or self.cfg.train
        pre_decay = self._pre_decay_checkpoint(old)
        more = (f"to train longer, extend it from its pre-decay checkpoint: resume={pre_decay} "
                f"train.steps=<more> run.dir=<a new dir>" if pre_decay else "to train longer, start a new run.dir")
        print(f"run already complete at step {self.step}/{self.cfg.train.steps}, nothing changed in {self.run_dir}; "
              f"{more} (a larger train.steps here would raise the decayed lr again)", file=sys.stderr)

    @contextlib.contextmanager
    def _disk_full_as_error(self):
        """A full disk becomes one line naming the run directory, not a traceback from inside a writer."""
        try:
            yield
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            if not is_disk_full(error):
                raise
            raise disk_full_error(self.run_dir, self.step, latest_checkpoint(self.run_dir)) from error

    def _write_run_files(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.info.is_main:
            return
        write_file(self.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)), root=self.run_dir)
        if self.tokenizer_json is not None:
            write_file(self.run_dir / "tokenizer.json", self.tokenizer_json, root=self.run_dir)
        if self.pre_decay_step is not None and self.step < self.pre_decay_step:
            pin_checkpoint(self.run_dir, self.pre_decay_step)

    def _train(self) -> dict:
        cfg, train = self.cfg, self.cfg.train
        self._write_run_files()
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
                self._maybe_crash()
                watchdog.start(self.step + 1)
                self._unfreeze_if_due(log)
                profiler.before_step(self.step + 1)
                record = self.train_step()
                trace = profiler.after_step(self.step)
                if trace is not None:
                    log.print(f"profile trace {trace}")
                self._clear_crash_marker()
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
                published = self.saver.poll()  # the save in flight, once every rank's write is done
                if published is not None:
                    log.print(f"checkpoint {published} written")
                stopping = train.stop_after is not None and steps_this_launch >= train.stop_after
                if (self.step % train.ckpt_every == 0 or self.step == train.steps or stopping
                        or self.step == self.pre_decay_step):
                    path = self.save()
                    log.print(f"checkpoint {path}" + (" writing in the background" if self.saver.in_flight else ""))
                watchdog.finish()
                if stopping:
                    log.print(f"stopping after {steps_this_launch} steps (train.stop_after); resume=auto continues")
                    break
            published = self.saver.wait()  # training ends when its last checkpoint is written
            if published is not None:
                log.print(f"checkpoint {published} written")
            if self.step == train.steps and self.info.is_main:
                record_finished(self.run_dir, self.step)
        finally:
            watchdog.close()
            trace = profiler.close()  # a launch stopped inside the range keeps the steps it profiled
            if trace is not None:
                log.print(f"profile trace {trace}")
            log.close()
        return record

    def _announce(self, log: MetricsLogger) -> None:
        cfg, info = self.cfg, self.info
        # Under fsdp a parameter is a DTensor whose numel is the whole tensor's; this rank holds its shard.
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self.model.parameters())
        resumed = f", resumed from {self.resumed_from}" if self.resumed_from else ""
        log.print(f"run {self.run_dir}: model={cfg.model.d_model}d x {cfg.model.n_blocks} blocks "
                  f"({n_params / 1e6:.1f}M params on this rank), variant={cfg.model.residual.variant}, "
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

    def _crash_marker(self) -> Path:
        return self.run_dir / f".crash_injected_rank{self.info.rank}"

    def _maybe_crash(self) -> None:
        """debug.crash_at_step: SIGKILL this process once at that step, on debug.crash_rank or every rank (a
        marker per rank stops a loop of crashes): no cleanup runs, as when a node's OOM killer strikes."""
        debug = self.cfg.debug
        marker = self._crash_marker()
        if (debug.crash_at_step is not None and self.step == debug.crash_at_step
                and debug.crash_rank in (None, self.info.rank) and not marker.exists()):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_sleep(self) -> None:
        """debug.sleep_at_step: rank debug.sleep_rank sleeps debug.sleep_s seconds inside that step (a planted hang)."""
        debug = self.cfg.debug
        if debug.sleep_at_step == self.step + 1 and self.info.rank == debug.sleep_rank:
            time.sleep(debug.sleep_s)

    def _clear_crash_marker(self) -> None:
        """Once past debug.crash_at_step the marker has done its job; the run directory keeps no trace of it."""
        at = self.cfg.debug.crash_at_step
        if at is not None and self.step > at:
            self._crash_marker().unlink(missing_ok=True)

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
        cfg, train = self.cfg, self.cfg.train
        start = time.perf_counter()
        self._maybe_sleep()
        samples = self.sampler.next_batch(train.global_batch, self.layout.dp_rank, self.layout.data_ranks)
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
        loss = self.engine.forward_backward(micro_batches, self._autocast, diagnostics).item()
        if self.step + 1 in cfg.debug.nan_loss_steps:
            loss = float("nan")
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        grad_norm = self.engine.clip_grad_norm(train.grad_clip)
        sync_moe_load(self.model, self.layout)
        imbalance = moe_load_imbalance(self.model, self.layout)
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

    def _diagnostics(self, model, recorded: dict) -> dict:
        """Per-sublayer output RMS and depth weights (from the first micro-batch), per-block gradient RMS."""
        grad_rms = {}
        for index, block in model.layers.items():
            squares = [p.grad.float().pow(2).sum() for p in block.parameters() if p.grad is not None]
            # Under FSDP a gradient is a DTensor shard: full_tensor() sums the shards' squares over the ranks.
            grads = [square.full_tensor() if isinstance(square, DTensor) else square for square in squares]
            count = sum(p.numel() for p in block.parameters() if p.grad is not None)
            grad_rms[index] = math.sqrt(torch.stack(grads).sum().item() / count) if grads else 0.0
        out = {"output_rms": {str(k): v for k, v in recorded.get("output_rms", {}).items()}, "grad_rms": grad_rms}
        weights = recorded.get("depth_weights")
        if weights:
            out["depth_weights"] = {str(l): {str(i): w for i, w in row.items()} for l, row in weights.items()}
            out["depth_entropy"] = {str(l): entropy(list(row.values())) for l, row in weights.items()}
        return out

    def validation_loss(self) -> float:
        """Mean loss over the fixed validation samples; data-parallel ranks split the batches."""
        train = self.cfg.train
        batches = [tuple(t.to(self.info.device) for t in batch)
                   for batch in self.samples.val_batches(train.micro_batch, train.eval_batches)]
        loss_sum, tokens = self.engine.loss_totals(batches, self._autocast)
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        if self.layout.dp_group is not None:
            torch.distributed.all_reduce(totals, group=self.layout.dp_group)
        return (totals[0] / totals[1]).item()

    def _evaluate_tasks(self, log: MetricsLogger, tokens: int) -> None:
        """train.eval_tasks on the live model, before the step's checkpoint; its metrics get a row of their own
        at this step. The RNGs are put back as they were, so training goes on as it would have without it."""
        state = rng_state()
        try:
            with self._autocast():
                metrics = self.downstream.run(self.model)
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
