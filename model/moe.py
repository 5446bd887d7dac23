"""Sigmoid-routed mixture of experts with a shared expert and aux-loss-free load balancing (DeepSeek-V3 style).

Routing: scores = sigmoid(router(x)) in fp32. The top-k experts are picked on scores + expert_bias (among the
best groups' experts with grouped top-k), but the combine weights come from the unbiased scores of the
picked experts, so the bias steers load without changing what the chosen experts contribute (Kimi K3's
release; `bias_in_weights` takes them from the biased scores, as Kimi Linear's released code does). The
weights are renormalised to sum to 1 (`renormalize`), then scaled by routed_scaling_factor. The trainer
calls update_bias() once per optimizer step.

Experts: gated MLPs (SwiGLU, or K3's SiTU: model/mlp.py's GatedActivation) in d_model, or under LatentMoE
(`latent_dim`, Kimi K3) in a latent width between one down projection before the dispatch and one up
projection (after an optional RMSNorm) of the weighted sum.

Experts and host syncs (`expert_impl`, EXPERT_IMPLS). `loop`, the reference, runs one matmul chain per
expert and splits the rows by `counts.tolist()`: on a GPU that waits for the device once per MoE layer
(and under torch.compile it runs as one opaque op, since dynamo cannot trace the split). `grouped` runs
three grouped GEMMs (torch._grouped_mm) and `gather` batches each row with its expert's weights (decode
sizes only); both, like the routing and combine around them, take every shape from the input alone, so
a single-device forward and backward never wait. `auto` takes grouped for bf16 on CUDA, gather for at
most one row per expert, and the loop otherwise (the CPU's training path).

Expert parallelism (parallel/expert.py) genuinely needs the split sizes on the host for its
variable-size all-to-alls, so it waits in each MoE layer's forward before the dispatch and again before
the combine (its `.tolist()` calls and the regrouping's repeat_interleave; the backward reuses the
sizes); its local experts go through grouped_experts with auto, so they take the grouped path on CUDA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.init import InitStds
from model.mlp import GatedActivation, GatedMLP
from model.norms import RMSNorm


EXPERT_IMPLS = ("auto", "loop", "grouped", "gather")


def loop_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """The reference: one matmul chain per expert. `counts.tolist()` is a host sync on a GPU."""
    outputs = []
    for e, x_e in enumerate(torch.split(x_sorted, counts.tolist())):
        if x_e.shape[0] == 0:  # idle experts cost only op overhead (most of them while decoding)
            continue
        h = activation(x_e @ w_gate[e], x_e @ w_up[e])  # (n_e, inter)
        outputs.append(h @ w_down[e])  # (n_e, d)
    if not outputs:  # no rows: stay in the graph, so a caller's collectives run their backward too
        return x_sorted.narrow(-1, 0, w_down.shape[-1]) * 0
    return torch.cat(outputs)


# The custom ops take the activation as its fields (an op's arguments are tensors and plain values).
@torch.library.custom_op("attnres::expert_loop", mutates_args=())
def _expert_loop_op(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, kind: str, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The loop as one opaque op, for torch.compile: dynamo cannot trace `counts.tolist()` (a graph break,
    which in the decoder's layer loop drops the whole forward back to eager), but can call this."""
    return loop_experts(x_sorted, counts, w_gate, w_up, w_down, GatedActivation(kind, beta, linear_beta))


@_expert_loop_op.register_fake
def _(x_sorted, counts, w_gate, w_up, w_down, kind, beta, linear_beta):
    return x_sorted.new_empty(x_sorted.shape[0], w_down.shape[-1])


@torch.library.custom_op("attnres::expert_loop_backward", mutates_args=())
def _expert_loop_backward_op(grad: torch.Tensor, x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor,
                             w_up: torch.Tensor, w_down: torch.Tensor, kind: str, beta: float,
                             linear_beta: float | None) -> list[torch.Tensor]:
    """Gradients of the loop for the rows and the three weight stacks, recomputing each expert's forward
    (by hand: autograd does not record inside an op's kernel)."""
    activation = GatedActivation(kind, beta, linear_beta)
    d_x = torch.zeros_like(x_sorted)
    d_gate, d_up, d_down = torch.zeros_like(w_gate), torch.zeros_like(w_up), torch.zeros_like(w_down)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        x_e, g_e = x_sorted[start:start + n], grad[start:start + n]  # (n, d)
        d_h = g_e @ w_down[e].T  # (n, inter)
        h, d_a, d_b = activation.backward(x_e @ w_gate[e], x_e @ w_up[e], d_h)  # (n, inter) each
        d_down[e] = h.T @ g_e
        d_gate[e], d_up[e] = x_e.T @ d_a, x_e.T @ d_b
        d_x[start:start + n] = d_a @ w_gate[e].T + d_b @ w_up[e].T
        start += n
    return [d_x, d_gate, d_up, d_down]


