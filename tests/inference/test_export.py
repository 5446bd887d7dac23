"""`python -m inference.export`: a checkpoint's weights as model.safetensors + config.json (+ tokenizer.json),
written all at once; bad requests get one clear line and leave what is on disk untouched."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import cli_error, fast_train_overrides
from model import build_model
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import latest_checkpoint, load_checkpoint, read_meta
from trainer.config import load_config
from inference.export import ExportArgs, export, main, safetensors_ready
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("export") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    return run


def run_cli(*args):
    """inference.export in its own process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "inference.export", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_export_writes_the_checkpoint_weights_config_and_tokenizer(run_dir, tiny_dataset, tmp_path):
    out = tmp_path / "export"
    result = run_cli(f"checkpoint={run_dir}", f"out={out}")
    assert result.returncode == 0, result.stderr

    checkpoint = latest_checkpoint(run_dir)
    model = build_model(load_config(fast_train_overrides(run_dir, tiny_dataset, steps=2)))
    load_checkpoint(checkpoint, model, [], None, rank=0)
    parameters = sum(p.numel() for p in model.parameters())
    size = (out / "model.safetensors").stat().st_size
    assert result.stdout.strip() == (f"exported step 2 of {checkpoint} to {out} (format=native): {parameters:,} parameters, "
                                     f"{size:,} bytes in model.safetensors")

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    exported = load_file(out / "model.safetensors")
    expected = model.state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    described = json.loads((out / "config.json").read_text())
    meta = read_meta(checkpoint)
    assert described == {"config": meta["config"], "step": 2, "source": str(checkpoint.resolve()),
                         "model_fingerprint": meta["model_fingerprint"]}
    assert described["config"]["train"]["seq_len"] == 32
    assert (out / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary directory left behind


def test_an_existing_export_is_replaced_only_with_overwrite(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    out.mkdir()  # an empty directory is fine to write into
    export(str(run_dir), str(out))
    before = snapshot(out)

    assert cli_error(capsys, main, [f"checkpoint={run_dir}", f"out={out}"]) == (
        f"error: out={out} already holds an export; pass overwrite=true to replace it")
    assert snapshot(out) == before

    main([f"checkpoint={run_dir}", f"out={out}", "overwrite=true"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_directory_that_is_not_an_export_is_never_replaced(run_dir, tmp_path, capsys):
    """overwrite=true replaces an export, never other files (out=the run directory by mistake)."""
    before = snapshot(run_dir)
    assert cli_error(capsys, main, [f"checkpoint={run_dir}", f"out={run_dir}", "overwrite=true"]) == (
        f"error: out={run_dir} is a non-empty directory that is not an export; pick another out")
    assert snapshot(run_dir) == before


def test_overwrite_refuses_files_an_export_does_not_hold_and_replaces_links_not_their_targets(run_dir, tmp_path,
                                                                                              capsys):
    """overwrite=true used to delete everything in out; now anything but an export's own files is refused
    and kept, and an export file that is a symlink is replaced as a link (its target is left alone)."""
    out = tmp_path / "export"
    export(str(run_dir), str(out))
    (out / "NOTES.md").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "data.txt").write_text("also mine")
    before = snapshot(out)
    assert cli_error(capsys, main, [f"checkpoint={run_dir}", f"out={out}", "overwrite=true"]) == (
        f"error: out={out} holds NOTES.md, sub/ besides an export; an export replaces only model.safetensors, "
        "config.json, tokenizer.json: move the rest away or pick another out")
    assert snapshot(out) == before

    shutil.rmtree(out / "sub")
    (out / "NOTES.md").unlink()
    secret = tmp_path / "secret"
    secret.write_text("do not overwrite")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(secret)
    main([f"checkpoint={run_dir}", f"out={out}", "overwrite=true"])
    assert secret.read_text() == "do not overwrite"
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text())["step"] == 2


def test_a_symlinked_tokenizer_is_refused_not_copied(run_dir, tmp_path, capsys):
    """A run's tokenizer.json pointing at a secret must not put the secret into an export meant to be shared."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    secret = tmp_path / "id_key"
    secret.write_text("PRIVATE KEY")
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "export"
    assert cli_error(capsys, main, [f"checkpoint={run}", f"out={out}"]) == (
        f"error: {run / 'tokenizer.json'} is a symlink (to {secret}); export copies only regular files: replace "
        "the link with a copy of the tokenizer")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["id_key", "run"]


def test_an_unwritable_out_fails_in_one_line(run_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = cli_error(capsys, main, [f"checkpoint={run_dir}", f"out={blocker / 'export'}"])
    assert err.startswith(f"error: out={blocker / 'export'} cannot be written (")
    assert cli_error(capsys, main, [f"checkpoint={run_dir}", f"out={blocker}"]) == (
        f"error: out={blocker} is a file; give a directory to create")
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_a_missing_or_incomplete_checkpoint_fails_in_one_line(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli_error(capsys, main, [f"checkpoint={tmp_path / 'nowhere'}", f"out={out}"]) == (
        f"error: {tmp_path / 'nowhere'} does not exist")
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    assert cli_error(capsys, main, [f"checkpoint={tmp_path / 'empty_run'}", f"out={out}"]) == (
        f"error: run directory {tmp_path / 'empty_run'} has no complete checkpoint in "
        f"{tmp_path / 'empty_run' / 'checkpoints'}")
    broken = tmp_path / "broken"
    shutil.copytree(latest_checkpoint(run_dir), broken)
    (broken / ".metadata").unlink()
    err = cli_error(capsys, main, [f"checkpoint={broken}", f"out={out}"])
    assert err.startswith(f"error: checkpoint {broken} is incomplete: missing ") and ".metadata" in err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    ([], "checkpoint= and out= are required, e.g. checkpoint=runs/train out=runs/train/export"),
    (["checkpoint=runs/x"], "checkpoint= and out= are required, e.g. checkpoint=runs/train out=runs/train/export"),
    (["checkpoint=runs/x", "out=y", "dtype=bf16"],
     "unknown key 'dtype'; valid keys: checkpoint, out, overwrite, format, max_shard_size"),
    (["runs/x"], "argument 'runs/x' is not key=value; valid keys: checkpoint, out, overwrite, format, max_shard_size "
                 "(--help prints the usage)"),
    (["checkpoint=runs/x", "out=y", "format=onnx"], "format='onnx' is not one of native | hf | kimi"),
    (["checkpoint=runs/x", "out=y", "format=hf", "max_shard_size=big"],
     "max_shard_size='big' is not a size: give bytes (1000000) or a number with KB, MB or GB (5GB)"),
    (["checkpoint=runs/x", "out=y", "overwrite=maybe"], "overwrite: Value 'maybe' is not a valid bool (type str)"),
])
def test_bad_arguments_fail_in_one_line(capsys, argv, message):
    assert cli_error(capsys, main, argv) == f"error: {message}"


def test_help_prints_every_option_and_exits_0(capsys):
    main(["--help"])
    usage = capsys.readouterr().out
    for name in ExportArgs.__dataclass_fields__:
        assert f"  {name}=" in usage
    assert "  overwrite=false" in usage


def test_tied_weights_are_saved_under_every_name(tmp_path):
    """safetensors refuses tensors that share storage; each name gets its own copy and loads strictly."""
    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11, bias=False))
        model[1].weight = model[0].weight
        return model

    torch.manual_seed(0)
    source = tied()
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(source.state_dict(), tmp_path / "plain.safetensors")
    save_file(safetensors_ready(source.state_dict()), tmp_path / "model.safetensors")
    target = tied()
    target.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    assert torch.equal(target[0].weight, source[0].weight) and target[1].weight is target[0].weight
