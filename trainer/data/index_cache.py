"""The trust boundary of megatron-core's index cache (data.cache_dir/indices), which a shared cache lets anyone
with write access to it fill.

megatron-core opens its cache files with numpy.load(path, allow_pickle=True, mmap_mode="r"); for a file
without the .npy magic numpy falls back to pickle.load, which runs whatever the file says. mcore.py therefore
gives megatron-core's dataset modules a numpy whose load is `load_index_array`: allow_pickle=False at the
moment of opening (a check of the files before the builder opens them would leave a window in which one
can be swapped), the dtype and shape of the file's role, and any failure as one line naming the file. The
values are checked against what the arrays index once the dataset holding them is built (`check_gpt_indices`,
`check_blend_indices`), before any sample is read: a shuffle index out of range or a zeroed document index
would otherwise read other data or fail mid-run naming no file.

megatron-core writes its files with a plain open(), which follows a link: `refuse_index_links` refuses any
link (or anything but a regular file) in the cache before the builder runs.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from trainer.data.format import DataError, one_line

# Each role's dimensions and integer dtypes, as megatron-core writes them (gpt_dataset.py, blended_dataset.py).
ROLES = {
    "dataset_sample_index.npy": (1, ("int64",)),
    "dataset_index.npy": (1, ("int16",)),
    "document_index.npy": (1, ("int32",)),
    "sample_index.npy": (2, ("int32", "int64")),
    "shuffle_index.npy": (1, ("uint32", "int64")),
}


class IndexCacheError(DataError):
    """A file of the index cache that cannot be used; the message names it."""


def cache_error(path: str | Path, reason: str) -> IndexCacheError:
    return IndexCacheError(f"{path}: {reason}; delete it and it is rebuilt from the data")


def refuse_index_links(index_dir: Path) -> None:
    """Before megatron-core writes or reads the cache: the directory and every entry must be a real directory and
    regular files, so no write lands at a link's target (dangling or not) and no read goes elsewhere."""
    if index_dir.is_symlink():
        raise cache_error(index_dir, f"a link (to {os.readlink(index_dir)}), which the index cache never follows")
    if not index_dir.exists():
        return
    if not index_dir.is_dir():
        raise cache_error(index_dir, "not a directory")
    # By name: a shared cache holds thousands of entries, and sorting Paths takes 8-9x as long (10 ms for 3,200).
    for entry in sorted(index_dir.iterdir(), key=lambda path: path.name):
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise cache_error(entry, f"a link (to {os.readlink(entry)}), which the index cache never follows")
        if not stat.S_ISREG(mode):
            raise cache_error(entry, "not a regular file")


def role_of(path: Path) -> str:
    for suffix in ROLES:
        if path.name.endswith(f"-{suffix}"):
            return suffix
    raise cache_error(path, f"not one of megatron-core's index files (*-{', *-'.join(ROLES)})")


def load_index_array(path: str | Path, mmap_mode: str | None = None) -> np.ndarray:
    """An index-cache array, never unpickled: a regular .npy file (not a link) of its role's dtype and dimensions."""
    path = Path(path)
    ndim, dtypes = ROLES[role_of(path)]
    if path.is_symlink():
        raise cache_error(path, f"a link (to {os.readlink(path)}), which the index cache never follows")
    try:
        array = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except Exception as error:  # whatever the bytes make numpy raise: no magic, pickled objects, a bad header, cut short
        # numpy's own message about pickles suggests loading the file unsafely; it is never loaded.
        reason = "it holds pickled objects" if "pickle" in str(error) else one_line(error)
        raise cache_error(path, f"not a readable .npy array ({reason}), never unpickled") from None
    if array.dtype.name not in dtypes or array.ndim != ndim or (ndim == 2 and array.shape[1] != 2):
        raise cache_error(path, f"a {array.dtype} array of shape {array.shape}, not the {ndim}-D "
                                f"{' or '.join(dtypes)} array{' of pairs' if ndim == 2 else ''} of its role")
    return array


def cache_path(dataset, suffix: str) -> Path:
    """Where megatron-core keeps one array of a built dataset (GPTDataset or BlendedDataset)."""
    split = dataset.index_split.name if hasattr(dataset, "index_split") else dataset.split.name
    return Path(dataset.config.path_to_cache) / f"{dataset.unique_description_hash}-{type(dataset).__name__}-{split}-{suffix}"


