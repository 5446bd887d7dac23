"""What the trainer reads back from a run directory it is handed (issue 24, causes 1, 3 and 7): a link in it
is refused before anything is written, every writer replaces a link rather than write through it, and
every field of meta.json, extra/rank_r.json and pinned.json is checked, a damaged meta.json being
corruption (skip and fall back), an edited one a one-line refusal, never a traceback or a wrong run."""
import hashlib
import json
import shutil
import time

import pytest

from conftest import fast_train_overrides
from json_mutations import mutated_documents
from parallel.dims import init_distributed
from scripts.report.runs import read_run_config
from trainer.run_dir.checkpoint import (
    CheckpointError,
    _complete_checkpoints,
    _prune,
    newest_verified_checkpoint,
    pinned_names,
    read_meta,
    seal_meta,
)
from trainer.config import ConfigError, load_config
from trainer.run_dir.finished import FINISHED_FILE, finished_step
from trainer.run_dir.lock import RunDirError, check_run_dir
from trainer.metrics import keep_rows_up_to
from trainer.resume import restore_extra
from trainer.files.safe_io import LinkedPathError, append_text, first_link, write_file
from trainer.trained import load_trained
from trainer.trainer import Trainer

STEPS = 6  # checkpoints at steps 3 and 6, and at 5 where wsd decay starts (pinned)


def trainer(run, dataset, **extra):
    return Trainer(load_config(fast_train_overrides(run, dataset, steps=STEPS, **extra)), init_distributed())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("trust") / "run"
    trainer(run, tiny_dataset).fit()
    return run


@pytest.fixture
def run(tmp_path, finished_run):
    """A copy of the finished run, free to damage."""
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


def checkpoint(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def edit_json(file, change, seal=True):
    document = json.loads(file.read_text())
    change(document)
    file.write_text(json.dumps(seal_meta(document) if seal else document))


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# -- cause 1: links -------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["config.yaml", "tokenizer.json", "train.log", ".trainer.lock",
                                   "checkpoints/pinned.json", "checkpoints/step_00000006"])
def test_a_link_in_run_dir_is_refused_before_anything_is_written(tmp_path, run, tiny_dataset, entry, capsys):
    victim = tmp_path / "victim"
    if entry.startswith("checkpoints/step_"):
        shutil.move(run / entry, victim)  # a checkpoint that now lives elsewhere, through a link
    else:
        victim.write_text("precious\n")
        (run / entry).unlink(missing_ok=True)
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in [victim, *victim.rglob("*")])
    (run / entry).symlink_to(victim)
    expected = (f"run.dir={run}: {entry} is a symlink (to {victim}); a run directory must hold only regular files "
                "and directories, since a link would redirect the run's writes; remove it or pick another run.dir")
    with pytest.raises(RunDirError) as refused:
        trainer(run, tiny_dataset, **{"train.steps": 9})
    assert one_line(refused) == expected
    with pytest.raises(RunDirError) as checked:
        check_run_dir(run, 1000)
    assert one_line(checked) == expected
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in [victim, *victim.rglob("*")]) == before
    assert (run / entry).is_symlink()


def test_writers_replace_a_link_planted_after_the_start_check(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "train.log", "metrics.jsonl"):
        (run / name).symlink_to(victim)
    write_file(run / "config.yaml", "a: 1\n")
    with pytest.raises(LinkedPathError):
        append_text(run / "train.log", "a line\n")
    keep_rows_up_to(run / "metrics.jsonl", 0)  # drops the unparsable last line by rewriting the file
    assert victim.read_text() == "precious\n"
    assert (run / "config.yaml").read_text() == "a: 1\n" and not (run / "config.yaml").is_symlink()
    assert (run / "metrics.jsonl").read_text() == "" and not (run / "metrics.jsonl").is_symlink()


