"""Training and validation samples of a blend, through megatron-core. BlendedMegatronDatasetBuilder over
GPTDataset gives the train/valid/test split (data.split, over each source's sequences, as Megatron's --split),
each source's sample index, the weighted blend, the shuffle, and the index cache in data.cache_dir/indices,
built by rank 0 and read by every other rank and node.

Training sample n is sample n mod P of pass n // P. A pass is P = (the blend's training tokens) // seq_len
samples drawn by the blend's weights, and pass p is Megatron's blended dataset for the seed of (seed, p). The
order therefore depends on the data, seq_len and seed, never on train.steps: a run extended from a checkpoint
reads what a longer run would have read. Validation is the valid split once over, shuffled with a fixed seed,
so every run of a comparison scores the same samples.

megatron-core is imported when data is first opened: its package import takes seconds.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from trainer.data.format import DataError, default_cache_dir, disk_full_as_error
from trainer.data.index_cache import refuse_index_links
from trainer.data.mcore import megatron_datasets
from trainer.data.prepare import PrepareOptions
from trainer.data.resolve import Blend, resolve_blend

SPLIT_NAMES = ("train", "valid", "test")
VALID_SPLIT = "three numbers for train, valid and test, as Megatron's --split: e.g. 98,2,0"
VAL_SEED = 0
INDEX_DIR = "indices"


def check_split(split: str) -> list[float]:
    """data.split as train/valid/test fractions; a valid share is required, the trainer evaluates on it."""
    parts = re.fullmatch(r"\s*([0-9.]+)\s*,\s*([0-9.]+)\s*(?:,\s*([0-9.]+)\s*)?", str(split))
    try:
        shares = [float(x) for x in parts.groups(default="0")] if parts else None
    except ValueError:
        shares = None
    if shares is None or not math.isfinite(sum(shares)) or sum(shares) <= 0:
        raise DataError(f"data.split={split} must be {VALID_SPLIT}")
    if shares[0] <= 0 or shares[1] <= 0:
        raise DataError(f"data.split={split} must give train and valid a positive share; it must be {VALID_SPLIT}")
    return [share / sum(shares) for share in shares]


class DatasetTokenizer:
    """What GPTDataset reads of a tokenizer: the end-of-document id and the vocab size (its key in the cache)."""

    def __init__(self, eod: int, vocab_size: int):
        self.eod, self.vocab_size = eod, vocab_size

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "DatasetTokenizer", "eod": self.eod, "vocab_size": self.vocab_size}


@contextmanager
def process_group() -> Iterator[None]:
    """The builder is collective (rank 0 builds the cache, the others wait and read it) and asks for a rank
    even in one process; a one-rank gloo group stands in when no job is running."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pass_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class BlendSamples:
    """The samples of seq_len + 1 tokens of one blend: training passes and the validation split."""

    def __init__(self, blend: Blend, split: str, seq_len: int, seed: int, cache_dir: Path):
        self.blend, self.split, self.seq_len, self.seed = blend, split, seq_len, seed
        self.cache_dir = Path(cache_dir) / INDEX_DIR
        shares = check_split(split)
        self.split_text = ",".join(f"{share:.6g}" for share in shares)
        matrix = megatron_datasets().convert_split_vector_to_split_matrix(shares)
        self.split_tokens = [split_token_counts(source.prefix, matrix) for source in blend.sources]
        for source, tokens in zip(blend.sources, self.split_tokens):
            for name, count in zip(SPLIT_NAMES[:2], tokens):
                if count < seq_len + 1:
                    raise DataError(f"data.split={split} leaves {source.given} {count} {name} tokens, fewer than one "
                                    f"sample of train.seq_len + 1 = {seq_len + 1}; give it more documents, a larger "
                                    f"{name} share or a shorter train.seq_len")
        self.pass_samples = sum(tokens[0] for tokens in self.split_tokens) // seq_len
        self.val_samples = sum((tokens[1] - 1) // seq_len for tokens in self.split_tokens)
        self._passes: dict[int, object] = {}
        self._valid = None

    def _build(self, sizes: list[int], seed: int) -> list:
        mcore = megatron_datasets()
        eod = self.blend.eot_id if self.blend.eot_id is not None else 0
        sources = self.blend.sources
        config = mcore.GPTDatasetConfig(
            random_seed=seed, sequence_length=self.seq_len, split=self.split_text,
            # One source is no blend: without weights megatron-core serves its GPTDataset directly.
            blend=([str(source.prefix) for source in sources], [source.weight for source in sources]
                   if len(sources) > 1 else None),
            path_to_cache=str(self.cache_dir), tokenizer=DatasetTokenizer(eod, self.blend.vocab_size),
            # Masks come from the model (document_starts), positions are not an input, every label is scored.
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        )
        refuse_index_links(self.cache_dir)
        with process_group(), disk_full_as_error(self.cache_dir, "megatron-core's index cache",
                                                 "free some space or set data.cache_dir elsewhere"):
            return mcore.BlendedMegatronDatasetBuilder(mcore.GPTDataset, sizes, lambda: True, config).build()

    def build_for_run(self, steps: int, global_batch: int) -> None:
        """Build (or read from the cache) every training pass `steps` steps read, and the validation samples.
        Collective in a running job: megatron-core's builder has rank 0 write the index cache while the other
        ranks wait, then read it."""
        if self.pass_samples < global_batch:
            raise DataError(f"train.seq_len={self.seq_len}: the training split holds {self.pass_samples} samples, "
                            f"fewer than train.global_batch={global_batch}")
        for index in range(-(-steps * global_batch // self.pass_samples)):
            self.train_pass(index)
        self.valid()

    def train_pass(self, index: int):
        if index not in self._passes:
            self._passes[index] = self._build([self.pass_samples, 0, 0], pass_seed(self.seed, index))[0]
        return self._passes[index]

    def valid(self):
        if self._valid is None:
            self._valid = self._build([0, self.val_samples, 0], VAL_SEED)[1]
        return self._valid

    def train_batch(self, samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of training samples n: pass n // P, position n mod P."""
        return stack([self.train_pass(n // self.pass_samples)[n % self.pass_samples] for n in samples])

    def val_batches(self, batch_size: int, max_batches: int | None = None
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same validation samples on every call: the first batch_size * max_batches (all if None)."""
        valid = self.valid()
        count = self.val_samples if max_batches is None else min(self.val_samples, batch_size * max_batches)
        for first in range(0, count, batch_size):
            yield stack([valid[i] for i in range(first, min(first + batch_size, count))])


def stack(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(items), seq_len); GPTDataset's labels are its tokens shifted by one."""
    if not all(bool(item["loss_mask"].all()) for item in items):
        raise DataError("a sample came back padded: its source is shorter than one sample of train.seq_len + 1")
    return torch.stack([item["tokens"] for item in items]), torch.stack([item["labels"] for item in items])


def split_token_counts(prefix: Path, matrix: list) -> list[int]:
    """Tokens in each split of one source: Megatron splits a source's sequences at round(share * count)."""
    indexed = megatron_datasets().IndexedDataset(str(prefix))
    # A copy: the lengths are a view of the .idx memory map, which closes with `indexed`.
    lengths = np.array(indexed.sequence_lengths, dtype=np.int64)
    del indexed
    ends = np.concatenate([[0], np.cumsum(lengths)])
    counts = []
    for bounds in matrix:
        if bounds is None:
            counts.append(0)
            continue
        begin, end = (int(round(bound * float(len(lengths)))) for bound in bounds)
        counts.append(int(ends[end] - ends[begin]))
    return counts


class SampleSampler:
    """Which training samples each step reads: one global order consumed a global batch at a time, data-parallel
    rank r taking the r-th contiguous slice of it. Every rank holds the same sampler, so its state is a counter."""

    def __init__(self, pass_samples: int, seq_len: int, seed: int):
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.pass_samples, self.seq_len, self.seed = pass_samples, seq_len, seed
        self.consumed_samples = 0

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.pass_samples

    def next_batch(self, global_batch: int, data_rank: int = 0, data_ranks: int = 1) -> list[int]:
        """Sample numbers for this data rank's share of the next global batch (the ranks that see different
        data: parallel/dims.py's data_ranks); advances by global_batch."""
        if global_batch % data_ranks != 0:
            raise ValueError(f"global_batch {global_batch} is not divisible by the {data_ranks} data ranks")
        if not 0 <= data_rank < data_ranks:
            raise ValueError(f"data rank {data_rank} outside [0, {data_ranks})")
        per_rank = global_batch // data_ranks
        first = self.consumed_samples + data_rank * per_rank
        self.consumed_samples += global_batch
        return list(range(first, first + per_rank))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len,
                "pass_samples": self.pass_samples}

    def load_state_dict(self, state: dict) -> None:
        # A resume onto other data or another seed would silently change the order; refuse instead.
        expected = {"seed": self.seed, "seq_len": self.seq_len, "pass_samples": self.pass_samples}
        saved = {key: state.get(key) for key in expected}
        if saved != expected:
            raise ValueError(f"sampler state {saved} does not match this run's data {expected}")
        self.consumed_samples = int(state["consumed_samples"])


def open_samples(data, vocab_size: int, seq_len: int, seed: int) -> BlendSamples:
    """The samples of a run's data settings (trainer.config.DataConfig: path or blend, split, cache_dir,
    tokenizer, prepare_workers, bad_inputs), preparing what needs preparing."""
    options = PrepareOptions(data.prepare_workers, data.bad_inputs)
    blend = resolve_blend(data.blend, data.path, data.cache_dir, vocab_size, data.tokenizer, options)
    cache_dir = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    return BlendSamples(blend, data.split, seq_len, seed, cache_dir)
