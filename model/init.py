"""Initialisation schemes (`model.init`): the standard deviations every module draws its weights from.

Each module initialises the parameters it holds itself (directly or in plain torch layers such as
nn.Linear) in one method, `init_weights(stds)`; `initialise(root, stds)` calls it on every module of a
tree in registration order, so the same seed gives the same weights however the tree was built.

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

import math
from dataclasses import dataclass

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


def initialise(root: nn.Module, stds: InitStds) -> None:
    """Call `init_weights(stds)` on every module of `root` (itself included) that defines it."""
    for module in root.modules():
        init_weights = getattr(module, "init_weights", None)
        if init_weights is not None:
            init_weights(stds)