def test_pruning_removes_a_planted_link_not_its_target(tmp_path, run):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine\n")
    checkpoints = run / "checkpoints"
    (checkpoints / ".tmp-step_00000009").symlink_to(elsewhere)
    (checkpoints / "step_00000002").symlink_to(elsewhere)
    assert [p.name for p in _complete_checkpoints(checkpoints)] == ["step_00000003", "step_00000005", "step_00000006"]
    _prune(checkpoints, keep_last=1, saved=checkpoint(run, 6))
    assert (elsewhere / "keep").read_text() == "mine\n"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["pinned.json", "step_00000002", "step_00000005",
                                                              "step_00000006"]


def test_first_link_looks_at_every_depth_but_inside_wandb(tmp_path):
    (tmp_path / "wandb" / "run-1").mkdir(parents=True)
    (tmp_path / "wandb" / "latest-run").symlink_to(tmp_path / "wandb" / "run-1")
    (tmp_path / "checkpoints" / "step_00000001" / "extra").mkdir(parents=True)
    assert first_link(tmp_path, skip=("wandb",)) is None
    assert first_link(tmp_path) == tmp_path / "wandb" / "latest-run"
    planted = tmp_path / "checkpoints" / "step_00000001" / "extra" / "rank_1.json"
    planted.symlink_to("/etc/hostname")
    assert first_link(tmp_path, skip=("wandb",)) == planted


# -- cause 3: meta.json, extra, pinned.json -------------------------------------------------------

def test_damage_to_meta_json_is_corruption_and_resume_falls_back(run, tiny_dataset, capsys):
    meta_file = checkpoint(run, 6) / "meta.json"
    text = meta_file.read_text()
    assert '"lr": 0.003' in text
    meta_file.write_text(text.replace('"lr": 0.003', '"lr": 0.005', 1))  # one character: still valid JSON
    found, skipped = newest_verified_checkpoint(run)
    assert found == checkpoint(run, 5)
    assert [why for _, why in skipped] == [
        f"checkpoint {checkpoint(run, 6)} is corrupt: its meta.json does not match its own meta_sha256 "
        "(its content changed after it was written)"]
    resumed = trainer(run, tiny_dataset)
    resumed.close()
    assert resumed.step == 5
    assert "resume=auto: skipping checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.update(step=-100), "has step -100; expected an integer >= 0"),
    (lambda m: m.update(step="x"), "has step 'x'; expected an integer >= 0"),
    (lambda m: m.update(step=True), "has step True; expected an integer >= 0"),
    (lambda m: m.update(step=5), "records step 5, not the 6 its directory is named for"),
    (lambda m: m.update(world_size=0), "has world_size 0; expected an integer >= 1"),
    (lambda m: m.update(format=7), "has format 7; this trainer reads formats 2 and 3"),
    (lambda m: m["files"].update({"../../outside": {"bytes": 1, "sha256": "0" * 64}}),
     "lists '../../outside' among its files; expected a path inside the checkpoint"),
    (lambda m: m["files"][".metadata"].update(bytes="12"), "has a malformed record for .metadata"),
    (lambda m: m["config"]["train"].update(steps="abc"), "holds a config this trainer refuses"),
    (lambda m: m["config"]["optim"].update(lr=-1.0), "holds a config this trainer refuses (optim.lr=-1.0 must be "
                                                     "a positive finite number)"),
    # Values that raised OverflowError from inside the checks, which resume=auto did not fall back past.
    (lambda m: m["config"]["train"].update(eval_tasks_limit=float("inf")),
     "holds a config this trainer refuses (train.eval_tasks_limit=inf must be a whole number >= 1"),
    (lambda m: m["config"].update(seed=10 ** 23), "holds a config this trainer refuses (seed=100000000000000000000000 "
                                                  "must be an integer in [0, 2**63 - 1"),
    (lambda m: m["config"]["parallel"].update(collective_timeout_s=1e15),
     "holds a config this trainer refuses (parallel.collective_timeout_s=1000000000000000.0 is longer than the "
     "604800 seconds (7 days)"),
    (lambda m: m["config"]["model"].update(n_blocks=1_000_000),
     "holds a config this trainer refuses (model.n_blocks=1000000 must be in [1, 1024]"),
])
def test_an_edited_meta_json_is_refused_in_one_line(run, change, problem):
    path = checkpoint(run, 6)
    edit_json(path / "meta.json", change)
    with pytest.raises(CheckpointError) as refused:
        read_meta(path)
    assert one_line(refused).startswith(f"checkpoint {path} is corrupt: its meta.json {problem}")
    assert newest_verified_checkpoint(run)[0] == checkpoint(run, 5)


