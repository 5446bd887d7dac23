"""The PreNorm running sum, h_l = sum_{i<l} v_i, its gated form, Highway (variant=highway), and its
embedding-skip form (variant=x0).

Highway: after sublayer l, h <- (1 - g) * h + g * v_l with g = sigmoid(W rmsnorm(h_l) + b_l) computed
from the sublayer's own input h_l, one gate per token (`gate=scalar`, W: 1 x d) or per channel
(`gate=elementwise`, W: d x d). M[i->l] = g_i prod_{i<j<l} (1 - g_j) is 1-semiseparable.

Initialisation: W = 0 and b_l = -log(l), so g_l = 1/(l+1) at step 0. After l writes the state is then
the uniform average of v_0 .. v_l, the baseline's running sum divided by l+1; every sublayer's RMSNorm
(and the final norm) removes that factor, so Highway starts as the baseline's function (up to the
norms' eps), as AttnRes starts from its zero queries, and training moves the gates from there. A
constant start such as g = 1/2 would instead begin with early outputs decaying as 2^-(l-i).

x0 (modded-nanogpt's `x = lambda * x + mu * x0`, as a read): every read, the final one included, is
h_l = lambda_l * (running sum) + mu_l * v_0 with two learned scalars per read, starting at lambda = 1,
mu = 0 (the baseline, exactly). The stream itself stays the plain sum; only what each sublayer reads
re-weights the embedding, so M[0->l] = lambda_l + mu_l and M[i->l] = lambda_l for i > 0. It is the
baseline-family control for AttnRes's access to the embedding: input-independent, no attention over depth.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.residual.base import DepthState, ResidualMixer


class HighwayGate(nn.Module):
    def __init__(self, d_model: int, sublayer: int, elementwise: bool, eps: float):
        super().__init__()
        self.sublayer, self.eps = sublayer, eps
        self.proj = nn.Linear(d_model, d_model if elementwise else 1)

    def init_weights(self, stds) -> None:
        """The same for every scheme: g = 1/(l+1), the running sum's share of one new output."""
        nn.init.zeros_(self.proj.weight)
        nn.init.constant_(self.proj.bias, -math.log(self.sublayer))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, d) -> g (B, T, 1 or d). The projection follows the norm: no gain of its own."""
        return torch.sigmoid(self.proj(F.rms_norm(h, (h.shape[-1],), eps=self.eps)))


class EmbeddingSkip(nn.Module):
    """(lambda, mu) of one x0 read: h = lambda * (running sum) + mu * v_0."""

    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.empty(2))

    def init_weights(self, stds) -> None:
        with torch.no_grad():
            self.weights.copy_(torch.tensor([1.0, 0.0]))  # the baseline's read

    def forward(self, partial: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        scale, skip = self.weights.to(partial.dtype)
        return scale * partial + skip * embedding


class RunningSumResidual(ResidualMixer):
    """`DepthState.partial` holds the sum (the gated sum for Highway); `blocks` holds v_0 for x0, else
    nothing."""

    def __init__(self, d_model: int, n_sublayers: int, eps: float, gate: str | None = None,
                 embedding_skip: bool = False):
        super().__init__(d_model, n_sublayers, eps)
        self.gate = gate  # None: the plain baseline; scalar | elementwise: Highway
        self.embedding_skip = embedding_skip  # x0

    def make_read(self, sublayer: int) -> HighwayGate | EmbeddingSkip | None:
        if self.embedding_skip:
            return EmbeddingSkip()
        if self.gate is None or sublayer > self.n_sublayers:
            return None
        return HighwayGate(self.d_model, sublayer, self.gate == "elementwise", self.eps)

    def start(self, embedding: torch.Tensor) -> DepthState:
        return DepthState(blocks=[embedding] if self.embedding_skip else [], partial=embedding)

    def initial_carry(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding.new_ones(*embedding.shape[:2], 1, 1)  # (B, T, G=1, 1): the state is v_0

    def read(self, state: DepthState, read: HighwayGate | EmbeddingSkip | None) -> torch.Tensor:
        if isinstance(read, EmbeddingSkip):
            return self._skip_read(state, read, state.next_sublayer)
        if read is not None:
            state.pending_write = read(state.partial)
        if state.trace is not None:
            state.trace.add_row(state.next_sublayer, state.trace.carry, state.partial)
        return state.partial

    def _skip_read(self, state: DepthState, read: EmbeddingSkip, sublayer: int) -> torch.Tensor:
        h = read(state.partial, state.blocks[0])
        if state.trace is not None:
            carry = state.trace.carry                                # (B, T, G, l): the sum's coefficients
            scale, skip = read.weights.to(carry.dtype)
            first = torch.zeros_like(carry)
            first[..., 0] = 1
            state.trace.add_row(sublayer, scale * carry + skip * first, h)
        return h

    def write(self, state: DepthState, output: torch.Tensor) -> None:
        self.record_output(state, output)
        gate, state.pending_write = state.pending_write, None
        if gate is None:
            state.partial = state.partial + output
        else:
            # lerp does not promote: under autocast the output and gate are bf16, and the sum keeps the
            # stream's dtype as the baseline's + does (fp32 from an fp32 embedding).
            dtype = state.partial.dtype
            state.partial = torch.lerp(state.partial, output.to(dtype), gate.to(dtype))  # (1 - g) h + g v
        if state.trace is not None:
            carry = state.trace.carry                               # (B, T, G, l)
            if gate is None:
                state.trace.carry = torch.cat([carry, torch.ones_like(carry[..., :1])], -1)
            else:
                g = gate.unsqueeze(-1)                              # (B, T, 1 or d, 1)
                state.trace.carry = torch.cat([(1 - g) * carry, g], -1)
        state.next_sublayer += 1

    def final(self, state: DepthState, read) -> torch.Tensor:
        if isinstance(read, EmbeddingSkip):
            return self._skip_read(state, read, self.n_sublayers + 1)
        if state.trace is not None:
            state.trace.add_row(self.n_sublayers + 1, state.trace.carry, state.partial)
        return state.partial
