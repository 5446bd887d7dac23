"""Training data: the prepared-dataset format, a Megatron indexed dataset with our manifest (format), gathering
documents (text_inputs), tokenising them into shards on worker processes (shards, prepare), resolving data.path
and data.blend (resolve), and the blended samples megatron-core draws from them (samples).

scripts/prepare_data.py is the command line over resolve_dataset; nothing in trainer/ imports scripts.
"""
from trainer.data.format import (
    EOT_TOKEN,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    DataError,
    DataPreparationError,
    DatasetCorruptError,
    dataset_prefix,
    default_cache_dir,
    verify_dataset,
)
from trainer.data.prepare import PrepareOptions, prepare_cached_text_corpus, prepare_default_corpus, prepare_text_corpus
from trainer.data.resolve import VALID_DATA_PATHS, Blend, megatron_prefix, parse_blend, resolve_blend, resolve_dataset
from trainer.data.samples import BlendSamples, SampleSampler, check_split, open_samples

__all__ = [
    "EOT_TOKEN", "MANIFEST_NAME", "TOKENIZER_NAME", "VALID_DATA_PATHS",
    "Blend", "BlendSamples", "DataError", "DataPreparationError", "DatasetCorruptError", "PrepareOptions",
    "SampleSampler", "check_split", "dataset_prefix", "default_cache_dir", "megatron_prefix", "open_samples", "parse_blend",
    "prepare_cached_text_corpus", "prepare_default_corpus", "prepare_text_corpus", "resolve_blend",
    "resolve_dataset", "verify_dataset",
]