@pytest.mark.parametrize("change, built", [
    (lambda m: m["config"]["model"].update(vocab_size=2 ** 45), "6,755,399,441,874,530 weights (model.n_blocks=4, "
                                                                "model.d_model=96)"),  # 13 PB of fp32
    (lambda m: m["config"]["model"].update(n_blocks=1024), "237,933,980 weights (model.n_blocks=1024, model.d_model=96)"),
])
def test_a_config_larger_than_the_weights_is_refused_before_the_model_is_built(run, change, built):
    """Sized from the config and the checkpoint's .metadata alone, before anything is built: 1024 blocks took 4 s
    to build even on the meta device (a million, about an hour, had n_blocks no bound)."""
    path = checkpoint(run, 6)
    edit_json(path / "meta.json", change)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        load_trained(path)
    assert time.perf_counter() - start < 2
    assert one_line(refused) == (f"checkpoint {path}: the config in its meta.json builds a model of {built}, the "
                                 "checkpoint holds 917,090")


def saved_before_the_renames(meta):
    """meta.json as the trainer wrote it before variant.variant became variant.kind and model.kernel_impl=reference
    became torch (trainer/config.py's RENAMED_KEYS, RENAMED_VALUES)."""
    model = meta["config"]["model"]
    model["residual"]["variant"] = model["residual"].pop("kind")
    model["kernel_impl"] = "reference"
    meta["model_fingerprint"] = meta["model_fingerprint"].replace(" variant.kind=", " variant.variant=")


@pytest.mark.slow
def test_a_run_saved_before_the_renames_reads_and_resumes(run, finished_run, tiny_dataset):
    """The run directories of runs in progress at the renames: their checkpoints' meta.json (config and model
    fingerprint) and config.yaml (scripts.report's read) hold the old key and value, and the run resumes and
    finishes as it would have."""
    shutil.rmtree(checkpoint(run, STEPS))  # in progress: its newest checkpoint is step 5's
    (run / FINISHED_FILE).unlink()
    for meta in (run / "checkpoints").glob("step_*/meta.json"):
        edit_json(meta, saved_before_the_renames)
    config_yaml = run / "config.yaml"
    text = config_yaml.read_text()
    assert text.count("    kind: block\n") == 1 and text.count("  kernel_impl: auto\n") == 1
    config_yaml.write_text(text.replace("    kind: block\n", "    variant: block\n")
                           .replace("  kernel_impl: auto\n", "  kernel_impl: reference\n"))
    saved = read_run_config(run).model
    assert (saved.residual.kind, saved.kernel_impl) == ("block", "torch")
    assert load_trained(checkpoint(run, 5)).cfg.model.residual.kind == "block"
    trainer(run, tiny_dataset).fit()
    assert finished_step(run) == STEPS
    resumed, straight = ([json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()][-1]
                         for path in (run, finished_run))
    assert (resumed["step"], resumed["loss"], resumed["grad_norm"]) == (STEPS, straight["loss"], straight["grad_norm"])