@_expert_loop_backward_op.register_fake
def _(grad, x_sorted, counts, w_gate, w_up, w_down, kind, beta, linear_beta):
    return [torch.empty_like(t) for t in (x_sorted, w_gate, w_up, w_down)]


def _save_loop_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5:]


def _loop_backward(ctx, grad):
    x_sorted, counts, w_gate, w_up, w_down = ctx.saved_tensors
    d_x, d_gate, d_up, d_down = _expert_loop_backward_op(grad, x_sorted, counts, w_gate, w_up, w_down,
                                                         *ctx.activation)
    return d_x, None, d_gate, d_up, d_down, None, None, None


_expert_loop_op.register_autograd(_loop_backward, setup_context=_save_loop_inputs)


def compilable_loop_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                            w_down: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """The loop; under torch.compile as an opaque op (same numbers, no graph break)."""
    if torch.compiler.is_compiling():
        return _expert_loop_op(x_sorted, counts, w_gate, w_up, w_down, activation.kind, activation.beta,
                               activation.linear_beta)
    return loop_experts(x_sorted, counts, w_gate, w_up, w_down, activation)


def gather_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """The loop's contract with each row's expert weights gathered and batched: no host sync and no
    data-dependent shape, so a compiled decode step stays one graph. It copies a weight set per row,
    so it suits decode-sized inputs only (auto takes it for at most one row per expert)."""
    rows = x_sorted.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                            output_size=rows)  # (rows,); output_size: no host sync
    x = x_sorted.unsqueeze(1)  # (rows, 1, d)
    h = activation(x @ w_gate[expert_of_row], x @ w_up[expert_of_row])  # (rows, 1, inter)
    return (h @ w_down[expert_of_row]).squeeze(1)  # (rows, d)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on (as the loop's matmuls would), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _row_alignment(dtype: torch.dtype) -> int:
    """Rows per group (and elements per row) the grouped GEMM needs: 16 bytes, for the TMA loads of its
    kernels; the weight gradient contracts over each expert's rows, so its group sizes must align too."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def grouped_mm_refusal(x_sorted: torch.Tensor, w_down: torch.Tensor) -> str | None:
    """Why the grouped GEMM cannot run these shapes (None when it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"expert_impl=grouped needs torch._grouped_mm (torch >= 2.8), not torch {torch.__version__}"
    align = _row_alignment(_compute_dtype(x_sorted))
    d, inter = w_down.shape[-1], w_down.shape[-2]
    if d % align or inter % align:
        return (f"expert_impl=grouped needs the experts' width ({d}: model.moe.latent_dim if set, else d_model) and "
                f"moe_inter ({inter}) to be multiples of {align} (16 bytes of {_compute_dtype(x_sorted)}); use "
                "expert_impl=loop")
    return None


def padded_rows(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Place each expert's rows at a start that is a multiple of `align`, on the device (no host sync).
    counts (E,) summing to `rows` -> destination of each row (rows,), group end offsets (E,) int32, and
    the padded row count: a bound fixed by the shapes alone, rows + E * align rounded up to align. The last
    group ends there, so the slack past the real rows is zero rows of the last expert, never unset memory."""
    n_experts = counts.shape[0]
    padded_total = -(-rows // align) * align + n_experts * align
    padded_counts = (counts + align - 1) // align * align  # (E,)
    ends, padded_ends = counts.cumsum(0), padded_counts.cumsum(0)  # (E,)
    shift = (padded_ends - padded_counts) - (ends - counts)  # (E,) how far each group moves down
    expert_of_row = torch.repeat_interleave(torch.arange(n_experts, device=counts.device), counts,
                                            output_size=rows)  # (rows,); output_size: no host sync
    destination = torch.arange(rows, device=counts.device) + shift[expert_of_row]  # (rows,)
    offsets = padded_ends.to(torch.int32)
    offsets[-1] = padded_total
    return destination, offsets, padded_total


def grouped_mm_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """The loop's contract with three grouped GEMMs (torch._grouped_mm) and no host sync: every shape
    follows from x_sorted's, so the CPU can queue the next layer while the GPU works."""
    refusal = grouped_mm_refusal(x_sorted, w_down)
    if refusal is not None:
        raise ValueError(refusal)
    dtype = _compute_dtype(x_sorted)
    rows, d = x_sorted.shape
    destination, offsets, padded_total = padded_rows(counts, rows, _row_alignment(dtype))
    x_padded = x_sorted.new_zeros(padded_total, d, dtype=dtype).index_copy(0, destination, x_sorted.to(dtype))
    gate = torch._grouped_mm(x_padded, w_gate.to(dtype), offsets)  # (padded, inter)
    up = torch._grouped_mm(x_padded, w_up.to(dtype), offsets)  # (padded, inter)
    y_padded = torch._grouped_mm(activation(gate, up), w_down.to(dtype), offsets)  # (padded, d)
    return y_padded.index_select(0, destination)  # (rows, d)


def choose_expert_impl(impl: str, x_sorted: torch.Tensor, w_down: torch.Tensor) -> str:
    """auto: the grouped GEMM for bf16 CUDA work (its only fast kernel, sm80+) with aligned shapes; else
    gather for decode-sized inputs (at most one row per expert) and the loop for the rest."""
    if impl in ("loop", "grouped", "gather"):
        return impl
    if impl != "auto":
        raise ValueError(f"expert_impl={impl!r} is not one of {' | '.join(EXPERT_IMPLS)}")
    if (x_sorted.is_cuda and _compute_dtype(x_sorted) == torch.bfloat16
            and torch.cuda.get_device_capability(x_sorted.device) >= (8, 0)
            and grouped_mm_refusal(x_sorted, w_down) is None):
        return "grouped"
    return "gather" if x_sorted.shape[0] <= w_down.shape[0] else "loop"


EXPERT_PATHS = {"loop": compilable_loop_experts, "grouped": grouped_mm_experts, "gather": gather_experts}


def grouped_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, impl: str = "auto",
                    activation: GatedActivation = GatedActivation()) -> torch.Tensor:
    """Gated-MLP experts over rows grouped by expert: rows (M, w) with counts (E,) summing to M and weight
    stacks (E, w, inter), (E, w, inter), (E, inter, w) -> (M, w), w the experts' width (d_model, or LatentMoE's
    latent_dim). impl: one of EXPERT_IMPLS."""
    path = EXPERT_PATHS[choose_expert_impl(impl, x_sorted, w_down)]
    return path(x_sorted, counts, w_gate, w_up, w_down, activation)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_impl: str = "auto"):
        super().__init__()
        moe = cfg.moe
        # loop | grouped | auto (grouped GEMM for bf16 on CUDA, the loop elsewhere): see grouped_experts.
        self.expert_impl = expert_impl
        self.n_experts = moe.n_routed_experts
        self.top_k = moe.top_k
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.renormalize = moe.renormalize
        self.bias_in_weights = moe.bias_in_weights
        self.n_expert_groups, self.topk_groups = moe.n_expert_groups, moe.topk_groups
        self.bias_update_rate = moe.bias_update_rate
        self.aux_loss_coef = moe.aux_loss_coef
        self.activation = GatedActivation.of(moe)

        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        # Steered by update_bias, not by the optimizer; persistent so a resumed run keeps its balance.
        self.register_buffer("expert_bias", torch.empty(self.n_experts))
        # Token-expert assignments since the last update_bias; a per-step statistic, not state.
        # Integer, so casting the model to bf16 cannot round the counts.
        self.register_buffer("load_counts", torch.zeros(self.n_experts, dtype=torch.long), persistent=False)

        # LatentMoE: the routed experts run in latent_dim, between one projection down and one up (and an
        # optional RMSNorm of the latent sum); the router and the shared experts read the full x.
        width = cfg.d_model if moe.latent_dim is None else moe.latent_dim
        self.routed_expert_down_proj = self.routed_expert_norm = self.routed_expert_up_proj = None
        if moe.latent_dim is not None:
            self.routed_expert_down_proj = nn.Linear(cfg.d_model, width, bias=False)
            if moe.latent_norm:
                self.routed_expert_norm = RMSNorm(width, cfg.norm_eps, cfg.kernel_impl)
            self.routed_expert_up_proj = nn.Linear(width, cfg.d_model, bias=False)

        self.w_gate = nn.Parameter(torch.empty(self.n_experts, width, moe.moe_inter))
        self.w_up = nn.Parameter(torch.empty(self.n_experts, width, moe.moe_inter))
        self.w_down = nn.Parameter(torch.empty(self.n_experts, moe.moe_inter, width))

        self.shared = (GatedMLP(cfg.d_model, moe.n_shared_experts * moe.moe_inter, self.activation)
                       if moe.n_shared_experts > 0 else None)
        # Sequence-wise balance loss of the last forward; the model adds it to the LM loss.
        self.aux_loss = torch.zeros(())

    def init_weights(self, stds: InitStds) -> None:
        """The shared expert and the latent norm initialise themselves. What writes to the residual stream
        takes the output std: the routed experts' down stack, or under LatentMoE the up projection (the
        experts' down stack then writes to the latent, an inner projection)."""
        nn.init.normal_(self.router.weight, std=stds.hidden)
        nn.init.normal_(self.w_gate, std=stds.hidden)
        nn.init.normal_(self.w_up, std=stds.hidden)
        latent = self.routed_expert_up_proj is not None
        nn.init.normal_(self.w_down, std=stds.hidden if latent else stds.output)
        if latent:
            nn.init.normal_(self.routed_expert_down_proj.weight, std=stds.hidden)
            nn.init.normal_(self.routed_expert_up_proj.weight, std=stds.output)
        nn.init.zeros_(self.expert_bias)
        self.load_counts.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, d) -> expert ids (N, k), combine weights (N, k) fp32, scores (N, E) fp32."""
        # Autocast would put the router matmul in bf16; near-tied sigmoid scores then flip the top-k.
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))  # (N, E)
        biased = scores + self.expert_bias  # (N, E)
        expert_ids = torch.topk(self.limit_to_groups(biased), self.top_k, dim=-1).indices  # (N, k)
        weights = (biased if self.bias_in_weights else scores).gather(-1, expert_ids)  # (N, k)
        if self.renormalize:
            # The release's 1e-20 cannot move a sum above 2^-42 (it is below half an fp32 ulp there).
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return expert_ids, weights, scores

    def limit_to_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Grouped top-k (DeepSeek-V3, Kimi's n_group / topk_group): the experts are n_expert_groups
        consecutive groups; a group scores the sum of its two best biased scores, and only the topk_groups
        best groups' experts stay eligible (the others' scores become -inf). (N, E) -> (N, E)."""
        if self.topk_groups >= self.n_expert_groups:
            return biased
        N, E = biased.shape
        grouped = biased.view(N, self.n_expert_groups, E // self.n_expert_groups)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        kept = torch.topk(group_scores, self.topk_groups, dim=-1).indices  # (N, topk_groups)
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
        return grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view(N, E)  # (N, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_flat = x.reshape(B * T, d)  # (N, d)
        expert_ids, weights, scores = self.route(x_flat)
        # The rows the routed experts read: x, or its latent (N, latent_dim), projected before the dispatch so
        # that expert parallelism's all-to-alls carry the latent width.
        routed_in = x_flat if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x_flat)

        # Sort the N*k assignments by expert so every expert sees one contiguous slice of tokens.
        flat_ids = expert_ids.reshape(-1)  # (N*k,)
        order = torch.argsort(flat_ids, stable=True)  # (N*k,)
        token_of = order // self.top_k  # (N*k,) source token of each sorted assignment
        # Not bincount: on CUDA it reads the largest id back to the host to size its output.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids))  # (E,)
        x_sorted = routed_in[token_of]  # (N*k, w)

        y_sorted = self.run_experts(x_sorted, counts) * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)  # (N*k, w)
        # Summed in y_sorted's dtype, the stream's (fp32 under autocast, as the release sums in fp32), even
        # where LatentMoE's rows came out of its down projection in bf16.
        y = y_sorted.new_zeros(routed_in.shape[0], y_sorted.shape[-1]).index_add_(0, token_of, y_sorted)  # (N, w)
        if self.routed_expert_up_proj is not None:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)  # (N, d)

        if self.shared is not None:
            y = y + self.shared(x_flat)
        if self.training:
            self.load_counts += counts
        self.aux_loss = self._sequence_balance_loss(expert_ids, scores, B, T)
        return y.view(B, T, d)

    def run_experts(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Assignments sorted by expert (N*k, w), counts (E,) per expert -> expert outputs (N*k, w), w the
        experts' width. The seam expert parallelism replaces: it sends each slice to the rank that holds its
        expert."""
        return grouped_experts(x_sorted, counts, self.w_gate, self.w_up, self.w_down, self.expert_impl,
                               self.activation)

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
        prob_sums = (scores / scores.sum(-1, keepdim=True)).view(B, T, E).sum(1)  # (B, E)
        routed, prob_sums, tokens = self.sequence_totals(routed, prob_sums, T)
        f = routed * (E / (self.top_k * tokens))  # (B, E)
        return self.aux_loss_coef * (f * prob_sums / tokens).sum(-1).mean()

    def sequence_totals(self, routed: torch.Tensor, prob_sums: torch.Tensor,
                        tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per-sequence sums over the tokens this forward saw -> over the whole sequence: here the same.
        The seam sequence parallelism replaces: each rank then routes a slice of every sequence."""
        return routed, prob_sums, tokens

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
