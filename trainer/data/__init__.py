"""Training data: the prepared-dataset format (format), gathering documents (documents), tokenising
them into a prepared dataset (prepare), resolving data.path (resolve) and reading windows (streams).

scripts/prepare_data.py is the command line over resolve_dataset; nothing in trainer/ imports scripts.
"""
from trainer.data.format import (
    EOT_TOKEN,
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_NAME,
    DataError,
    DataPreparationError,
    DatasetCorruptError,
    default_cache_dir,
    verify_dataset,
)
from trainer.data.prepare import prepare_cached_text_corpus, prepare_default_corpus, prepare_text_corpus
from trainer.data.resolve import VALID_DATA_PATHS, megatron_prefix, open_dataset, resolve_dataset
from trainer.data.streams import (
    MegatronTokenDataset,
    SequenceSampler,
    TokenDataset,
    TokenStream,
    get_batch,
    num_windows,
    val_batches,
)

__all__ = [
    "EOT_TOKEN", "MANIFEST_NAME", "SPLITS", "TOKENIZER_NAME", "VALID_DATA_PATHS",
    "DataError", "DataPreparationError", "DatasetCorruptError",
    "MegatronTokenDataset", "SequenceSampler", "TokenDataset", "TokenStream",
    "default_cache_dir", "get_batch", "megatron_prefix", "num_windows", "open_dataset",
    "prepare_cached_text_corpus", "prepare_default_corpus", "prepare_text_corpus",
    "resolve_dataset", "val_batches", "verify_dataset",
]