def rewrite_extra(path, change=None, text=None):
    """Edit extra/rank_0.json (or replace its text) as someone would who also recomputes every checksum."""
    extra_file = path / "extra" / "rank_0.json"
    if text is None:
        extra = json.loads(extra_file.read_text())
        change(extra)
        text = json.dumps(extra)
    extra_file.write_text(text)

    def record(meta):
        meta["files"]["extra/rank_0.json"] = {"bytes": extra_file.stat().st_size,
                                              "sha256": hashlib.sha256(extra_file.read_bytes()).hexdigest()}
    edit_json(path / "meta.json", record)


def test_an_edited_extra_step_is_refused_and_writes_nothing(run, tiny_dataset):
    rewrite_extra(checkpoint(run, 6), lambda e: e.update(step=-100))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(CheckpointError) as refused:
        trainer(run, tiny_dataset, **{"train.steps": 9})
    assert one_line(refused) == (f"checkpoint {checkpoint(run, 6)}: extra/rank_0.json has step -100; the "
                                 "checkpoint is of step 6")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_resealed_extra_nested_past_the_parser_is_one_line(run, tiny_dataset):
    path = checkpoint(run, 6)
    rewrite_extra(path, text="[" * 50_000)
    with pytest.raises(CheckpointError) as refused:
        trainer(run, tiny_dataset, **{"train.steps": 9})
    assert one_line(refused).startswith(f"checkpoint {path}: extra/rank_0.json could not be read (")


def test_a_meta_json_nested_past_the_parser_is_one_line(run):
    path = checkpoint(run, 6)
    (path / "meta.json").write_text("[" * 50_000)
    with pytest.raises(CheckpointError) as refused:
        read_meta(path)
    assert one_line(refused).startswith(f"checkpoint {path} has an unreadable meta.json")


@pytest.fixture(scope="module")
def fresh_trainer(tmp_path_factory, tiny_dataset):
    """A trainer that has resumed from nothing, whose sampler takes the extra states handed to restore_extra."""
    made = trainer(tmp_path_factory.mktemp("fresh") / "run", tiny_dataset)
    yield made
    made.close()


@pytest.mark.parametrize("change, problem", [
    (lambda e: e.update(step="x"), "has step 'x'; the checkpoint is of step 6"),
    (lambda e: e.pop("sampler"), "has no usable sampler state; expected integers >= 0 for consumed_samples, "
                                 "seed, seq_len, pass_samples"),
    (lambda e: e["sampler"].update(consumed_samples=-4), "has no usable sampler state"),
    (lambda e: e["rng"].update(torch="AAAA"), "has an unusable rng state (RuntimeError: "),
    (lambda e: e["rng"].pop("numpy"), "has an unusable rng state (KeyError: 'numpy')"),
    (lambda e: e.update(skipped_steps=-1), "has skipped_steps -1; expected an integer in [0, 6]"),
])
def test_an_edited_extra_field_is_refused_in_one_line(finished_run, fresh_trainer, change, problem):
    path = checkpoint(finished_run, 6)
    extra = json.loads((path / "extra" / "rank_0.json").read_text())
    change(extra)
    with pytest.raises(CheckpointError) as refused:
        restore_extra(path, extra, 6, 0, fresh_trainer.sampler)
    assert one_line(refused).startswith(f"checkpoint {path}: extra/rank_0.json {problem}")


def test_a_malformed_pinned_json_is_refused_at_start(run, tiny_dataset):
    pinned = run / "checkpoints" / "pinned.json"
    pinned.write_text('{"step_00000003": true}')
    with pytest.raises(CheckpointError) as refused:
        trainer(run, tiny_dataset, **{"train.steps": 9})
    assert one_line(refused) == (f"{pinned} is not a JSON list of checkpoint names (step_XXXXXXXX); fix or delete it "
                                 "(it only keeps the checkpoints it names from pruning)")


