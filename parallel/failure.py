"""Fail fast across ranks: the first rank to fail writes one line about it into the job's TCPStore, and
every other rank, which a thread keeps watching the store, ends within a second with a line naming that
rank and its error.

Without it a rank that fails alone leaves its peers waiting in their next collective for
parallel.init_timeout_s (600 s by default) or parallel.collective_timeout_s, and under torchrun
--max-restarts every restart waits again. torchrun's agent does stop the other ranks once a failed rank has
exited, but only then, and not every launcher has such an agent. The store is the job's own (torchrun's
agent store, or rank 0's under env://), read through a client of this module's, under a prefix per torchrun
attempt so that a restart never reads the previous attempt's failure.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

FAILED_KEY = "first_failure"
STOPPED_KEY = "ranks_stopped"  # how many watchers have read the first failure and are ending their rank
POLL_S = 0.1
LINGER_S = 2.0  # how long the first failing rank waits for its peers to read its failure
STORE_TIMEOUT = timedelta(seconds=60)  # connecting to the store; reading it never waits (check, then get)


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class FailureBoard:
    """One rank's view of the job's first failure: `fail` records this rank's, the watcher thread ends this
    process when another rank's appears while this one is still working."""

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.handling = threading.Event()  # this rank is reporting its own failure: the watcher stands back
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="failure-watch", daemon=True)
        self.thread.start()

    def fail(self, message: str) -> str | None:
        """Record `message` as this rank's failure unless another rank failed first; returns that earlier
        failure ("rank R: ..."), or None when this one is the first."""
        self.handling.set()
        mine = f"rank {self.rank}: {message}"
        try:
            stored = self.store.compare_set(FAILED_KEY, "", mine).decode(errors="replace")
            if stored != mine:
                self.store.add(STOPPED_KEY, 1)  # this rank has read the first failure too
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending, and this error is still ours
            return None
        return None if stored == mine else stored

    def linger(self) -> None:
        """Wait (at most LINGER_S) until every other rank has read this rank's failure: torchrun's agent ends
        them once this process exits, and they should have said why first."""
        deadline = time.monotonic() + LINGER_S
        try:
            while self.store.add(STOPPED_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(POLL_S / 2)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            return

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _others_failure(self) -> str | None:
        try:
            if not self.store.check([FAILED_KEY]):
                return None
            message = self.store.get(FAILED_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a store that went away with its host: the collectives will say so
            return None
        return None if message.startswith(f"rank {self.rank}: ") else message

    def _watch(self) -> None:
        while not self.stopping.wait(POLL_S):
            earlier = self._others_failure()
            if earlier is not None and not self.handling.is_set():
                # This rank may be blocked inside a collective that no exception can interrupt.
                sys.stderr.write(f"error: rank {self.rank} stops because {earlier}\n")
                sys.stderr.flush()
                try:
                    self.store.add(STOPPED_KEY, 1)
                finally:
                    os._exit(1)


def watch_for_failures(rank: int, world_size: int) -> FailureBoard | None:
    """A FailureBoard over the job's store (MASTER_ADDR:MASTER_PORT); None for one process."""
    if world_size == 1 or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=STORE_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return FailureBoard(dist.PrefixStore(f"attempt_{attempt}/failures/", store), rank, world_size)