def outside(values: np.ndarray, low: int, high: int) -> int | None:
    """The position of the first value outside [low, high), or None."""
    bad = (values < low) | (values >= high)
    return int(np.argmax(bad)) if bad.any() else None


def check_gpt_indices(dataset, document_index: np.ndarray, sample_index: np.ndarray,
                      shuffle_index: np.ndarray) -> None:
    """A GPTDataset's three arrays against its split's documents and sequence length: every document of the
    split the same number of times (once an epoch), samples exactly sequence_length tokens apart inside the
    epochs' tokens, and the shuffle a permutation of the samples. One pass over each array."""
    documents = np.asarray(dataset.indices)
    first_document = int(documents[0]) if len(documents) else 0
    path = cache_path(dataset, "document_index.npy")
    at = outside(document_index, first_document, first_document + len(documents))
    if at is not None:
        raise cache_error(path, f"entry {at} is document {int(document_index[at])}, outside this split's "
                                f"[{first_document}, {first_document + len(documents)})")
    counts = np.bincount(np.asarray(document_index, dtype=np.int64) - first_document, minlength=len(documents))
    if len(document_index) == 0 or counts.min() != counts.max():
        raise cache_error(path, "its documents do not each appear once an epoch")

    path = cache_path(dataset, "sample_index.npy")
    lengths = np.asarray(dataset.dataset.sequence_lengths, dtype=np.int64)[np.asarray(document_index)]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    positions, offsets = np.asarray(sample_index[:, 0], dtype=np.int64), np.asarray(sample_index[:, 1], dtype=np.int64)
    at = outside(positions, 0, len(document_index))
    if len(sample_index) < 2 or at is not None:
        raise cache_error(path, f"{len(sample_index)} entries, or a document position outside [0, "
                                f"{len(document_index)}) of the document index")
    tokens = starts[positions] + offsets
    beyond = (offsets < 0) | (offsets > lengths[positions])  # an offset stays inside its own document
    if beyond.any() or (np.diff(tokens) != dataset.config.sequence_length).any() or tokens[-1] >= starts[-1]:
        raise cache_error(path, f"its samples are not {dataset.config.sequence_length} tokens apart inside the "
                                f"{int(starts[-1])} tokens of the document index")

    path = cache_path(dataset, "shuffle_index.npy")
    samples = len(sample_index) - 1
    at = outside(shuffle_index, 0, samples)
    if at is not None:
        raise cache_error(path, f"entry {at} is sample {int(shuffle_index[at])}, outside [0, {samples})")
    if len(shuffle_index) != samples or (np.bincount(shuffle_index, minlength=samples) != 1).any():
        raise cache_error(path, f"not a permutation of the {samples} samples of the sample index")
    if dataset.num_samples is not None and samples < dataset.num_samples:
        raise cache_error(path, f"{samples} samples, fewer than the {dataset.num_samples} asked for")


def check_blend_indices(dataset, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
    """A BlendedDataset's two arrays against its sources: one entry per sample of the blend, each naming a
    source and one of that source's samples."""
    sizes = np.array([len(source) for source in dataset.datasets], dtype=np.int64)
    path = cache_path(dataset, "dataset_index.npy")
    expected = dataset.size if dataset.size is not None else int(sizes.sum())
    if len(dataset_index) != expected:
        raise cache_error(path, f"{len(dataset_index)} entries, not the blend's {expected} samples")
    at = outside(dataset_index, 0, len(sizes))
    if at is not None:
        raise cache_error(path, f"entry {at} is source {int(dataset_index[at])}, outside the blend's [0, {len(sizes)})")
    path = cache_path(dataset, "dataset_sample_index.npy")
    if len(dataset_sample_index) != expected:
        raise cache_error(path, f"{len(dataset_sample_index)} entries, not the blend's {expected} samples")
    limits = sizes[np.asarray(dataset_index, dtype=np.int64)]
    bad = (dataset_sample_index < 0) | (dataset_sample_index >= limits)
    if bad.any():
        at = int(np.argmax(bad))
        raise cache_error(path, f"entry {at} is sample {int(dataset_sample_index[at])} of source "
                                f"{int(dataset_index[at])}, outside its [0, {int(limits[at])})")
