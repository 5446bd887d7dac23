"""Blends and samples through megatron-core: data.blend's weights hold per source, one tokenizer for every
source, the split, the pass-based order, the sampler's state, Megatron's own prefixes, the index cache, and
one-line errors. No network."""
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from conftest import fast_train_overrides, train_in_process
from trainer.config import load_config
from trainer.data import (
    BlendSamples,
    DataError,
    SampleSampler,
    check_split,
    open_samples,
    parse_blend,
    resolve_blend,
    resolve_dataset,
)
from trainer.data.index_cache import IndexCacheError
from trainer.data.mcore import megatron_datasets
from trainer.data.samples import INDEX_DIR

SEQ_LEN = 16
# Three sources with their own words, so a sample's source shows in its tokens.
SOURCE_WORDS = {
    "plays": "king queen crown sword throne castle".split(),
    "sea": "ship wave sail harbour anchor storm".split(),
    "farm": "wheat barn plough cattle field harvest".split(),
}
WEIGHTS = {"plays": 0.5, "sea": 0.3, "farm": 0.2}


def write_source(directory: Path, words: list[str], documents: int, seed: int) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    for i in range(documents):
        lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) + "." for _ in range(30))
        (directory / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    paths = {name: write_source(root / name, words, 30, seed) for seed, (name, words) in enumerate(SOURCE_WORDS.items())}
    return root, paths


def blend_list(paths):
    return [item for name in SOURCE_WORDS for item in (WEIGHTS[name], str(paths[name]))]


def source_of(text: str) -> str:
    """The source whose words make up most of a sample's text."""
    words = text.replace(".", " ").split()
    return max(SOURCE_WORDS, key=lambda name: sum(word in SOURCE_WORDS[name] for word in words))


def test_a_blend_of_three_keeps_each_share_within_a_sample_of_its_weight(three_sources):
    root, paths = three_sources
    blend = resolve_blend(blend_list(paths), None, root / "cache", 512, None)
    first, *others = blend.sources
    # One tokenizer for all: the first text source trains the BPE, the others are tokenised with its file.
    assert first.manifest["tokenizer"]["kind"] == "bpe"
    assert all(s.manifest["tokenizer"] == {"kind": "file", "sha256": first.manifest["sha256"]["tokenizer.json"],
                                           "path": str(blend.tokenizer_file)} for s in others)
    tokenizer = Tokenizer.from_file(str(blend.tokenizer_file))
    samples = BlendSamples(blend, "90,10,0", SEQ_LEN, 0, root / "cache")
    total = samples.pass_samples
    inputs, _ = samples.train_batch(list(range(total)))
    sources = [source_of(text) for text in tokenizer.decode_batch(inputs.tolist())]
    drawn = Counter(sources)
    # megatron-core assigns each sample to the source furthest behind its weight, so every prefix of the
    # order is within about one sample per source of its weights; allow two.
    for name, weight in WEIGHTS.items():
        assert abs(drawn[name] - weight * total) <= 2, (drawn, total)
    prefix = Counter(sources[:100])
    assert all(abs(prefix[name] - weight * 100) <= 2 for name, weight in WEIGHTS.items()), prefix


@pytest.mark.slow
def test_a_blend_trains_and_resumes_bitwise(three_sources, tmp_path):
    root, paths = three_sources
    blend = "[" + ",".join(str(item) for item in blend_list(paths)) + "]"
    common = {"data.path": "null", "data.blend": blend, "data.cache_dir": str(root / "cache"),
              "data.split": "'90,10,0'"}

    def run(name, **extra):
        overrides = fast_train_overrides(tmp_path / name, "unused", steps=6, **extra)
        return train_in_process([o for o in overrides if not o.startswith("data.path=")] + [f"{k}={v}" for k, v in common.items()])

    run("whole")
    run("resumed", **{"train.stop_after": 3})
    run("resumed")
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
               if "loss" in r} for name in ("whole", "resumed")]
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 3, 4, 5, 6]


def test_passes_are_reshuffled_and_every_window_comes_from_the_training_split(tiny_dataset, tmp_path):
    blend = resolve_blend(None, str(tiny_dataset), tmp_path, 512, None)
    samples = BlendSamples(blend, "98,2,0", SEQ_LEN, 3, tmp_path)
    assert samples.split_tokens[0][0] + samples.split_tokens[0][1] == blend.sources[0].manifest["tokens"]
    count = samples.pass_samples
    first, _ = samples.train_batch(list(range(count)))
    second, _ = samples.train_batch(list(range(count, 2 * count)))
    assert not torch.equal(first, second)
    # Each pass reads the training split's tokens once over (a window's extra last token aside).
    stream = np.fromfile(tiny_dataset / "tokens.bin", dtype=np.uint16)[: samples.split_tokens[0][0]]
    available = Counter(stream.tolist())
    for drawn in (first, second):
        tokens = Counter(drawn.flatten().tolist())
        assert all(tokens[t] <= available[t] for t in tokens) and sum(tokens.values()) == count * SEQ_LEN


