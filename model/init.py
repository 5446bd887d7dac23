"""Initialisation schemes (`model.init`): the standard deviations every module draws its weights from.

Each module initialises the parameters it holds itself (directly or in plain torch layers such as
nn.Linear) in one method, `init_weights(stds)`: such a module and the descendants that define no
`init_weights` of their own form one *init unit*. Every unit draws from the RNG seeded with
(seed, the unit's qualified name in the whole single-process Decoder), so a parameter's initial value
depends on nothing else: not on what was built or drawn before, nor on which other parts a rank
keeps (a pipeline stage, a shard). `initialise` fills a built tree in place; `materialise` allocates
and fills a tree built on the meta device, one unit at a time, on the host, and hands each full
parameter to a `place` hook that can keep only a rank's slice of it. The values come from the CPU
generator whatever the target device, so every device and layout starts from the same weights.

- `scaled` (default, the established GPT-2 / Megatron / torchtitan practice): token embedding N(0, 1);
  input-side projections and routers N(0, init_std); every sublayer's output projection (KDA and MLA
  o_proj, dense MLP down, shared and routed expert down) N(0, init_std / sqrt(L)) with L sublayers, so
  the residual sum of L outputs starts at the size of one; LM head N(0, d^-1/2), so logits start O(1)
  on a unit-RMS final norm.
- `flat`: every matrix, the embedding and the head included, N(0, init_std); the project's first
  recipe. In a PreNorm sum its small embedding drowns under the sublayer outputs, a handicap that
  AttnRes's normalised keys route around: it exists to reproduce that finding, not to train with.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

INIT_SCHEMES = ("scaled", "flat")


@dataclass(frozen=True)
class InitStds:
    hidden: float     # input-side projections, routers, low-rank gates
    output: float     # each sublayer's output projection, the one that writes to the residual stream
    embedding: float  # token embedding
    head: float       # LM head


def init_stds(scheme: str, init_std: float, d_model: int, n_sublayers: int) -> InitStds:
    if scheme == "scaled":
        return InitStds(hidden=init_std, output=init_std / math.sqrt(n_sublayers), embedding=1.0,
                        head=d_model ** -0.5)
    if scheme == "flat":
        return InitStds(hidden=init_std, output=init_std, embedding=init_std, head=init_std)
    raise ValueError(f"model.init={scheme!r} is not a scheme; choose one of {', '.join(INIT_SCHEMES)}")


def module_seed(seed: int, name: str) -> int:
    """The seed of the init unit called `name` (a stable hash: the same in every process and run)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


@contextlib.contextmanager
def seeded_rng(seed: int, devices: set[torch.device]) -> Iterator[None]:
    """Draws inside come from the CPU generator and those of the CUDA `devices`, seeded with `seed`;
    the RNG state outside is restored afterwards. Only these generators are seeded: torch.manual_seed
    would also replace the seed queued for a CUDA that is not initialised yet."""
    cuda = sorted({torch.cuda.current_device() if d.index is None else d.index for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def init_units(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]:
    """(qualified name, module, members) for every module of `root` that defines `init_weights`; the
    members are the module and its descendants without `init_weights` of their own, by qualified name.
    `prefix` is root's own name in the whole Decoder. A module holding tensors outside every unit is an
    error: nothing would initialise it."""
    units: dict[str, tuple[str, nn.Module, list[tuple[str, nn.Module]]]] = {}
    owner: dict[str, str | None] = {}
    for name, module in root.named_modules(prefix=prefix):
        parent = name.rpartition(".")[0] if name != prefix else None
        if hasattr(module, "init_weights"):
            units[name] = (name, module, [])
            owner[name] = name
        else:
            owner[name] = owner.get(parent) if parent is not None else None
        if owner[name] is not None:
            units[owner[name]][2].append((name, module))
        elif _own_tensors(module):
            raise ValueError(f"{name or type(module).__name__} holds tensors but no module initialises them "
                             "(give it or a parent an init_weights)")
    return list(units.values())


def initialise(root: nn.Module, stds: InitStds, seed: int, prefix: str = "") -> None:
    """Call `init_weights(stds)` on every module of `root` (itself included) that defines it, each
    under its own seed (module_seed). `prefix`: root's qualified name in the whole Decoder, so that a
    part initialised alone gets the values it has in the whole model."""
    for name, module, members in init_units(root, prefix):
        devices = {t.device for _, member in members for t in _own_tensors(member)}
        with seeded_rng(module_seed(seed, name), devices):
            module.init_weights(stds)


Place = Callable[[str, torch.Tensor], torch.Tensor]


def materialise(root: nn.Module, device: torch.device | str, stds: InitStds, seed: int,
                place: Place | None = None, prefix: str = "") -> nn.Module:
    """Allocate and initialise, in place, every init unit of `root` that still holds meta tensors
    (units already materialised are left as they are), one unit at a time: its modules' own
    parameters and buffers are allocated on the host (`to_empty(recurse=False)`), initialised under
    the unit's seed exactly as `initialise` would, then moved to `device`.

    `place(name, full)` (optional) decides what the module keeps of each parameter: it receives the
    parameter's qualified name and its full, initialised host tensor and returns the tensor to hold
    (e.g. this rank's slice on `device`, or a DTensor shard); a returned nn.Parameter is kept as is,
    anything else is wrapped in one with the original requires_grad. Without it the parameter moves
    whole to `device`. Buffers always move whole. The host never holds more than one unit (a module
    such as one MoE layer's expert stacks) beyond what `place` keeps. Returns `root`."""
    device = torch.device(device)
    for name, unit, members in init_units(root, prefix):
        if not any(t.is_meta for _, member in members for t in _own_tensors(member)):
            continue
        for _, member in members:
            member.to_empty(device="cpu", recurse=False)
        with seeded_rng(module_seed(seed, name), set()):
            unit.init_weights(stds)
        for member_name, member in members:
            _place_own_tensors(member, member_name, device, place)
    return root


def _place_own_tensors(module: nn.Module, name: str, device: torch.device, place: Place | None) -> None:
    for key, param in list(module._parameters.items()):
        if param is None:
            continue
        full = param.detach()
        kept = place(_join(name, key), full) if place is not None else full.to(device)
        if not isinstance(kept, nn.Parameter):
            kept = nn.Parameter(kept, requires_grad=param.requires_grad)
        setattr(module, key, kept)
    for key, buffer in list(module._buffers.items()):
        if buffer is not None:
            module._buffers[key] = buffer.to(device)
