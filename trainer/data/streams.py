"""Reading token streams: one split of a prepared dataset or a Megatron indexed dataset, windows drawn
by a deterministic, resumable sampler, and (inputs, targets) batches.

Every dataset is a flat token stream per split. Sample w is the window of seq_len + 1 tokens starting
at token w * seq_len: inputs are its first seq_len tokens, targets the last seq_len.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from trainer.data.format import SPLITS, DataError, split_path, val_token_count, verify_dataset

MEGATRON_INSTALL = "pip install -e '.[megatron]'"


class TokenStream(Protocol):
    vocab_size: int

    def __len__(self) -> int: ...

    def read(self, start: int, length: int) -> np.ndarray: ...


class TokenDataset:
    """One split of a prepared dataset directory, memory-mapped read-only."""

    def __init__(self, dataset_dir: str | Path, split: str = "train"):
        self.dataset_dir = Path(dataset_dir)
        self.split = split
        # Sizes only: sha256 is checked when a dataset is built or reused; re-hashing a
        # large dataset on every rank at every start would be slow.
        manifest = verify_dataset(self.dataset_dir, check_checksums=False)
        self.vocab_size: int = manifest["vocab_size"]
        self.eot_id: int = manifest["eot_id"]
        self.tokens = np.memmap(
            split_path(self.dataset_dir, split), dtype=manifest["dtype"], mode="r", shape=(manifest["tokens"][split],)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside the {self.split} split of {len(self)} tokens")
        return np.asarray(self.tokens[start : start + length], dtype=np.int64)


class MegatronTokenDataset:
    """A Megatron indexed dataset (PREFIX.bin/.idx) read through megatron-core, documents concatenated.

    Megatron data carries no split, so the tail is held out as val by the same rule as prepared data.
    Its vocab size is not recorded either; the configured one is taken on trust.
    """

    def __init__(self, prefix: str | Path, split: str, vocab_size: int):
        try:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        except ImportError:
            # A DataError, not the ImportError: the CLIs turn it into their one `error:` line.
            raise DataError(f"{prefix} is a Megatron indexed dataset; reading it needs megatron-core: "
                            f"{MEGATRON_INSTALL}") from None
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.vocab_size = vocab_size
        self._indexed = IndexedDataset(str(prefix))
        self._sequence_lengths = np.asarray(self._indexed.sequence_lengths, dtype=np.int64)
        self._sequence_ends = np.cumsum(self._sequence_lengths)
        total = int(self._sequence_ends[-1]) if len(self._sequence_ends) else 0
        num_train = total - val_token_count(total)
        self._start, self._stop = (0, num_train) if split == "train" else (num_train, total)

    def __len__(self) -> int:
        return self._stop - self._start

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside the {self.split} split of {len(self)} tokens")
        position = self._start + start
        sequence = int(np.searchsorted(self._sequence_ends, position, side="right"))
        pieces = []
        while length > 0:
            offset = position - int(self._sequence_ends[sequence] - self._sequence_lengths[sequence])
            take = min(length, int(self._sequence_lengths[sequence]) - offset)
            pieces.append(self._indexed.get(sequence, offset=offset, length=take))
            position, length, sequence = position + take, length - take, sequence + 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Non-overlapping windows of seq_len + 1 tokens that share one token with the next window."""
    return max(0, (num_tokens - 1) // seq_len)


class SequenceSampler:
    """Deterministic, resumable order of training windows.

    Each epoch is a permutation of all windows drawn from (seed, epoch). Samples are consumed in one
    global order; a step takes the next global_batch of them and data-parallel rank r takes the r-th
    contiguous slice. Every rank holds an identical sampler, so the state is one counter.
    """

    def __init__(self, num_tokens: int, seq_len: int, seed: int):
        self.num_windows = num_windows(num_tokens, seq_len)
        if self.num_windows == 0:
            raise ValueError(f"{num_tokens} training tokens hold no window of seq_len + 1 = {seq_len + 1} tokens")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seq_len = seq_len
        self.seed = seed
        self.consumed_samples = 0
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_windows

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            generator = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._cached_epoch = (epoch, generator.permutation(self.num_windows))
        return self._cached_epoch[1]

    def next_batch(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
        """Window indices for this rank's share of the next global batch; advances by global_batch."""
        if global_batch % dp_size != 0:
            raise ValueError(f"global_batch {global_batch} is not divisible by dp_size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        per_rank = global_batch // dp_size
        first = self.consumed_samples + dp_rank * per_rank
        windows = []
        for sample in range(first, first + per_rank):
            epoch, position = divmod(sample, self.num_windows)
            windows.append(int(self._epoch_order(epoch)[position]))
        self.consumed_samples += global_batch
        return windows

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        # A resume onto other data or another seed would silently change the order; refuse instead.
        expected = {"seed": self.seed, "seq_len": self.seq_len, "num_windows": self.num_windows}
        saved = {key: state[key] for key in expected}
        if saved != expected:
            raise ValueError(f"sampler state {saved} does not match this sampler {expected}")
        self.consumed_samples = int(state["consumed_samples"])


def get_batch(dataset: TokenStream, window_indices: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each a LongTensor (len(window_indices), seq_len); targets are inputs shifted by one."""
    rows = np.stack([dataset.read(w * seq_len, seq_len + 1) for w in window_indices])
    windows = torch.from_numpy(rows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def val_batches(
    dataset: TokenStream, seq_len: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same evenly strided windows of the val split on every call, so every eval measures the same tokens."""
    available = num_windows(len(dataset), seq_len)
    if available == 0:
        raise ValueError(f"val split has {len(dataset)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    count = available if max_batches is None else min(available, batch_size * max_batches)
    windows = (np.arange(count) * available) // count
    for first in range(0, count, batch_size):
        yield get_batch(dataset, windows[first : first + batch_size].tolist(), seq_len)
