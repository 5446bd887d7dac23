"""megatron-core's index cache (data.cache_dir/indices) as untrusted input: nothing in it is unpickled, no link
in it is followed (for a read or a write), and a damaged array is one line naming its file or the same
usable samples, never a traceback or a read outside the data."""
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from json_mutations import mutated_arrays, mutated_bytes
from trainer.data import BlendSamples, resolve_blend
from trainer.data.index_cache import IndexCacheError
from trainer.data.mcore import megatron_datasets
from trainer.data.samples import INDEX_DIR

SEQ_LEN, SPLIT, STEPS, GLOBAL_BATCH = 16, "90,10,0", 3, 4
ROLES = ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index")


def write_prefix(prefix: Path, seed: int) -> str:
    rng = np.random.default_rng(seed)
    builder = megatron_datasets().IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for length in rng.integers(5, 80, size=40):
        builder.add_item(torch.from_numpy(rng.integers(1, 500, size=length)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """A blend of two Megatron prefixes (so the cache holds BlendedDataset arrays too) and its filled cache."""
    root = tmp_path_factory.mktemp("index_cache")
    blend = resolve_blend([0.6, write_prefix(root / "a", 0), 0.4, write_prefix(root / "b", 1)], None,
                          root / "cache", 512, None)
    samples = open_blend(blend, root / "cache")
    return blend, root / "cache", read_all(samples)


def open_blend(blend, cache: Path) -> BlendSamples:
    samples = BlendSamples(blend, SPLIT, SEQ_LEN, 0, cache)
    samples.build_for_run(STEPS, GLOBAL_BATCH)
    return samples


def read_all(samples: BlendSamples) -> tuple[torch.Tensor, torch.Tensor]:
    """Every training sample of the run's passes and every validation sample."""
    train, _ = samples.train_batch(list(range(STEPS * GLOBAL_BATCH)))
    valid = torch.cat([inputs for inputs, _ in samples.val_batches(8)])
    return train, valid


def cache_copy(cache: Path, tmp_path: Path) -> Path:
    return shutil.copytree(cache, tmp_path / "cache")


def files_of(cache: Path, split: str, role: str) -> list[Path]:
    return sorted(p for p in (cache / INDEX_DIR).glob(f"*-{split}-{role}.npy") if np.load(p).size)


class Planted:
    """Unpickling it creates `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("split", ["train", "valid"])
@pytest.mark.parametrize("role", ROLES)
def test_a_bare_pickle_at_any_index_name_is_refused_and_never_run(two_sources, tmp_path, split, role):
    blend, cache, _ = two_sources
    cache = cache_copy(cache, tmp_path)
    marker = tmp_path / "unpickled"
    planted = files_of(cache, split, role)[0]
    planted.write_bytes(pickle.dumps(Planted(str(marker))))
    with pytest.raises(IndexCacheError) as error:
        open_blend(blend, cache)
    message = str(error.value)
    assert message.startswith(f"{planted}: not a readable .npy array (") and "\n" not in message
    assert message.endswith("; delete it and it is rebuilt from the data")
    assert not marker.exists()


def test_a_dangling_link_in_the_index_cache_is_refused_before_anything_is_written(two_sources, tmp_path):
    blend, filled, _ = two_sources
    cache = tmp_path / "cache"
    (cache / INDEX_DIR).mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    # Links at every name the build writes, each to a file that does not exist yet.
    for entry in (filled / INDEX_DIR).iterdir():
        (cache / INDEX_DIR / entry.name).symlink_to(outside / entry.name)
    with pytest.raises(IndexCacheError) as error:
        open_blend(blend, cache)
    first = sorted((cache / INDEX_DIR).iterdir())[0]
    assert str(error.value) == (f"{first}: a link (to {outside / first.name}), which the index cache never follows; "
                                "delete it and it is rebuilt from the data")
    assert list(outside.iterdir()) == []


def test_a_link_to_a_good_index_file_or_a_linked_index_directory_is_refused(two_sources, tmp_path):
    blend, filled, _ = two_sources
    cache = cache_copy(filled, tmp_path)
    linked = files_of(cache, "train", "shuffle_index")[0]
    kept = tmp_path / "kept.npy"
    linked.rename(kept)
    linked.symlink_to(kept)
    with pytest.raises(IndexCacheError, match=f"^{linked}: a link"):
        open_blend(blend, cache)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(filled / INDEX_DIR, elsewhere)
    other = tmp_path / "other"
    other.mkdir()
    (other / INDEX_DIR).symlink_to(elsewhere)
    with pytest.raises(IndexCacheError, match=f"^{other / INDEX_DIR}: a link"):
        open_blend(blend, other)


@pytest.mark.parametrize("role", ROLES)
def test_randomly_damaged_index_arrays_are_one_line_or_usable_samples(two_sources, tmp_path, role):
    """Any edit of one cached array (out-of-range, negative or repeated entries, zeroed, cut, other dtypes or
    shapes, flipped bits, a cut file) is refused naming that file, or every sample still reads whole."""
    blend, filled, expected = two_sources
    cache = cache_copy(filled, tmp_path)
    target = files_of(cache, "train", role)[0]
    original = np.load(target)
    cases = [*((what, array) for what, array in mutated_arrays(original, seed=44, count=20)),
             *((what, data) for what, data in mutated_bytes(target.read_bytes(), seed=44, count=8))]
    outcomes = {"refused": 0, "read": 0}
    for what, damaged in cases:
        if isinstance(damaged, bytes):
            target.write_bytes(damaged)
        else:
            np.save(target, damaged)
        try:
            train, valid = read_all(open_blend(blend, cache))
            assert train.shape == expected[0].shape and valid.shape == expected[1].shape, what
            outcomes["read"] += 1
        except IndexCacheError as error:
            assert str(error).startswith(f"{cache / INDEX_DIR}/") and "\n" not in str(error), (what, str(error))
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 16, outcomes


def test_the_checks_accept_what_megatron_core_built_and_the_samples_read_again_are_the_same(two_sources, tmp_path):
    blend, filled, expected = two_sources
    again = read_all(open_blend(blend, filled))
    assert all(torch.equal(a, b) for a, b in zip(again, expected))
