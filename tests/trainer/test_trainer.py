"""The trainer: exact resume (single process and DDP, fp32 and bf16), checkpoints across precisions, DDP ==
single process, crash recovery, non-finite steps, and refusals that name what is wrong."""
import hashlib
import json
import shutil

import pytest
import torch

from conftest import fast_train_overrides, job_output, launch_job, task_rows
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import CheckpointError, latest_checkpoint, seal_meta
from trainer.config import ConfigError, load_config
from trainer.trainer import NonFiniteError, Trainer


def train(overrides):
    return Trainer(load_config(overrides), init_distributed()).fit()


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}  # train.eval_tasks rows have none


BF16 = {"train.precision": "bf16"}
# bf16 against fp32 on the mean loss of the same weights and batch (128 tokens): measured 4.4e-5 and 8.4e-5
# relative on the first step after the checkpoint (up to 1.7e-4 where a near-tied router score moves a
# token's experts), the two precisions' training drifting apart to 2.3e-4 within 4 steps; held to u / 4 =
# 9.8e-4 (u = 2^-8, bf16's unit roundoff), 4x the worst. Resumed with fresh AdamW moments instead, the next
# step's loss moved by 3.1e-2.
CROSS_PRECISION_REL = torch.finfo(torch.bfloat16).eps / 2 / 4


def assert_continues(moved, reference, steps) -> None:
    """A run resumed in the other precision continues the uninterrupted run: its checkpoint's fp32 master
    weights and AdamW state loaded."""
    found, expected = losses(moved), losses(reference)
    assert sorted(found) == sorted(expected)
    for step in steps:
        assert found[step] == pytest.approx(expected[step], rel=CROSS_PRECISION_REL), (moved.name, step)


@pytest.mark.slow
def test_stop_and_resume_gives_the_uninterrupted_losses_bitwise(tmp_path, tiny_dataset):
    """fp32 (train.precision=auto on CPU); its step-4 checkpoint also continues in bf16."""
    train(fast_train_overrides(tmp_path / "straight", tiny_dataset, steps=8))
    train(fast_train_overrides(tmp_path / "resumed", tiny_dataset, steps=8, **{"train.stop_after": 4}))
    assert latest_checkpoint(tmp_path / "resumed").name == "step_00000004"
    assert max(losses(tmp_path / "resumed")) == 4
    shutil.copytree(tmp_path / "resumed", tmp_path / "in_bf16")
    train(fast_train_overrides(tmp_path / "resumed", tiny_dataset, steps=8))
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(1, 9))
    assert straight == resumed  # bitwise: float equality of every step's loss
    val = lambda d: [r["val_loss"] for r in metrics(d) if "val_loss" in r]  # noqa: E731
    assert val(tmp_path / "straight") == val(tmp_path / "resumed")
    train(fast_train_overrides(tmp_path / "in_bf16", tiny_dataset, steps=8, **BF16))
    assert "(single process, cpu, bf16;" in (tmp_path / "in_bf16" / "train.log").read_text()
    assert_continues(tmp_path / "in_bf16", tmp_path / "straight", steps=range(5, 9))


@pytest.mark.slow
def test_bf16_loss_falls_and_resumes_bitwise_and_its_checkpoint_continues_in_fp32(tmp_path, tiny_dataset):
    """train.precision=bf16 on CPU: autocast, fp32 master weights; 2 steps, stop, 2 more == 4 straight."""
    straight, resumed, in_fp32 = tmp_path / "straight", tmp_path / "resumed", tmp_path / "in_fp32"
    trainer = Trainer(load_config(fast_train_overrides(straight, tiny_dataset, steps=4, **BF16)), init_distributed())
    trainer.fit()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert "(single process, cpu, bf16;" in (straight / "train.log").read_text()
    loss = losses(straight)
    assert loss[4] < loss[1] - 0.5  # measured 6.70 -> 5.55
    train(fast_train_overrides(resumed, tiny_dataset, steps=4, **BF16, **{"train.stop_after": 2}))
    shutil.copytree(resumed, in_fp32)
    train(fast_train_overrides(resumed, tiny_dataset, steps=4, **BF16))
    assert losses(resumed) == loss  # bitwise
    val = lambda d: [r["val_loss"] for r in metrics(d) if "val_loss" in r]  # noqa: E731
    assert val(resumed) == val(straight)
    train(fast_train_overrides(in_fp32, tiny_dataset, steps=4, **{"train.precision": "fp32"}))
    assert "(single process, cpu, fp32;" in (in_fp32 / "train.log").read_text()
    assert_continues(in_fp32, straight, steps=range(3, 5))


@pytest.mark.slow
def test_loss_falls_and_metrics_and_diagnostics_are_written(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=12, **{"optim.lr": 1e-2, "train.diag_every": 6}))
    records = metrics(run)
    for key in ["step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_mb", "moe_load_imbalance"]:
        assert key in records[0], key
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 4 and val[-1] < val[0] - 0.3
    diagnostics = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diagnostics] == [6, 12]
    last = diagnostics[-1]
    assert len(last["output_rms"]) == 8 and len(last["grad_rms"]) == 4
    assert set(last["depth_weights"]) == {str(l) for l in range(1, 10)}  # 8 sublayers + the final read
    for row in last["depth_weights"].values():
        assert sum(row.values()) == pytest.approx(1.0, abs=1e-6)
    assert (run / "config.yaml").is_file()


