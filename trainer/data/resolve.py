"""From data.path (and data.tokenizer) to an opened token stream: what a path means, preparing it once."""
from __future__ import annotations

from pathlib import Path

from trainer.data.documents import TEXT_SUFFIXES
from trainer.data.format import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    DataError,
    default_cache_dir,
    read_manifest,
    verify_dataset,
)
from trainer.data.prepare import (
    DEFAULT_VOCAB_SIZE,
    GivenTokenizer,
    prepare_cached_text_corpus,
    prepare_default_corpus,
)
from trainer.data.streams import MegatronTokenDataset, TokenDataset, TokenStream

VALID_DATA_PATHS = (
    "a prepared dataset directory (with manifest.json), a directory of .txt/.jsonl files, "
    "a .txt file, a .jsonl file with a 'text' field, or a Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx)"
)


def megatron_prefix(path: Path) -> Path | None:
    """PREFIX for PREFIX, PREFIX.bin or PREFIX.idx when both PREFIX.bin and PREFIX.idx exist."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return prefix
    return None


def resolve_dataset(path: str | None, cache_dir: str | Path | None = None, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                    tokenizer: str | None = None) -> Path:
    """Turn data.path into something open_dataset reads, preparing (once, cached) what needs preparing.

    None: the default Shakespeare corpus. Text inputs are prepared into cache_dir keyed by their names,
    sizes and mtimes and by the tokenizer: data.tokenizer's content hash, or else a BPE of vocab_size.
    A prepared directory is verified as a cached one is (sha256 of every file, token ids below its vocab)
    and returned as it is; so is a Megatron prefix, unverified (it records no checksums).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if path is None:
        return prepare_default_corpus(cache_dir, vocab_size, tokenizer)
    candidate = Path(path).expanduser()
    if (candidate / MANIFEST_NAME).is_file():
        if tokenizer is not None:
            check_prepared_with(candidate, GivenTokenizer(tokenizer, vocab_size))
        verify_dataset(candidate)
        return candidate
    prefix = megatron_prefix(candidate)
    if prefix is not None:
        if tokenizer is not None:
            raise DataError(f"data.tokenizer={tokenizer}: {prefix} is a Megatron dataset, tokenised already; "
                            "unset data.tokenizer")
        return prefix
    if candidate.is_dir() or (candidate.is_file() and candidate.suffix in TEXT_SUFFIXES):
        return prepare_cached_text_corpus(candidate, cache_dir, vocab_size, tokenizer)
    if not candidate.exists():
        raise FileNotFoundError(f"data path {path}: no such file or directory; expected {VALID_DATA_PATHS}")
    raise DataError(f"data path {path}: not a usable dataset; expected {VALID_DATA_PATHS}")


def check_prepared_with(dataset_dir: Path, tokenizer: GivenTokenizer) -> None:
    """A prepared dataset named together with data.tokenizer must have been tokenised by that file."""
    if read_manifest(dataset_dir)["sha256"][TOKENIZER_NAME] != tokenizer.sha256:
        raise DataError(f"data.tokenizer={tokenizer.path} is not the tokenizer {dataset_dir} was prepared with "
                        f"({dataset_dir / TOKENIZER_NAME}); unset data.tokenizer or prepare the text again")


def open_dataset(resolved: Path, split: str, vocab_size: int) -> TokenStream:
    """Open one split of what resolve_dataset returned; the model's vocab must cover the dataset's."""
    if (resolved / MANIFEST_NAME).is_file():
        dataset: TokenStream = TokenDataset(resolved, split)
    elif megatron_prefix(resolved) is not None:
        dataset = MegatronTokenDataset(resolved, split, vocab_size)
    else:
        raise DataError(f"data path {resolved}: not a usable dataset; expected {VALID_DATA_PATHS}")
    if dataset.vocab_size > vocab_size:
        raise DataError(f"{resolved} has vocab size {dataset.vocab_size}, more than the model's {vocab_size}")
    return dataset