def test_validation_is_the_same_samples_for_every_seed_and_every_call(tiny_dataset, tmp_path):
    blend = resolve_blend(None, str(tiny_dataset), tmp_path, 512, None)
    seeds = [BlendSamples(blend, "98,2,0", SEQ_LEN, seed, tmp_path) for seed in (0, 5)]
    batches = [list(samples.val_batches(3, 2)) for samples in (*seeds, seeds[0])]
    assert len(batches[0]) == 2 and all(x.shape == (3, SEQ_LEN) for x, _ in batches[0])
    for other in batches[1:]:
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches[0], other))
    everything = list(seeds[0].val_batches(4))
    assert sum(len(x) for x, _ in everything) == seeds[0].val_samples > 0
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in everything)


def test_the_index_cache_is_built_once_and_read_after(tiny_dataset, tmp_path):
    blend = resolve_blend(None, str(tiny_dataset), tmp_path, 512, None)
    first = BlendSamples(blend, "98,2,0", SEQ_LEN, 0, tmp_path)
    first.build_for_run(steps=2, global_batch=4)
    cache = sorted((tmp_path / INDEX_DIR).iterdir())
    assert any(p.name.endswith("shuffle_index.npy") for p in cache)
    written = {p: p.stat().st_mtime_ns for p in cache}
    again = BlendSamples(blend, "98,2,0", SEQ_LEN, 0, tmp_path)
    again.build_for_run(steps=2, global_batch=4)
    assert {p: p.stat().st_mtime_ns for p in sorted((tmp_path / INDEX_DIR).iterdir())} == written
    assert torch.equal(first.train_batch([0, 5, 9])[0], again.train_batch([0, 5, 9])[0])


def test_an_object_array_in_the_index_cache_is_never_loaded(tiny_dataset, tmp_path):
    """An .npy array of Python objects is refused naming its file, never unpickled (tests/trainer/
    test_index_cache.py plants bare pickles)."""
    blend = resolve_blend(None, str(tiny_dataset), tmp_path, 512, None)
    BlendSamples(blend, "98,2,0", SEQ_LEN, 0, tmp_path).build_for_run(steps=1, global_batch=4)
    marker = tmp_path / "unpickled"
    for index in (tmp_path / INDEX_DIR).glob("*shuffle_index.npy"):
        np.save(index, np.array([Planted(str(marker))], dtype=object), allow_pickle=True)
    with pytest.raises(IndexCacheError, match=f"^{tmp_path / INDEX_DIR}/.*shuffle_index.npy: not a readable .npy"):
        BlendSamples(blend, "98,2,0", SEQ_LEN, 0, tmp_path).build_for_run(steps=1, global_batch=4)
    assert not marker.exists()


class Planted:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_prefix_written_by_megatron_core_is_read_as_it_is(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 500, size=n) for n in (70, 10, 300, 120, 500) * 10]
    builder = megatron_datasets().IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.from_numpy(document))
        builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))
    blend = resolve_blend(None, str(tmp_path / "corpus.bin"), tmp_path / "cache", 512, None)
    assert blend.sources[0].prefix == tmp_path / "corpus" and blend.eot_id is None and blend.tokenizer_file is None
    samples = BlendSamples(blend, "98,2,0", SEQ_LEN, 0, tmp_path / "cache")
    inputs, targets = samples.train_batch(list(range(8)))
    stream = np.concatenate(documents)
    windows = {tuple(stream[i:i + SEQ_LEN]) for i in range(len(stream) - SEQ_LEN)}
    assert all(tuple(row) in windows for row in inputs.tolist() if set(row) <= set(stream.tolist()))
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # Its tokenizer is not recorded, so prepared text joins it in a blend only with data.tokenizer, in either
    # order (the text first used to be refused naming its own tokenizer as a data.tokenizer never set).
    text = write_source(tmp_path / "text", SOURCE_WORDS["farm"], 3, 0)
    for blend in ([1, str(tmp_path / "corpus"), 1, str(text)], [1, str(text), 1, str(tmp_path / "corpus")]):
        with pytest.raises(DataError) as error:
            resolve_blend(blend, None, tmp_path / "cache", 512, None)
        assert str(error.value) == (f"data.blend mixes the Megatron prefix {tmp_path / 'corpus'}, whose tokenizer is "
                                    "not recorded, with data prepared here; set data.tokenizer to the tokenizer.json "
                                    "it was made with")
    tokenizer = resolve_dataset(str(text), tmp_path / "cache", 512) / "tokenizer.json"
    mixed = resolve_blend([1, str(text), 1, str(tmp_path / "corpus")], None, tmp_path / "cache", 512, str(tokenizer))
    assert [source.prefix for source in mixed.sources][1] == tmp_path / "corpus"
    assert mixed.tokenizer_file == tokenizer


