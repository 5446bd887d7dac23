"""megatron-core's dataset classes, imported on first use and quietly.

The package's __init__ imports its model code as well (seconds), which warns that Transformer Engine and
Apex are missing; the data path uses neither, so those warnings are not shown.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace


def megatron_datasets() -> SimpleNamespace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    return SimpleNamespace(
        BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder, GPTDataset=GPTDataset,
        GPTDatasetConfig=GPTDatasetConfig, IndexedDataset=IndexedDataset, IndexedDatasetBuilder=IndexedDatasetBuilder,
        convert_split_vector_to_split_matrix=convert_split_vector_to_split_matrix,
    )