def test_non_finite_step_is_skipped_and_too_many_stop_the_run(tmp_path, tiny_dataset):
    run = tmp_path / "skip"
    train(fast_train_overrides(run, tiny_dataset, steps=5, **{"debug.nan_loss_steps": "[2]"}))
    records = metrics(run)
    assert records[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if r["step"] != 2)

    stop = tmp_path / "stop"
    with pytest.raises(NonFiniteError, match="3 steps in a row"):
        train(fast_train_overrides(stop, tiny_dataset, steps=6, **{
            "debug.nan_loss_steps": "[4,5,6]", "train.max_bad_steps": 3, "train.ckpt_every": 100,
            "train.schedule": "cosine"}))  # cosine: no pre-decay checkpoint (wsd saves one at step 5)
    assert latest_checkpoint(stop) is None


def test_resume_with_another_variant_names_the_mismatch(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=3))
    with pytest.raises(CheckpointError, match="variant"):
        train(fast_train_overrides(run, tiny_dataset, steps=6, variant="full"))


def test_resume_never_refuses_to_overwrite_checkpoints(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=3))
    with pytest.raises(ConfigError, match="resume=never"):
        train(fast_train_overrides(run, tiny_dataset, steps=6, resume="never"))


# lm_eval's local tasks on the live model at steps 3 and 6, 8 examples each (about a second a time): the word
# tasks' accuracies, and attnres_text's perplexities, which move with every weight (bits per byte 3.71 -> 3.59).
EVAL_TASKS = {"train.eval_tasks": "[attnres_local,attnres_text]", "train.eval_tasks_every": 3,
              "train.eval_tasks_limit": 8}


PLANTED_HANG = {"train.steps": 2, "train.hang_after_s": 1.5, "debug.sleep_at_step": 2, "debug.sleep_s": 3,
                "debug.sleep_rank": 1}


@launch_job(2)
def ddp_runs(root, dataset):
    """A run with train.eval_tasks; a run stopped after 3 steps and resumed (in processes whose RNGs have moved
    on since); a run whose rank 1 sleeps inside step 2 (hang diagnosis)."""
    return [fast_train_overrides(root / run, dataset, steps=6, **extra) for run, extra in
            [("ddp", EVAL_TASKS), ("ddp_resumed", {"train.stop_after": 3}), ("ddp_resumed", {}), ("hang", PLANTED_HANG)]]


@pytest.fixture
def ddp_launch(launched):
    """The DDP runs of the session's 2-rank launch: their directories and the ranks' stderr."""
    root = launched(ddp_runs)
    return {run: root / run for run in ("ddp", "ddp_resumed", "hang")}, job_output(root)