def test_data_ranks_take_disjoint_contiguous_slices_and_resume_exactly():
    per_rank = []
    for rank in range(4):
        sampler = SampleSampler(pass_samples=50, seq_len=8, seed=1)
        per_rank.append([sampler.next_batch(8, rank, 4) for _ in range(10)])
    assert [per_rank[r][0] for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(n for rank in per_rank for batch in rank for n in batch) == list(range(80))
    whole = SampleSampler(50, 8, 1)
    expected = [whole.next_batch(8, 1, 4) for _ in range(10)]
    first = SampleSampler(50, 8, 1)
    seen = [first.next_batch(8, 1, 4) for _ in range(4)]
    resumed = SampleSampler(50, 8, 1)
    resumed.load_state_dict(first.state_dict())
    assert seen + [resumed.next_batch(8, 1, 4) for _ in range(6)] == expected and resumed.epoch == 1
    with pytest.raises(ValueError, match="does not match this run's data"):
        SampleSampler(51, 8, 1).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="divisible"):
        first.next_batch(6, 0, 4)


@pytest.mark.parametrize("blend, path, message", [
    ([0.3, "a", 0.7], None, "data.blend has 3 items, an odd number; it must be a list [WEIGHT, PATH, WEIGHT, PATH, ...]"),
    ([-1, "a"], None, "data.blend: weight -1 (for a) must be a positive number"),
    ([1, ""], None, "data.blend: path '' (weight 1) must be a non-empty string"),
    ([{"weight": 1, "file": "a"}], None, "data.blend=[{'file': 'a', 'weight': 1}]: every entry needs exactly weight and path"),
    ([1, "a"], "b", "data.path=b and data.blend are both set; give one (a path is a blend of one)"),
])
def test_a_bad_blend_is_one_line_naming_it(blend, path, message):
    with pytest.raises(DataError) as error:
        parse_blend(blend, path)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_extreme_weights_and_a_split_of_infinite_shares_are_one_line():
    with pytest.raises(DataError) as error:
        parse_blend([1e-300, "a", 1e300, "b"], None)
    assert str(error.value) == "data.blend: weight 1e-300 (for a) is 0 of the total 1e+300 once normalised; give " \
                               "weights nearer each other"
    with pytest.raises(DataError, match=r"^data.blend: the weights sum to inf; data.blend must be .* of finite sum$"):
        parse_blend([1e308, "a", 1e308, "b"], None)
    nines = "9" * 400
    with pytest.raises(DataError, match=f"^data.split={nines},1,0 must be three numbers"):
        check_split(f"{nines},1,0")


def test_the_same_data_named_twice_in_a_blend_is_refused(tiny_dataset, tmp_path):
    """Named twice, megatron-core drew it as two sources with their own shuffles: the first 20 samples held
    10 distinct ones. Spelled the same, with a trailing /, through a link, or as a copy of the same data."""
    link = tmp_path / "link"
    link.symlink_to(tiny_dataset)
    copy = shutil.copytree(tiny_dataset, tmp_path / "copy")
    for second in (str(tiny_dataset), f"{tiny_dataset}/", str(link), str(copy)):
        with pytest.raises(DataError) as error:
            resolve_blend([0.5, str(tiny_dataset), 1.5, second], None, tmp_path / "cache", 512, None)
        assert str(error.value) == (f"data.blend names the same data twice, as {tiny_dataset} and {second} "
                                    f"({Path(second) / 'tokens'}); give it once, with its weights summed (2)")


def test_blend_entries_as_weight_path_mappings_and_the_split_rules():
    assert parse_blend([{"weight": 2, "path": "a"}, {"weight": 1, "path": "b"}], None) == parse_blend([2, "a", 1, "b"], None)
    assert check_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0]) and check_split("9, 1") == pytest.approx([0.9, 0.1, 0])
    for bad in ("98", "1,0,0", "a,b", "0,0,0"):
        with pytest.raises(DataError, match=f"data.split={bad} must"):
            check_split(bad)


def test_a_source_too_small_for_its_valid_split_is_named(tmp_path):
    texts = write_source(tmp_path / "five", SOURCE_WORDS["sea"], 5, 0)
    cfg = load_config(["model=xs", f"data.path={texts}", f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=16"])
    with pytest.raises(DataError) as error:
        open_samples(cfg.data, 512, 16, 0)
    assert str(error.value) == (f"data.split=98,2,0 leaves {texts} 0 valid tokens, fewer than one sample of "
                                "train.seq_len + 1 = 17; give it more documents, a larger valid share or a shorter "
                                "train.seq_len")
