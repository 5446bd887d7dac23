"""inference.export and links (issue 55, items 1 and 2): a checkpoint given through a link exports the
tokenizer of the run it lies in, a tokenizer other than the one its meta.json records is refused in one line,
and a link planted in place of the export's temporary directory receives nothing."""
import hashlib
import json
import os
import shutil

import pytest

from conftest import fast_train_overrides
from inference.export import ExportError, _make_tmp, _write, export
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.run_dir.checkpoint import latest_checkpoint, read_meta
from trainer.files.safe_io import held_path
from trainer.trainer import Trainer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("export_links") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    return run


def other_tokenizer(run_dir) -> bytes:
    """A valid tokenizer.json that is not the run's: one token spelled differently."""
    document = json.loads((run_dir / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    token = next(name for name in vocab if name.isalpha() and len(name) > 2)
    vocab[token.upper() + "X"] = vocab.pop(token)
    return json.dumps(document).encode()


def test_the_checkpoint_records_the_sha256_of_the_runs_tokenizer(run_dir):
    meta = read_meta(latest_checkpoint(run_dir))
    assert meta["tokenizer_sha256"] == hashlib.sha256((run_dir / "tokenizer.json").read_bytes()).hexdigest()


def test_a_linked_step_dir_exports_the_tokenizer_of_the_run_it_lies_in(tmp_path, run_dir):
    """Before: the tokenizer.json beside the link (in the link's own run directory) was copied."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoints").mkdir(parents=True)
    (elsewhere / "tokenizer.json").write_bytes(other_tokenizer(run_dir))
    link = elsewhere / "checkpoints" / "step_00000002"
    link.symlink_to(latest_checkpoint(run_dir))
    out = tmp_path / "export"
    summary = export(str(link), str(out))
    assert (out / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert summary.startswith(f"exported step 2 of {latest_checkpoint(run_dir)} to {out} (format=native)")


def test_a_tokenizer_other_than_the_one_the_checkpoint_records_is_refused(tmp_path, run_dir):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "tokenizer.json").write_bytes(other_tokenizer(run_dir))
    recorded = hashlib.sha256((run_dir / "tokenizer.json").read_bytes()).hexdigest()
    found = hashlib.sha256(other_tokenizer(run_dir)).hexdigest()
    out = tmp_path / "export"
    with pytest.raises(ExportError) as refused:
        export(str(copy), str(out), format="hf")
    assert str(refused.value) == (f"{copy / 'tokenizer.json'} is not the tokenizer this checkpoint was trained with "
                                  f"(its sha256 is {found}, meta.json records {recorded}); put the run's own "
                                  "tokenizer.json back, or export from the run directory it was trained in")
    assert not out.exists()


def test_a_link_planted_at_the_temporary_export_dir_receives_nothing(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("precious\n")
    out = tmp_path / "export"
    tmp, handle = _make_tmp(out)
    try:
        tmp.rename(tmp_path / "moved")
        tmp.symlink_to(victim)

        def write_files(into):
            (into / "config.json").write_text("{}\n")
            return "one file"

        with pytest.raises(ExportError) as refused:
            _write(tmp, held_path(handle), out, write_files)
    finally:
        os.close(handle)
    assert str(refused.value) == (f"out={out} was not written: {tmp} was replaced or moved while it was being "
                                  "written; nothing was published from it: find out what changed the directory, "
                                  "then run again")
    assert sorted(p.name for p in victim.iterdir()) == ["config.json"]
    assert (victim / "config.json").read_text() == "precious\n"
    assert (tmp_path / "moved" / "config.json").read_text() == "{}\n"  # the export went where it was made
    assert not out.exists()
