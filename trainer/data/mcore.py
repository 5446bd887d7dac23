"""megatron-core's dataset classes, imported on first use and quietly, with their index cache checked.

The package's __init__ imports its model code as well (seconds), which warns that Transformer Engine and
Apex are missing; the data path uses neither, so those warnings are not shown.

megatron-core opens its index cache with numpy.load(allow_pickle=True), which unpickles a file without the
.npy magic. The two dataset modules we use are given, once, a numpy whose load is index_cache.load_index_array
(never a pickle, one line naming a bad file): a substitute for the module name they call rather than a
wrapper around the builder call, so it also covers loads made after the builder returns and cannot be left
unpatched by an exception or undone under another thread. GPTDataset and the builder's BlendedDataset are
subclasses, under the same names (the names are part of the cache's file names), that check their arrays'
values before anything reads a sample.
"""
from __future__ import annotations

import functools
import types
import warnings

import numpy

from trainer.data.index_cache import check_blend_indices, check_gpt_indices, load_index_array


class NumpyWithoutPickle(types.ModuleType):
    """numpy, as megatron-core's dataset modules see it: `load` never unpickles."""

    def __getattr__(self, name: str):
        return getattr(numpy, name)

    @staticmethod
    def load(file, mmap_mode=None, allow_pickle=False, **_):
        return load_index_array(file, mmap_mode)


def load_without_pickle(module: types.ModuleType) -> None:
    """Every name `module` holds numpy or numpy.load under (`import numpy`, `import numpy as np`, `from numpy
    import load`) rebound to the no-pickle load, so another megatron-core version's spelling is covered too."""
    rebound = 0
    for name, value in list(vars(module).items()):
        if value is numpy or value is numpy.load:
            setattr(module, name, NumpyWithoutPickle("numpy") if value is numpy else NumpyWithoutPickle.load)
            rebound += 1
    if not rebound:
        raise ImportError(f"{module.__name__} holds no numpy to give a load without pickle; this megatron-core "
                          "version reads its index cache some other way, update trainer/data/mcore.py")


def checked_subclass(base: type, method: str, check) -> type:
    """`base` under its own name, whose `method` (building or loading its index arrays) checks what it returns."""
    def build_and_check(self):
        indices = getattr(base, method)(self)
        check(self, *indices)
        return indices
    return type(base.__name__, (base,), {method: build_and_check})


@functools.cache
def megatron_datasets() -> types.SimpleNamespace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_dataset, blended_megatron_dataset_builder, gpt_dataset
        from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    for module in (blended_dataset, gpt_dataset):
        load_without_pickle(module)
    # The builder constructs BlendedDataset by this module-level name (and checks instances against it).
    blended_megatron_dataset_builder.BlendedDataset = checked_subclass(
        blended_megatron_dataset_builder.BlendedDataset, "_build_indices", check_blend_indices)
    return types.SimpleNamespace(
        BlendedMegatronDatasetBuilder=blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder,
        GPTDataset=checked_subclass(gpt_dataset.GPTDataset, "_build_document_sample_shuffle_indices", check_gpt_indices),
        GPTDatasetConfig=gpt_dataset.GPTDatasetConfig,
        IndexedDataset=IndexedDataset, IndexedDatasetBuilder=IndexedDatasetBuilder,
        convert_split_vector_to_split_matrix=convert_split_vector_to_split_matrix,
    )
