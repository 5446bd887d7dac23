"""Sigmoid-routed mixture of experts with a shared expert and aux-loss-free load balancing (DeepSeek-V3 style).

Routing: scores = sigmoid(router(x)) in fp32. The top-k experts are picked on scores + expert_bias, but the
combine weights come from the unbiased scores of the picked experts, so the bias steers load without
changing what the chosen experts contribute. The trainer calls update_bias() once per optimizer step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.init import InitStds
from model.mlp import SwiGLU


def grouped_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: rows (M, d) with counts (E,) summing to M and weight
    stacks (E, d, inter), (E, d, inter), (E, inter, d) -> (M, d)."""
    outputs = []
    for e, x_e in enumerate(torch.split(x_sorted, counts.tolist())):
        if x_e.shape[0] == 0:  # idle experts cost only op overhead (most of them while decoding)
            continue
        h = F.silu(x_e @ w_gate[e]) * (x_e @ w_up[e])  # (n_e, inter)
        outputs.append(h @ w_down[e])  # (n_e, d)
    if not outputs:  # no rows: stay in the graph, so a caller's collectives run their backward too
        return x_sorted.narrow(-1, 0, w_down.shape[-1]) * 0
    return torch.cat(outputs)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.n_experts = moe.n_routed_experts
        self.top_k = moe.top_k
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.bias_update_rate = moe.bias_update_rate
        self.aux_loss_coef = moe.aux_loss_coef

        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        # Steered by update_bias, not by the optimizer; persistent so a resumed run keeps its balance.
        self.register_buffer("expert_bias", torch.empty(self.n_experts))
        # Token-expert assignments since the last update_bias; a per-step statistic, not state.
        # Integer, so casting the model to bf16 cannot round the counts.
        self.register_buffer("load_counts", torch.zeros(self.n_experts, dtype=torch.long), persistent=False)

        self.w_gate = nn.Parameter(torch.empty(self.n_experts, cfg.d_model, moe.moe_inter))
        self.w_up = nn.Parameter(torch.empty(self.n_experts, cfg.d_model, moe.moe_inter))
        self.w_down = nn.Parameter(torch.empty(self.n_experts, moe.moe_inter, cfg.d_model))

        self.shared = SwiGLU(cfg.d_model, moe.n_shared_experts * moe.moe_inter) if moe.n_shared_experts > 0 else None
        # Sequence-wise balance loss of the last forward; the model adds it to the LM loss.
        self.aux_loss = torch.zeros(())

    def init_weights(self, stds: InitStds) -> None:
        """The shared expert initialises itself (a SwiGLU); the routed experts' down stack writes to the
        residual stream, so it takes the output std."""
        nn.init.normal_(self.router.weight, std=stds.hidden)
        nn.init.normal_(self.w_gate, std=stds.hidden)
        nn.init.normal_(self.w_up, std=stds.hidden)
        nn.init.normal_(self.w_down, std=stds.output)
        nn.init.zeros_(self.expert_bias)
        self.load_counts.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, d) -> expert ids (N, k), combine weights (N, k) fp32, scores (N, E) fp32."""
        # Autocast would put the router matmul in bf16; near-tied sigmoid scores then flip the top-k.
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))  # (N, E)
        expert_ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, expert_ids)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scaling_factor
        return expert_ids, weights, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_flat = x.reshape(B * T, d)  # (N, d)
        expert_ids, weights, scores = self.route(x_flat)

        # Sort the N*k assignments by expert so every expert sees one contiguous slice of tokens.
        flat_ids = expert_ids.reshape(-1)  # (N*k,)
        order = torch.argsort(flat_ids, stable=True)  # (N*k,)
        token_of = order // self.top_k  # (N*k,) source token of each sorted assignment
        counts = torch.bincount(flat_ids, minlength=self.n_experts)  # (E,)
        x_sorted = x_flat[token_of]  # (N*k, d)

        y_sorted = self.run_experts(x_sorted, counts) * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)  # (N*k, d)
        y = torch.zeros_like(x_flat).index_add_(0, token_of, y_sorted)  # (N, d)

        if self.shared is not None:
            y = y + self.shared(x_flat)
        if self.training:
            self.load_counts += counts
        self.aux_loss = self._sequence_balance_loss(expert_ids, scores, B, T)
        return y.view(B, T, d)

    def run_experts(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Assignments sorted by expert (N*k, d), counts (E,) per expert -> expert outputs (N*k, d).
        The seam expert parallelism replaces: it sends each slice to the rank that holds its expert."""
        return grouped_swiglu(x_sorted, counts, self.w_gate, self.w_up, self.w_down)

    def _sequence_balance_loss(self, expert_ids: torch.Tensor, scores: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """DeepSeek-V3 complementary sequence-wise balance loss, per sequence then averaged over the batch:
        coef * sum_e f_e * P_e, with f_e = E / (k T) * (tokens of the sequence routed to e) and
        P_e = mean over the sequence of s_e / sum_j s_j (scores normalised over all experts).
        f is a count (no gradient); the gradient reaches the router through P. Uniform load gives coef * 1."""
        if self.aux_loss_coef == 0:
            return scores.new_zeros(())
        E = self.n_experts
        ids = expert_ids.view(B, T * self.top_k)  # (B, T*k)
        routed = torch.zeros(B, E, device=scores.device)
        routed.scatter_add_(1, ids, torch.ones_like(ids, dtype=routed.dtype))  # (B, E) assignments per sequence
        f = routed * (E / (self.top_k * T))  # (B, E)
        probs = (scores / scores.sum(-1, keepdim=True)).view(B, T, E)  # (B, T, E)
        return self.aux_loss_coef * (f * probs.mean(1)).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Raise the bias of underloaded experts and lower it for overloaded ones, then reset the counts.
        With no counted tokens every sign is 0, so this is a no-op."""
        load = self.load_counts.float()
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load_counts.zero_()

    def load_fraction(self) -> torch.Tensor:
        """(E,) share of the token-expert assignments since the last update_bias."""
        return self.load_counts.float() / self.load_counts.sum().clamp_min(1)

    def load_imbalance(self) -> float:
        """max load / mean load since the last update_bias; 1.0 (balanced) when nothing was counted."""
        load = self.load_counts.float()
        if load.sum() == 0:
            return 1.0
        return (load.max() / load.mean()).item()
