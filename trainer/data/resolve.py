"""From data.path or data.blend (and data.tokenizer) to the weighted Megatron prefixes a run reads, preparing
(once, cached) what needs preparing.

data.blend is Megatron's --data-path: [0.3, PATH_A, 0.7, PATH_B], or a list of {weight, path}; data.path is a
blend of one. Every source must carry the same token ids: without data.tokenizer, the first text source trains
the BPE and the others are tokenised with it, and a prepared dataset made with another tokenizer is refused.
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from pathlib import Path

from trainer.data.format import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    DataError,
    dataset_prefix,
    default_cache_dir,
    read_manifest,
    verify_dataset,
)
from trainer.data.prepare import (
    DEFAULT_VOCAB_SIZE,
    GivenTokenizer,
    PrepareOptions,
    prepare_cached_text_corpus,
    prepare_default_corpus,
)
from trainer.data.sequence_index import SequenceIndexError, read_sequence_index
from trainer.data.text_inputs import is_text_input

VALID_DATA_PATHS = (
    "a prepared dataset directory (with manifest.json), a directory or glob of .txt/.jsonl/.jsonl.gz/.jsonl.zst/"
    ".parquet files, one such file, or a Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx)"
)
VALID_BLEND = "a list [WEIGHT, PATH, WEIGHT, PATH, ...] or [{weight: W, path: P}, ...] with positive weights"


def megatron_prefix(path: Path) -> Path | None:
    """PREFIX for PREFIX, PREFIX.bin or PREFIX.idx when both PREFIX.bin and PREFIX.idx exist."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return prefix
    return None


def resolve_dataset(path: str | None, cache_dir: str | Path | None = None, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                    tokenizer: str | None = None, options: PrepareOptions = PrepareOptions()) -> Path:
    """Turn one data path into a prepared dataset directory or a Megatron prefix, preparing (once, cached) what
    needs preparing.

    None: the default Shakespeare corpus. Text inputs are prepared into cache_dir keyed by their names,
    sizes and mtimes and by the tokenizer: data.tokenizer's content hash, or else a BPE of vocab_size.
    A prepared directory is verified as a cached one is (sha256 of every file, token ids inside its vocab)
    and returned as it is; so is a Megatron prefix, unverified (it records no checksums).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if path is None:
        return prepare_default_corpus(cache_dir, vocab_size, tokenizer, options)
    candidate = Path(path).expanduser()
    if (candidate / MANIFEST_NAME).is_file():
        if tokenizer is not None:
            check_prepared_with(candidate, GivenTokenizer(tokenizer, vocab_size))
        verify_dataset(candidate)
        return candidate
    prefix = megatron_prefix(candidate)
    if prefix is not None:
        # It records no tokenizer: with data.tokenizer, that is the one it was made with (resolve_blend checks
        # that a blend mixing it with prepared data has one).
        check_megatron_index(prefix)
        return prefix
    if candidate.is_dir() or (candidate.is_file() and is_text_input(candidate)) or any(c in path for c in "*?["):
        return prepare_cached_text_corpus(path, cache_dir, vocab_size, tokenizer, options)
    if not candidate.exists():
        raise FileNotFoundError(f"data path {path}: no such file or directory; expected {VALID_DATA_PATHS}")
    raise DataError(f"data path {path}: not a usable dataset; expected {VALID_DATA_PATHS}")


def check_megatron_index(prefix: Path) -> None:
    """A Megatron prefix records no checksums, but its .idx must still describe its .bin."""
    idx = Path(f"{prefix}.idx")
    try:
        read_sequence_index(idx, Path(f"{prefix}.bin").stat().st_size)
    except SequenceIndexError as error:
        raise DataError(f"{idx}: {error}; it does not index {prefix}.bin, build the prefix again") from None


def check_prepared_with(dataset_dir: Path, tokenizer: GivenTokenizer) -> None:
    """A prepared dataset named together with data.tokenizer must have been tokenised by that file."""
    if read_manifest(dataset_dir)["sha256"][TOKENIZER_NAME] != tokenizer.sha256:
        raise DataError(f"data.tokenizer={tokenizer.path} is not the tokenizer {dataset_dir} was prepared with "
                        f"({dataset_dir / TOKENIZER_NAME}); unset data.tokenizer or prepare the text again")


@dataclass(frozen=True)
class BlendEntry:
    weight: float
    path: str | None  # None: the built-in Shakespeare corpus


def parse_blend(blend, path: str | None) -> list[BlendEntry]:
    """data.blend as entries, or data.path as a blend of one; one line naming the bad value otherwise."""
    if blend is None:
        return [BlendEntry(1.0, path)]
    if path is not None:
        raise DataError(f"data.path={path} and data.blend are both set; give one (a path is a blend of one)")
    items = list(blend) if isinstance(blend, (list, tuple)) else None
    if not items:
        raise DataError(f"data.blend={reprlib.repr(blend)} must be {VALID_BLEND}")
    if all(isinstance(item, dict) for item in items):
        pairs = [(item.get("weight"), item.get("path")) for item in items]
        if any(set(item) != {"weight", "path"} for item in items):
            raise DataError(f"data.blend={reprlib.repr(blend)}: every entry needs exactly weight and path; "
                            f"it must be {VALID_BLEND}")
    elif len(items) % 2 == 0:
        pairs = list(zip(items[0::2], items[1::2]))
    else:
        raise DataError(f"data.blend has {len(items)} items, an odd number; it must be {VALID_BLEND}")
    entries = []
    for weight, source in pairs:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise DataError(f"data.blend: weight {weight!r} (for {source}) must be a positive number; "
                            f"data.blend must be {VALID_BLEND}")
        if not isinstance(source, str) or not source:
            raise DataError(f"data.blend: path {source!r} (weight {weight}) must be a non-empty string; "
                            f"data.blend must be {VALID_BLEND}")
        entries.append(BlendEntry(float(weight), source))
    # megatron-core blends by weight / total, which must be a positive number for every source.
    total = sum(entry.weight for entry in entries)
    if not math.isfinite(total):
        raise DataError(f"data.blend: the weights sum to {total}; data.blend must be {VALID_BLEND} of finite sum")
    for entry in entries:
        if entry.weight / total == 0:
            raise DataError(f"data.blend: weight {entry.weight:g} (for {entry.path}) is 0 of the total {total:g} "
                            "once normalised; give weights nearer each other")
    return entries


@dataclass(frozen=True)
class Source:
    given: str                 # the path as the config names it
    prefix: Path               # its Megatron prefix
    weight: float
    manifest: dict | None      # a prepared dataset's manifest; None for a Megatron prefix prepared elsewhere


def check_not_repeated(source: Source, earlier: list[Source]) -> None:
    """A source named twice (spelled the same, with a trailing /, through a link, or a copy of the same
    prepared data) would be drawn as two sources, each with its own shuffle of the same samples; refused
    rather than merged, so the blend's weights are always the ones written."""
    content = source.manifest["sha256"] if source.manifest is not None else None
    for other in earlier:
        same_content = content is not None and other.manifest is not None and other.manifest["sha256"] == content
        if same_content or Path(other.prefix).resolve() == Path(source.prefix).resolve():
            raise DataError(f"data.blend names the same data twice, as {other.given} and {source.given} "
                            f"({source.prefix}); give it once, with its weights summed "
                            f"({other.weight + source.weight:g})")