@pytest.mark.slow
def test_every_reader_of_a_run_answers_mutations_with_one_line_or_a_value(finished_run, fresh_trainer, tmp_path):
    """meta.json (resealed and not), extra/rank_0.json and pinned.json, fed seeded mutations: each reader
    returns or raises its own one-line error, never another exception."""
    source = checkpoint(finished_run, 6)
    path = tmp_path / "checkpoints" / source.name
    shutil.copytree(source, path)
    meta = json.loads((source / "meta.json").read_text())
    outcomes = {"value": 0, "refused": 0}

    def answer(read):
        try:
            read()
            outcomes["value"] += 1
        except CheckpointError as error:
            assert "\n" not in str(error)
            outcomes["refused"] += 1

    for seal in (True, False):
        for what, mutated in mutated_documents(meta, seed=3 + seal, count=60):
            (path / "meta.json").write_text(json.dumps(seal_meta(mutated) if seal and isinstance(mutated, dict)
                                                       else mutated))
            answer(lambda: read_meta(path))
    extra = json.loads((source / "extra" / "rank_0.json").read_text())
    for what, mutated in mutated_documents(extra, seed=5, count=80):
        answer(lambda: restore_extra(path, mutated, 6, 0, fresh_trainer.sampler))
    pinned_dir = tmp_path / "checkpoints"
    for what, mutated in mutated_documents(["step_00000003", "step_00000006"], seed=6, count=30):
        (pinned_dir / "pinned.json").write_text(json.dumps(mutated))
        answer(lambda: pinned_names(pinned_dir))
    assert outcomes["refused"] > 100 and outcomes["value"] > 10, outcomes


# -- cause 7: what the docs promise ---------------------------------------------------------------

def test_a_finished_run_whose_checkpoints_were_deleted_is_refused_not_retrained(run, tiny_dataset):
    """Without finished.json, resume=auto found no checkpoint and trained the run again from step 0,
    dropping its metrics rows."""
    assert json.loads((run / FINISHED_FILE).read_text()) == {"step": STEPS}
    shutil.rmtree(run / "checkpoints")
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as refused:
        trainer(run, tiny_dataset)
    assert one_line(refused) == (f"run.dir={run} finished at step {STEPS} (finished.json) and holds no checkpoint: "
                                 "training it again would start at step 0 and replace its metrics; pick another run.dir")
    assert (run / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("document, problem", [
    ("[6]", "holds a JSON list; expected {\"step\": N}"),
    ("{\"step\": ", "could not be read (Expecting value: line 1 column 10 (char 9))"),
    ('{"step": "6"}', "has step '6'; expected a positive integer"),
    ('{"step": 0}', "has step 0; expected a positive integer"),
    ('{"step": true}', "has step True; expected a positive integer"),
])
def test_a_malformed_finished_json_is_refused_in_one_line(tmp_path, document, problem):
    (tmp_path / FINISHED_FILE).write_text(document)
    with pytest.raises(CheckpointError) as refused:
        finished_step(tmp_path)
    assert one_line(refused).startswith(f"{tmp_path / FINISHED_FILE} {problem}")


def test_a_checkpoint_without_its_meta_json_is_named_and_passed_over(run, tiny_dataset, capsys):
    (checkpoint(run, 6) / "meta.json").unlink()
    resumed = trainer(run, tiny_dataset)
    resumed.close()
    assert resumed.step == 5
    assert (f"run.dir={run}: step_00000006 has no meta.json (deleted after it was written?) and is not resumed "
            "from") in capsys.readouterr().err.splitlines()


def test_a_partial_save_is_removed_at_start(run, tiny_dataset, capsys):
    partial = run / "checkpoints" / ".tmp-step_00000009"
    shutil.copytree(checkpoint(run, 6), partial)
    (partial / "meta.json").unlink()
    resumed = trainer(run, tiny_dataset)
    resumed.close()
    assert not partial.exists() and resumed.step == 6
    assert (f"run.dir={run}: removed .tmp-step_00000009, a checkpoint save that did not finish"
            in capsys.readouterr().err.splitlines())