def test_ddp_matches_single_process_and_resumes_exactly(tmp_path, tiny_dataset, ddp_launch):
    """Both runs evaluate lm_eval's tasks on the live model at steps 3 and 6: the same scores at the same steps,
    and training goes on as in the run without them (ddp_resumed), bitwise."""
    single = tmp_path / "single"
    train(fast_train_overrides(single, tiny_dataset, steps=6, **EVAL_TASKS))
    runs, _ = ddp_launch
    one, two, two_resumed = losses(single), losses(runs["ddp"]), losses(runs["ddp_resumed"])
    assert two == two_resumed  # DDP resume is bitwise too
    scores, ddp_scores = task_rows(single), task_rows(runs["ddp"])
    accuracies = {"eval/attnres_mc_words/acc", "eval/attnres_mc_words/acc_norm", "eval/attnres_gen_words/exact_match"}
    perplexities = {f"eval/attnres_text/{name}" for name in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
    assert sorted(scores) == sorted(ddp_scores) == [3, 6] and set(scores[6]) == set(ddp_scores[6]) == accuracies | perplexities
    for step in scores:
        assert {key: ddp_scores[step][key] for key in accuracies} == {key: scores[step][key] for key in accuracies}
        # The weights agree up to float summation order, as the losses do.
        assert ddp_scores[step] == pytest.approx(scores[step], rel=1e-5), step
    assert scores[6]["eval/attnres_text/bits_per_byte"] < scores[3]["eval/attnres_text/bits_per_byte"]
    log = (single / "train.log").read_text()
    assert "eval tasks at step 6: attnres_mc_words/acc" in log
    # A step's row is written before its checkpoint: a launch killed between the two redoes both on resume.
    assert log.index("eval tasks at step 3") < log.index(f"checkpoint {single / 'checkpoints' / 'step_00000003'}")
    # Same global batch, gradients averaged over 2 ranks instead of accumulated in one: equal up to
    # float summation order.
    assert sorted(one) == sorted(two)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step


def test_a_rank_sleeping_inside_a_step_gets_both_ranks_stacks_written(ddp_launch):
    """Rank 1 sleeps in step 2; rank 0 waits for it in a collective. Both overrun train.hang_after_s, so both
    write their stacks and a line naming the rank and the step (rank 0 into train.log, rank 1 on stderr)."""
    runs, stderr = ddp_launch
    hang = runs["hang"] / "hang"
    sleeper, waiter = (hang / "rank1_step2.txt").read_text(), (hang / "rank0_step2.txt").read_text()
    assert "in _maybe_sleep" in sleeper
    assert "in train_step" in waiter and "in _maybe_sleep" not in waiter
    assert "hang: rank 0, step 2 has run" in (runs["hang"] / "train.log").read_text()
    assert "hang: rank 1, step 2 has run" in stderr


def test_a_rank_killed_mid_training_is_restarted_by_torchrun_and_ends_like_the_uninterrupted_run(
        tmp_path, tiny_dataset, ddp_launch, torchrun):
    """Rank 1 is SIGKILLed after step 4 (checkpoint at step 3); torchrun's agent stops rank 0, restarts both,
    resume=auto continues from step 3, and the losses are bitwise those of the launch's uninterrupted 2-rank
    run (same processes, threads and AdamW)."""
    runs, _ = ddp_launch
    crashed = tmp_path / "crashed"
    result = torchrun(fast_train_overrides(crashed, tiny_dataset, steps=6, **{
        "debug.crash_at_step": 4, "debug.crash_rank": 1}), nproc=2, max_restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr  # the agent saw rank 1 SIGKILLed, restarted both
    assert f"resumed from {crashed / 'checkpoints' / 'step_00000003'}" in (crashed / "train.log").read_text()
    assert [r["step"] for r in metrics(crashed)] == [1, 2, 3, 4, 5, 6]  # steps 4-6 logged once, after the restart
    assert losses(crashed) == losses(runs["ddp"])
    assert not list(crashed.glob(".crash_injected_rank*"))


def reseal_extra(checkpoint, rank: int, change) -> None:
    """Edit extra/rank_<rank>.json as someone would who also recomputes every checksum."""
    extra_file, meta_file = checkpoint / "extra" / f"rank_{rank}.json", checkpoint / "meta.json"
    extra = json.loads(extra_file.read_text())
    change(extra)
    extra_file.write_text(json.dumps(extra))
    meta = json.loads(meta_file.read_text())
    meta["files"][f"extra/rank_{rank}.json"] = {"bytes": extra_file.stat().st_size,
                                                "sha256": hashlib.sha256(extra_file.read_bytes()).hexdigest()}
    meta_file.write_text(json.dumps(seal_meta(meta)))


def test_a_rank_failing_alone_ends_the_job_at_once_naming_its_error(tmp_path, tiny_dataset, ddp_launch, torchrun):
    """Rank 1 alone refuses its extra file at start-up while rank 0 goes on into the first step's all-reduce,
    where nothing would end its wait before parallel.init_timeout_s (600 s, the default). Rank 0 reads rank
    1's failure from the job's store (parallel/failure.py) and stops with a line naming it: the launch ends
    within the subprocess limit of 120 s, start-up included."""
    runs, _ = ddp_launch
    run = tmp_path / "run"
    shutil.copytree(runs["ddp_resumed"], run)
    shutil.rmtree(run / "checkpoints" / "step_00000006")  # the run is back at an earlier checkpoint
    (run / "finished.json").unlink()
    checkpoint = latest_checkpoint(run)
    step = int(checkpoint.name.removeprefix("step_"))
    reseal_extra(checkpoint, 1, lambda extra: extra.update(step=99))
    result = torchrun(fast_train_overrides(run, tiny_dataset, steps=6), nproc=2, timeout=120)
    assert result.returncode != 0
    refusal = f"checkpoint {checkpoint}: extra/rank_1.json has step 99; the checkpoint is of step {step}"
    assert f"error: {refusal}\n" in result.stderr
    assert f"error: rank 0 stops because rank 1: CheckpointError: {refusal}\n" in result.stderr
    assert "Error executing job" not in result.stderr  # Hydra's header of a rank's traceback


def test_a_collective_timeout_is_one_line_and_ends_the_peer(tmp_path, tiny_dataset, torchrun):
    """Rank 1 sleeps 60 s inside step 2; rank 0's collective times out after parallel.collective_timeout_s
    (2 s) and says so in one line, with no second traceback from leaving; rank 1, still asleep, reads that
    failure from the job's store and stops with a line naming it, long before its sleep would end."""
    result = torchrun(fast_train_overrides(tmp_path / "run", tiny_dataset, steps=3, **{
        "parallel.collective_timeout_s": 2, "debug.sleep_at_step": 2, "debug.sleep_s": 60, "debug.sleep_rank": 1}),
        nproc=2, timeout=55)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    timeout = [line for line in lines if line.startswith("error: rank 0: a collective timed out")]
    assert len(timeout) == 1 and "parallel.collective_timeout_s" in timeout[0], result.stderr[-3000:]
    assert any(line.startswith("error: rank 1 stops because rank 0: ") for line in lines), result.stderr[-3000:]
    assert "During handling" not in result.stderr and "Error executing job" not in result.stderr