@dataclass(frozen=True)
class Blend:
    sources: tuple[Source, ...]
    vocab_size: int            # the most ids any source uses (a Megatron prefix's is taken on trust)
    eot_id: int | None         # None if a source is a Megatron prefix, which records none
    tokenizer_file: Path | None

    def describe(self) -> str:
        return ", ".join(f"{source.weight:g} {source.given}" for source in self.sources)


def resolve_blend(blend, path: str | None, cache_dir: str | Path | None, vocab_size: int, tokenizer: str | None,
                  options: PrepareOptions = PrepareOptions()) -> Blend:
    """Prepare or check every source of the blend, in order, with one tokenizer for all."""
    sources, shared = [], tokenizer
    for entry in parse_blend(blend, path):
        resolved = resolve_dataset(entry.path, cache_dir, vocab_size, shared, options)
        manifest = read_manifest(resolved) if (resolved / MANIFEST_NAME).is_file() else None
        if manifest is not None and shared is None:
            shared = str(resolved / TOKENIZER_NAME)  # the later sources are tokenised by this one's tokenizer
        given = entry.path if entry.path is not None else "shakespeare"
        prefix = dataset_prefix(resolved) if manifest is not None else resolved
        source = Source(given, prefix, entry.weight, manifest)
        check_not_repeated(source, sources)
        sources.append(source)
    manifests = [source.manifest for source in sources if source.manifest is not None]
    foreign = [source.given for source in sources if source.manifest is None]
    if foreign and manifests and tokenizer is None:
        raise DataError(f"data.blend mixes the Megatron prefix {foreign[0]}, whose tokenizer is not recorded, with "
                        "data prepared here; set data.tokenizer to the tokenizer.json it was made with")
    dataset_vocab = max((m["vocab_size"] for m in manifests), default=vocab_size)
    if dataset_vocab > vocab_size:
        raise DataError(f"data: the dataset vocab size is {dataset_vocab}, more than model.vocab_size={vocab_size}; "
                        f"set model.vocab_size to at least {dataset_vocab}")
    eot_ids = {m["eot_id"] for m in manifests}
    eot_id = eot_ids.pop() if len(manifests) == len(sources) and len(eot_ids) == 1 else None
    tokenizer_file = Path(shared) if manifests and shared is not None else None
    return Blend(tuple(sources), dataset_vocab, eot_id, tokenizer_file)
