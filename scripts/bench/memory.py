"""Activation memory and step time of train.activation_checkpointing = none | full | selective, one process.

Activation bytes are measured, not estimated: every tensor storage an op creates during the forward is
tracked (a TorchDispatchMode holding weak references), so `saved` is what the forward leaves alive
for backward (saved tensors, checkpoint inputs, the selective cache, the logits) and `peak` the most
that was alive at once during the forward. Parameters, buffers and views of them are not counted. Step time (forward + backward)
is timed in separate rounds without the tracker, modes interleaved so load drift hits all alike.

    python -m scripts.bench memory [model=m] [variant=block] [batch=2] [seq=256] [repeats=3]
"""
from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.activation_checkpoint import MODES, apply_activation_checkpointing
from scripts.bench.common import bench_model, interleaved, random_tokens, seconds, set_threads
from scripts.cli import key, parse


@dataclass
class Args:
    model: str = key("m", "configs/model/ size")
    variant: str = key("block", "configs/variant/ residual variant")
    batch: int = key(2, "sequences per step")
    seq: int = key(256, "tokens per sequence")
    repeats: int = key(3, "measurements of each mode (memory, then timed rounds)")
    threads: int = key(0, "torch threads (0: leave as is)")


class StorageTracker(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and the peak of that."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        # Views of weights (w[e], W.t()) share the weights' storage: not activations.
        self.weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = self.peak = 0

    def _freed(self, key: int, nbytes: int) -> None:
        self.live.pop(key, None)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.weights:
                    nbytes = storage.nbytes()
                    ref = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
                    self.live[key] = (ref, nbytes)
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
        return out


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + model.aux_loss()


def activation_bytes(model, tokens: torch.Tensor) -> tuple[int, int]:
    """(bytes alive after the forward, peak bytes alive during it); runs the backward too."""
    with StorageTracker(model) as tracker:
        loss = loss_of(model, tokens)
    saved, peak = tracker.current, tracker.peak
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved, peak


def step(model, tokens: torch.Tensor) -> None:
    loss_of(model, tokens).backward()
    model.zero_grad(set_to_none=True)


def build(args: Args, mode: str):
    model = bench_model(args.model, f"variant={args.variant}")
    apply_activation_checkpointing(model, mode)
    return model


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    set_threads(args.threads)

    models = {mode: build(args, mode) for mode in MODES}
    tokens = random_tokens(models["none"].cfg.vocab_size, (args.batch, args.seq))
    memory = {mode: [activation_bytes(model, tokens) for _ in range(args.repeats)] for mode, model in models.items()}
    times = interleaved({mode: lambda m=model: seconds(lambda: step(m, tokens)) for mode, model in models.items()},
                        args.repeats)

    base_saved = memory["none"][0][0]
    base_time = statistics.median(times["none"])
    print(f"model={args.model} variant={args.variant} batch={args.batch} seq={args.seq} repeats={args.repeats} "
          f"threads={torch.get_num_threads()}")
    print(f"{'mode':<10} {'saved MiB':>10} {'vs none':>8} {'fwd peak MiB':>13} {'step s (median)':>16} "
          f"{'min..max':>14} {'vs none':>8}")
    for mode in MODES:
        saved = {s for s, _ in memory[mode]}
        peaks = {p for _, p in memory[mode]}
        if len(saved) > 1 or len(peaks) > 1:
            raise RuntimeError(f"{mode}: activation bytes differ between repeats: {memory[mode]}")
        s, p = saved.pop(), peaks.pop()
        t = times[mode]
        print(f"{mode:<10} {s / 2**20:>10.1f} {s / base_saved:>8.2f} {p / 2**20:>13.1f} "
              f"{statistics.median(t):>16.3f} {min(t):>6.3f}..{max(t):<6.3f} {statistics.median(t) / base_time:>8.2f}")

