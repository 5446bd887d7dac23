"""mHC (manifold-constrained Hyper-Connections, the paper's strongest prior baseline, Table 4) and HC.

m parallel residual streams H (m, B, T, d). Before sublayer l, from x = rmsnorm(mean_j H_j):
    alpha = alpha_0 + g_a tanh(P_a x)          (m,)    width connection: the sublayer reads h = sum_j alpha_j H_j
    beta  = beta_0  + g_b tanh(P_b x)          (m,)    depth connection: output v goes to stream k as beta_k v
    A     = sinkhorn(A_0 + g_A tanh(P_A x))    (m, m)  stream mixing, doubly stochastic
and after it H'_k = sum_j A_kj H_j + beta_k v. Every coefficient is per token; the projections P are
zero-initialised, so at step 0 the connections are the static alpha_0, beta_0, A_0; the gates g start
at 0.01 (mHC's small alpha_pre/post/res).

Initialisation (Hyper-Connections' rule): the embedding is copied into every stream, alpha_0 is the
one-hot e_{(l-1) mod m}, beta_0 is all ones. The streams then stay identical and sublayer l reads
exactly the PreNorm running sum, whatever A is (its rows sum to 1), so the default init *is* the
baseline; the one-hot reads give the streams different gradients, which is what lets them diverge.
A_0 leans towards the identity (HC starts from A = I) but stays inside the polytope: sharper
diagonals slow Sinkhorn's geometric convergence (at a diagonal logit of 3, 20 iterations leave column
sums off by ~1e-4). The final hidden state is the mean of the streams. As in HC, alpha and beta are
unconstrained apart from the tanh bound on their input-dependent parts (mHC's sigmoids cannot express
the one-hot init); only A carries the manifold constraint, which keeps the stream mean a plain
residual recurrence.

HC (variant=hc, `constrained=False`) is the same without the projection: A = A_0 + g_A tanh(P_A x) is
used as it is, with A_0 = I (HC's init), so nothing bounds the streams' growth but training.
M[i->l] = alpha_l^T A_{l-1} ... A_{i+1} beta_i (beta_0 = 1: the embedding is in every stream) has
semiseparable rank at most m for both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.residual.base import DepthState, ResidualMixer

SINKHORN_ITERATIONS = 20  # the mHC paper's t_max
MIX_INIT_LOGIT = 1.0      # diagonal of A_0's logits: A_0 has ~0.48 on the diagonal for m = 4
DYNAMIC_GATE_INIT = 0.01  # scale of the input-dependent parts at init (mHC initialises its gates small)


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    # Connection coefficients are computed in fp32 under bf16 autocast, in fp64 for a float64 model.
    return torch.promote_types(dtype, torch.float32)


def _in_stream_dtype(streams: torch.Tensor):
    """The streams' reads and mixing run in their own dtype: autocast would make these einsums bf16
    matmuls and round the (fp32) streams to bf16 at every sublayer, which the baseline's running sum
    never is (an m x m mix per token: cheap in fp32)."""
    return torch.autocast(streams.device.type, enabled=False)


def sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """(..., m, m) logits -> doubly stochastic matrices: exp, then alternate column and row normalisation
    (at least fp32). Rows go last and sum to 1 to rounding: identical streams stay identical. Plain
    division rather than log space: a third of the ops. Logits are shifted by their matrix's maximum
    (no overflow) and floored 60 below it, so no row or column underflows to all zeros."""
    logits = logits.to(at_least_fp32(logits.dtype))
    mix = (logits - logits.amax((-2, -1), keepdim=True)).clamp(min=-60.0).exp()
    for _ in range(iterations):
        mix = mix / mix.sum(-2, keepdim=True)
        mix = mix / mix.sum(-1, keepdim=True)
    return mix


class StreamConnections(nn.Module):
    """One sublayer's width / depth connections and stream-mixing logits (static part + projection)."""

    def __init__(self, d_model: int, streams: int, sublayer: int, eps: float, constrained: bool = True):
        super().__init__()
        self.streams, self.eps, self.sublayer, self.constrained = streams, eps, sublayer, constrained
        self.read_bias = nn.Parameter(torch.empty(streams))
        self.write_bias = nn.Parameter(torch.empty(streams))
        # mHC: A_0's logits; HC: A_0 itself. Flat (m*m,): the optimizer treats 1-D parameters as biases (no weight decay pulling A_0 towards
        # uniform mixing, no Muon orthogonalisation of a 4x4 logit table).
        self.mix_bias = nn.Parameter(torch.empty(streams * streams))
        self.proj = nn.Linear(d_model, 2 * streams + streams * streams, bias=False)
        # Small learned gates on the tanh-bounded input-dependent parts of alpha, beta and A's logits
        # (mHC's alpha_pre/post/res): without them the per-token coefficients grew within ~60 steps and
        # the gradient norm of the whole model went up 10x (xs, lr 3e-3), stalling training.
        self.gates = nn.Parameter(torch.empty(3))

    def init_weights(self, stds) -> None:
        """The same for every scheme: sublayer l reads stream (l-1) mod m, writes to all, mixes by identity."""
        m = self.streams
        with torch.no_grad():
            self.read_bias.copy_(F.one_hot(torch.tensor((self.sublayer - 1) % m), m))
            self.write_bias.fill_(1.0)
            self.mix_bias.copy_((MIX_INIT_LOGIT if self.constrained else 1.0) * torch.eye(m).flatten())
            self.gates.fill_(DYNAMIC_GATE_INIT)
        nn.init.zeros_(self.proj.weight)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (m, B, T, d) -> alpha (B, T, m), beta (B, T, m), A (B, T, m, m)."""
        mean = streams.mean(0)
        # The projection follows the norm, so a norm gain would be redundant: plain rms normalisation.
        dynamic = self.proj(F.rms_norm(mean, (mean.shape[-1],), eps=self.eps))
        dynamic = dynamic.to(at_least_fp32(dynamic.dtype)).tanh()
        m = self.streams
        alpha = self.read_bias + self.gates[0] * dynamic[..., :m]
        beta = self.write_bias + self.gates[1] * dynamic[..., m:2 * m]
        mix = (self.mix_bias + self.gates[2] * dynamic[..., 2 * m:]).unflatten(-1, (m, m))
        return alpha, beta, sinkhorn(mix) if self.constrained else mix


class HyperConnectionResidual(ResidualMixer):
    """`DepthState.partial` holds the streams (m, B, T, d); `blocks` stays empty. The read computes the
    sublayer's connections and leaves (beta, A) in `state.pending_write` for the write that follows."""

    def __init__(self, d_model: int, n_sublayers: int, eps: float, streams: int, constrained: bool = True):
        super().__init__(d_model, n_sublayers, eps)
        self.streams, self.constrained = streams, constrained

    def make_read(self, sublayer: int) -> StreamConnections | None:
        # The final read is the parameter-free stream mean.
        if sublayer > self.n_sublayers:
            return None
        return StreamConnections(self.d_model, self.streams, sublayer, self.eps, self.constrained)

    def start(self, embedding: torch.Tensor) -> DepthState:
        return DepthState(blocks=[], partial=embedding.unsqueeze(0).expand(self.streams, *embedding.shape))

    def initial_carry(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding.new_ones(self.streams, *embedding.shape[:2], 1)  # (m, B, T, 1): v_0 in every stream

    def read(self, state: DepthState, read: StreamConnections) -> torch.Tensor:
        alpha, beta, mix = read(state.partial)
        dtype = state.partial.dtype
        state.pending_write = (beta.to(dtype), mix.to(dtype))
        with _in_stream_dtype(state.partial):
            h = torch.einsum("btj,jbtd->btd", alpha.to(dtype), state.partial)
            if state.trace is not None:
                row = torch.einsum("btj,jbtl->btl", alpha.to(dtype), state.trace.carry)
                state.trace.add_row(state.next_sublayer, row.unsqueeze(2), h)
        return h

    def write(self, state: DepthState, output: torch.Tensor) -> None:
        self.record_output(state, output)
        beta, mix = state.pending_write
        state.pending_write = None
        with _in_stream_dtype(state.partial):
            mixed = torch.einsum("btkj,jbtd->kbtd", mix, state.partial)
            if state.trace is not None:
                carry = torch.einsum("btkj,jbtl->kbtl", mix, state.trace.carry)   # (m, B, T, l)
                state.trace.carry = torch.cat([carry, beta.permute(2, 0, 1).unsqueeze(-1)], -1)
        state.partial = mixed + beta.permute(2, 0, 1).unsqueeze(-1) * output
        state.next_sublayer += 1

    def final(self, state: DepthState, read) -> torch.Tensor:
        h = state.partial.mean(0)
        if state.trace is not None:
            state.trace.add_row(self.n_sublayers + 1, state.trace.carry.mean(0).unsqueeze(2), h)
        return h
