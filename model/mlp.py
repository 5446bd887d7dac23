"""The gated MLP (SwiGLU or SiTU): the dense MLP and the MoE's shared experts; its activation, which the routed
experts (model/moe.py) apply too."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.init import InitStds

ACTIVATIONS = ("swiglu", "situ")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for the release's SiTU arithmetic; fp64 stays fp64 (the tests' oracle precision)."""
    return x if x.dtype == torch.float64 else x.float()


@dataclass(frozen=True)
class GatedActivation:
    """h = f(gate) * g(up), what a gated MLP's down projection reads; declared once, with its derivative, for
    every path that runs it (autograd through __call__, and the expert loop's hand-written backward).

    swiglu: f = silu, g = identity, in the input dtype.
    situ (Kimi K3): f(a) = beta tanh(a / beta) sigmoid(a), g(b) = linear_beta tanh(b / linear_beta) (identity
    when linear_beta is None). Both saturate, so no pre-activation can blow the product up. Computed in fp32
    and returned in the input dtype, as the release's SituAndMul does."""
    kind: str = "swiglu"
    beta: float = 4.0
    linear_beta: float | None = 25.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation={self.kind!r} is not one of {' | '.join(ACTIVATIONS)}")

    @classmethod
    def of(cls, moe) -> "GatedActivation":
        """The activation a MoEConfig names (model.moe.activation and its betas)."""
        return cls(moe.activation, moe.situ_beta, moe.situ_linear_beta)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(gate) * up
        a, b = _upcast(gate), _upcast(up)
        f = self.beta * torch.tanh(a / self.beta) * torch.sigmoid(a)
        g = b if self.linear_beta is None else self.linear_beta * torch.tanh(b / self.linear_beta)
        return (f * g).to(gate.dtype)

    def backward(self, gate: torch.Tensor, up: torch.Tensor,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h, dL/dgate, dL/dup) from the pre-activations and dL/dh, recomputing h."""
        if self.kind == "swiglu":
            sig = torch.sigmoid(gate)
            # silu'(a) = sig(a) (1 + a (1 - sig(a)))
            return gate * sig * up, grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig
        a, b, d_h = _upcast(gate), _upcast(up), _upcast(grad)
        sig, t = torch.sigmoid(a), torch.tanh(a / self.beta)
        f = self.beta * t * sig
        d_f = (1 - t * t) * sig + f * (1 - sig)  # (beta tanh(a/beta))' sig + beta tanh(a/beta) sig'
        if self.linear_beta is None:
            g, d_g = b, torch.ones_like(b)
        else:
            u = torch.tanh(b / self.linear_beta)
            g, d_g = self.linear_beta * u, 1 - u * u
        dtype = gate.dtype
        return (f * g).to(dtype), (d_h * g * d_f).to(dtype), (d_h * f * d_g).to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, d_model: int, inter: int, activation: GatedActivation = GatedActivation()):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(d_model, inter, bias=False)
        self.up_proj = nn.Linear(d_model, inter, bias=False)
        self.down_proj = nn.Linear(inter, d_model, bias=False)

    def init_weights(self, stds: InitStds) -> None:
        nn.init.normal_(self.gate_proj.weight, std=stds.hidden)
        nn.init.normal_(self.up_proj.weight, std=stds.hidden)
        nn.init.normal_(self.down_proj.weight, std=stds.output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
