"""Kimi Delta Attention (KDA), the linear-attention token mixer of Kimi Linear.

q, k, v pass through a depthwise causal short convolution and SiLU; q and k are L2-normalised per
head. A gated delta rule with a per-channel decay mixes tokens (kernels/kda), and the result is
RMS-normalised per head and gated by a sigmoid before the output projection. Parameter names follow
flash-linear-attention's KDA layer so checkpoints map one to one. K3's options (model.kda): the forget gate
bounded below (`forget_gate`), the output gate one full-rank Linear, and no bias on it. With document_starts (model/document_masking.py)
the convolution and the recurrent state restart at every document start. With a `sequence_split`
(model/sequence_split.py) x is one slice of the sequence: the convolution continues from the previous
slice's last inputs and the recurrence from the state the earlier slices leave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kda import kda_chunk, kda_chunk_from_unknown_start, kda_recurrent
from model.config import ModelConfig
from model.document_masking import check_document_starts, same_document_window
from model.init import InitStds
from model.norms import RMSNorm
from model.sequence_split import SequenceSplit

# The decay's time step dt = softplus(. + dt_bias) starts log-uniform in [DT_MIN, DT_MAX].
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
# A = exp(A_log) starts uniform in [A_MIN, A_MAX]: per-head decay rates spread over an order of magnitude.
A_MIN, A_MAX = 1.0, 16.0


@dataclass
class KDACache:
    """What decoding carries between calls (KDA's decoding cache): the last conv_kernel - 1 convolution
    inputs and the recurrent state. KimiDeltaAttention.forward replaces these fields with the updated ones."""
    conv_q: torch.Tensor     # (B, conv_kernel-1, H*K)
    conv_k: torch.Tensor     # (B, conv_kernel-1, H*K)
    conv_v: torch.Tensor     # (B, conv_kernel-1, H*V)
    recurrent: torch.Tensor  # (B, H, K, V), fp32


def _short_conv(conv: nn.Conv1d, x: torch.Tensor, tail: torch.Tensor,
                window: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x (B, T, D) continuing after tail (B, W-1, D), then SiLU.
    window (B, T, W) bool, from same_document_window: which inputs of each output's receptive field are
    in its document; the others count as zero. Returns the output (B, T, D) and the new tail (B, W-1, D)."""
    padded = torch.cat([tail, x], dim=1)  # (B, W-1+T, D)
    if window is None:
        out = conv(padded.transpose(1, 2)).transpose(1, 2)  # (B, T, D)
    else:
        inputs = padded.unfold(1, conv.kernel_size[0], 1) * window.unsqueeze(2)  # (B, T, D, W)
        out = (inputs * conv.weight.squeeze(1)).sum(-1)  # (B, T, D): conv1d's sum, term by term
    return F.silu(out), padded[:, padded.shape[1] - tail.shape[1]:]


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def forget_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                lower_bound: float | None) -> torch.Tensor:
    """The per-channel log decay g (B, T, H, K), in fp32, from the forget gate's projection f (B, T, H*K):
    Kimi Linear's -exp(A_log) * softplus(f + dt_bias), in (-inf, 0); with a lower bound lb (K3, fla's
    lower-bounded gate) lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0). A_log (H,): one rate per head."""
    B, T, _ = f.shape
    H = A_log.shape[0]
    shifted = f.float() + dt_bias.float()  # (B, T, H*K)
    if lower_bound is None:
        dt = F.softplus(shifted).view(B, T, H, -1)  # (B, T, H, K)
        return -A_log.float().exp().view(H, 1) * dt
    return lower_bound * torch.sigmoid(A_log.float().exp().view(H, 1) * shifted.view(B, T, H, -1))  # (B, T, H, K)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = H = cfg.n_heads
        self.head_dim = K = cfg.kda.head_dim  # d_k = d_v
        self.conv_kernel = W = cfg.kda.conv_kernel
        self.chunk_size = cfg.kda.chunk_size
        self.kernel_impl = cfg.kernel_impl  # fla-core's fused chunk kernel on CUDA unless "torch"
        self.scale = K ** -0.5

        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)  # delta-rule strength beta, per head

        # Per-channel decay g = forget_gate(f_proj(x), A_log, dt_bias, gate_lower_bound): low rank through K.
        self.f_proj = nn.Sequential(nn.Linear(d, K, bias=False), nn.Linear(K, H * K, bias=False))
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.gate_lower_bound = cfg.kda.gate_lower_bound

        # Output gate, low rank through K (or full rank), applied after a per-head RMSNorm shared by all heads.
        bias = cfg.kda.output_gate_bias
        if cfg.kda.full_rank_output_gate:
            self.g_proj = nn.Linear(d, H * K, bias=bias)
        else:
            self.g_proj = nn.Sequential(nn.Linear(d, K, bias=False), nn.Linear(K, H * K, bias=bias))
        self.o_norm = RMSNorm(K, cfg.norm_eps, cfg.kernel_impl)
        self.o_proj = nn.Linear(H * K, d, bias=False)
        self.sequence_split: SequenceSplit | None = None

    def init_weights(self, stds: InitStds) -> None:
        """Projections from the input at the hidden std, o_proj at the output std; the short convolutions
        keep PyTorch's default (as fla's ShortConvolution); decay rates and time steps spread per head. Under
        a lower-bounded gate every head's rate starts at exp(0) = 1, as fla's safe_gate layer starts."""
        gates = list(self.g_proj) if isinstance(self.g_proj, nn.Sequential) else [self.g_proj]
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self.f_proj, *gates):
            nn.init.normal_(proj.weight, std=stds.hidden)
        if gates[-1].bias is not None:
            nn.init.zeros_(gates[-1].bias)
        nn.init.normal_(self.o_proj.weight, std=stds.output)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()
        with torch.no_grad():
            if self.gate_lower_bound is None:
                self.A_log.uniform_(A_MIN, A_MAX).log_()
            else:
                self.A_log.zero_()
            log_dt = torch.rand_like(self.dt_bias) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
            self.dt_bias.copy_(_inverse_softplus(log_dt.exp().clamp(min=DT_FLOOR)))

    def new_cache(self, batch: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KDACache:
        """Empty cache: zero conv history (the training path's left padding) and zero recurrent state."""
        H, K, W = self.n_heads, self.head_dim, self.conv_kernel
        tail = torch.zeros(batch, W - 1, H * K, device=device, dtype=dtype)
        return KDACache(conv_q=tail, conv_k=tail.clone(), conv_v=tail.clone(),
                        recurrent=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor, cache: KDACache | None = None,
                document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, d) -> (B, T, d). Without a cache: a whole sequence from scratch (training).
        With a cache: x holds the T >= 1 tokens that follow it, and the cache's fields are replaced
        by the ones after these tokens. document_starts (B, T) bool, training only: no token sees an
        earlier document."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        window = None
        split = self.sequence_split
        if split is not None and cache is not None:
            raise ValueError("KimiDeltaAttention: a sequence_split (context parallelism) trains whole slices; it "
                             "takes no decoding cache")
        if document_starts is not None:
            check_document_starts(document_starts, B, T, cache, "KimiDeltaAttention")
            previous = None
            if split is not None:  # the earlier tokens the convolution reads may be in other documents
                previous = split.previous_rows(document_starts.unsqueeze(-1).float(), self.conv_kernel - 1)
                previous = previous.squeeze(-1).bool()  # (B, W-1)
            window = same_document_window(document_starts, self.conv_kernel, previous)  # (B, T, W)
        projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))  # (B, T, H*K) each
        if cache is not None:
            tails = (cache.conv_q, cache.conv_k, cache.conv_v)
        elif split is not None:  # one exchange for the three convolutions' histories
            tails = split.previous_rows(torch.cat(projected, dim=-1), self.conv_kernel - 1).chunk(3, dim=-1)
        else:
            empty_tail = x.new_zeros(B, self.conv_kernel - 1, H * K)
            tails = (empty_tail, empty_tail, empty_tail)

        q, tail_q = _short_conv(self.q_conv1d, projected[0], tails[0], window)  # (B, T, H*K)
        k, tail_k = _short_conv(self.k_conv1d, projected[1], tails[1], window)  # (B, T, H*K)
        v, tail_v = _short_conv(self.v_conv1d, projected[2], tails[2], window)  # (B, T, H*K)
        q = F.normalize(q.view(B, T, H, K).float(), dim=-1, eps=1e-6)  # (B, T, H, K)
        k = F.normalize(k.view(B, T, H, K).float(), dim=-1, eps=1e-6)  # (B, T, H, K)
        v = v.view(B, T, H, K)  # (B, T, H, V)
        beta = torch.sigmoid(self.b_proj(x).float())  # (B, T, H)
        g = forget_gate(self.f_proj(x), self.A_log, self.dt_bias, self.gate_lower_bound)  # (B, T, H, K), log decay <= 0

        if split is not None:
            o = kda_chunk_from_unknown_start(q, k, v, g, beta, self.scale, self.chunk_size, split.start_state,
                                             impl=self.kernel_impl, resets=document_starts)
        elif cache is None:
            o, _ = kda_chunk(q, k, v, g, beta, self.scale, self.chunk_size, impl=self.kernel_impl,
                             resets=document_starts)
        elif T == 1:  # decode step: the plain recurrence, no chunk padding
            o, cache.recurrent = kda_recurrent(q, k, v, g, beta, self.scale, cache.recurrent, True)
        else:  # prefill continuing from the cached recurrent state
            o, cache.recurrent = kda_chunk(q, k, v, g, beta, self.scale, self.chunk_size, cache.recurrent, True,
                                           impl=self.kernel_impl)
        if cache is not None:
            cache.conv_q, cache.conv_k, cache.conv_v = tail_q, tail_k, tail_v
        o = o.to(x.dtype)  # (B, T, H, V)

        gate = torch.sigmoid(self.g_proj(x)).view(B, T, H, K)  # (B, T, H, V)
        o = (self.o_norm(o) * gate).reshape(B, T, H * K)  # (B, T, H*V)
        return self.o_proj(o)
