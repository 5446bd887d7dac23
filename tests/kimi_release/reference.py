"""A plain-torch fp32 forward of the released Kimi text models, from a release config.json dict and a state dict
keyed by the release tensor names (K3's MXFP4 experts already dequantised to `.weight`; read_checkpoint.py).

It follows the release modeling code: Kimi Linear's remote `modeling_kimi.py` (model_type kimi_linear, flat
config) and Kimi K3's remote `modeling_kimi_linear.py` (model_type kimi_k3, the LM under text_config), with
fla's KDA gate and recurrence as those call them. Where the two releases differ, each is followed:

- routing weights: Kimi Linear adds e_score_correction_bias in place to a view of the sigmoid scores, so the
  top-k weights are gathered from the biased scores; K3 adds it out of place and gathers the unbiased ones.
  Kimi Linear also always applies the group mask and fills masked experts with 0; K3 groups only when
  num_expert_group > topk_group and fills with -inf.
- A_log: Kimi Linear ships [1, 1, H, 1]; K3 ships [128] for 96 heads. fla's gate kernels read A_log[h] per
  head, so only the first H entries are used.

Speed is not a goal: the KDA recurrence is a loop over tokens, MoE a loop over experts, and greedy decoding
re-runs the whole forward for every new token (no cache)."""
import torch
import torch.nn.functional as F

# The release code builds q_a_layernorm and kv_a_layernorm as KimiRMSNorm(width) with the class default eps,
# not the config's rms_norm_eps (both releases); every other norm takes rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# fla's l2norm of q and k inside chunk_kda (use_qk_l2norm_in_kernel=True): x / sqrt(sum(x^2) + eps).
QK_L2NORM_EPS = 1e-6
# The top-k renormalisation's denominator: sum(w) + 1e-20.
RENORM_EPS = 1e-20
RELEASES = ("kimi_linear", "kimi_k3")


def release_of(config: dict) -> str:
    release = config.get("model_type")
    if release not in RELEASES:
        raise ValueError(f"model_type {release!r} is not a released Kimi text model; expected one of {RELEASES}")
    return release


def text_config(config: dict) -> dict:
    """The language model's config: K3 nests it under text_config, Kimi Linear is flat."""
    return config["text_config"] if release_of(config) == "kimi_k3" else config


def weight_prefix(config: dict) -> str:
    """What every text tensor's release name starts with (K3's LM sits under language_model.)."""
    return "language_model." if release_of(config) == "kimi_k3" else ""


def mixer_kinds(cfg: dict) -> list[str]:
    """'kda' or 'mla' for each decoder layer, from linear_attn_config's 1-based kda_layers / full_attn_layers."""
    linear = cfg["linear_attn_config"]
    kda, full = set(linear["kda_layers"]), set(linear["full_attn_layers"])
    kinds = []
    for one_based in range(1, cfg["num_hidden_layers"] + 1):
        if (one_based in kda) == (one_based in full):
            raise ValueError(f"layer {one_based} (1-based) must be in exactly one of kda_layers {sorted(kda)} "
                             f"and full_attn_layers {sorted(full)}")
        kinds.append("kda" if one_based in kda else "mla")
    return kinds


def is_moe_layer(cfg: dict, layer: int) -> bool:
    return (cfg.get("num_experts") is not None and layer >= cfg["first_k_dense_replace"]
            and layer % cfg.get("moe_layer_freq", 1) == 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def gated_activation(gate: torch.Tensor, up: torch.Tensor, cfg: dict) -> torch.Tensor:
    """SwiGLU for hidden_act silu; SiTU for situ: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)
    (beta defaults to 1 and the up transform is skipped when activation_situ_linear_beta is absent)."""
    if cfg["hidden_act"] == "silu":
        return F.silu(gate) * up
    if cfg["hidden_act"] == "situ":
        beta = cfg.get("activation_situ_beta") or 1.0
        linear_beta = cfg.get("activation_situ_linear_beta")
        if linear_beta is not None:
            up = linear_beta * torch.tanh(up / linear_beta)
        return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
    raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not one the releases use (silu, situ)")


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fla's ShortConvolution: a depthwise causal Conv1d (weight (C, 1, W), no bias; the last tap multiplies the
    current token), then SiLU. x: (B, T, C)."""
    width = weight.shape[-1]
    padded = F.pad(x, (0, 0, width - 1, 0))  # (B, T + W - 1, C)
    steps = x.shape[1]
    out = sum(weight[:, 0, tap] * padded[:, tap:tap + steps] for tap in range(width))
    return F.silu(out)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + QK_L2NORM_EPS)


def delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """KDA's recurrence, one token at a time (fla's naive_recurrent_kda): S <- diag(exp g_t) S, then
    S <- S + k_t (beta_t (v_t - S^T k_t))^T, o_t = S^T q_t. q, k, g: (B, T, H, K); v: (B, T, H, V); beta: (B, T, H)."""
    batch, steps, heads, key_dim = q.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
    outputs = []
    for t in range(steps):
        state = state * g[:, t].exp()[..., None]
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], error)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1)  # (B, T, H, V)


def kda_forget_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound) -> torch.Tensor:
    """The per-channel log decay from the raw low-rank gate f (B, T, H, K): Kimi Linear's
    -exp(A_log[h]) * softplus(f + dt_bias), or with K3's lower bound lb * sigmoid(exp(A_log[h]) * (f + dt_bias))."""
    heads, key_dim = f.shape[-2:]
    if a_log.numel() < heads:
        raise ValueError(f"A_log has {a_log.numel()} entries for {heads} heads")
    decay_rate = a_log.reshape(-1)[:heads].exp().view(heads, 1)  # (H, 1): per head, the first H entries
    f = f + dt_bias.view(heads, key_dim)
    if lower_bound is None:
        return -decay_rate * torch.logaddexp(f, torch.zeros_like(f))
    return lower_bound * torch.sigmoid(decay_rate * f)


def kda(x: torch.Tensor, w: dict, p: str, cfg: dict) -> torch.Tensor:
    linear_cfg = cfg["linear_attn_config"]
    heads, head_dim = linear_cfg["num_heads"], linear_cfg["head_dim"]
    batch, steps, _ = x.shape
    q, k, v = (causal_short_conv(linear(x, w[f"{p}{n}_proj.weight"]), w[f"{p}{n}_conv1d.weight"])
               .view(batch, steps, heads, head_dim) for n in "qkv")  # (B, T, H, K)
    f = linear(linear(x, w[f"{p}f_a_proj.weight"]), w[f"{p}f_b_proj.weight"]).view(batch, steps, heads, head_dim)
    g = kda_forget_gate(f, w[f"{p}A_log"], w[f"{p}dt_bias"], linear_cfg.get("gate_lower_bound"))
    beta = torch.sigmoid(linear(x, w[f"{p}b_proj.weight"]))  # (B, T, H)
    o = delta_rule(l2_normalise(q) * head_dim ** -0.5, l2_normalise(k), v, g, beta)
    if linear_cfg.get("use_full_rank_gate", False):
        gate = linear(x, w[f"{p}g_proj.weight"])
    else:
        gate = linear(linear(x, w[f"{p}g_a_proj.weight"]), w[f"{p}g_b_proj.weight"])
    o = rms_norm(o, w[f"{p}o_norm.weight"], cfg["rms_norm_eps"]) * torch.sigmoid(gate.view(batch, steps, heads, head_dim))
    return linear(o.reshape(batch, steps, heads * head_dim), w[f"{p}o_proj.weight"])


def mla(x: torch.Tensor, w: dict, p: str, cfg: dict) -> torch.Tensor:
    """MLA with NoPE: the 'rope' slice of q and the shared k_pe are used as they are, never rotated."""
    heads = cfg["num_attention_heads"]
    if cfg["num_key_value_heads"] != heads:
        raise ValueError(f"num_key_value_heads {cfg['num_key_value_heads']} != num_attention_heads {heads}")
    nope, rope, v_dim, rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    batch, steps, _ = x.shape
    if cfg.get("q_lora_rank") is not None:
        q_latent = rms_norm(linear(x, w[f"{p}q_a_proj.weight"]), w[f"{p}q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = linear(q_latent, w[f"{p}q_b_proj.weight"])
    else:
        q = linear(x, w[f"{p}q_proj.weight"])
    q = q.view(batch, steps, heads, nope + rope)
    latent, k_pe = linear(x, w[f"{p}kv_a_proj_with_mqa.weight"]).split([rank, rope], dim=-1)
    kv = linear(rms_norm(latent, w[f"{p}kv_a_layernorm.weight"], LATENT_NORM_EPS), w[f"{p}kv_b_proj.weight"])
    k_nope, v = kv.view(batch, steps, heads, nope + v_dim).split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(batch, steps, heads, rope)], dim=-1)  # (B, T, H, nope + rope)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (nope + rope) ** -0.5
    future = torch.ones(steps, steps, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, steps, heads * v_dim)
    if cfg.get("mla_use_output_gate", False):
        out = out * torch.sigmoid(linear(x, w[f"{p}g_proj.weight"]))  # gated by the layer's input, before o_proj
    return linear(out, w[f"{p}o_proj.weight"])


def dense_mlp(x: torch.Tensor, w: dict, p: str, cfg: dict) -> torch.Tensor:
    """KimiMLP: the dense layers and the shared experts."""
    return linear(gated_activation(linear(x, w[f"{p}gate_proj.weight"]), linear(x, w[f"{p}up_proj.weight"]), cfg),
                  w[f"{p}down_proj.weight"])


def routed_expert(x: torch.Tensor, w: dict, p: str, cfg: dict) -> torch.Tensor:
    return linear(gated_activation(linear(x, w[f"{p}w1.weight"]), linear(x, w[f"{p}w3.weight"]), cfg), w[f"{p}w2.weight"])


def group_masked(scores: torch.Tensor, groups: int, kept_groups: int, fill: float) -> torch.Tensor:
    """DeepSeek-V3's grouped choice: a group's score is the sum of its two best; experts outside the
    kept_groups best groups get `fill`."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, groups, experts // groups).topk(2, dim=-1).values.sum(-1)  # (N, G)
    kept = torch.zeros(tokens, groups, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(kept_groups, dim=-1).indices, True)
    kept = kept[:, :, None].expand(tokens, groups, experts // groups).reshape(tokens, experts)
    return scores.masked_fill(~kept, fill)


def route(x: torch.Tensor, w: dict, p: str, cfg: dict, release: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts (N, k) and their weights (N, k) for tokens x (N, d)."""
    logits = linear(x, w[f"{p}gate.weight"])
    activation = cfg["moe_router_activation_func"]
    if activation == "sigmoid":
        scores = torch.sigmoid(logits)
    elif activation == "softmax":
        scores = logits.softmax(dim=1)
    else:
        raise ValueError(f"moe_router_activation_func {activation!r}: expected sigmoid or softmax")
    biased = scores + w[f"{p}gate.e_score_correction_bias"]
    groups, kept_groups = cfg.get("num_expert_group", 1), cfg.get("topk_group", 1)
    if release == "kimi_linear":
        choice, weight_source = group_masked(biased, groups, kept_groups, 0.0), biased
    else:
        grouped = groups > 1 and groups > kept_groups
        choice = group_masked(biased, groups, kept_groups, float("-inf")) if grouped else biased
        weight_source = scores
    top_k = cfg["num_experts_per_token"]
    chosen = choice.topk(top_k, dim=-1).indices
    weights = weight_source.gather(1, chosen)
    if top_k > 1 and cfg["moe_renormalize"]:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return chosen, weights * cfg["routed_scaling_factor"]


def sparse_moe(x: torch.Tensor, w: dict, p: str, cfg: dict, release: str) -> torch.Tensor:
    """Routed experts (in the latent width when routed_expert_hidden_size is set: down-project, weighted top-k
    sum, optional latent RMSNorm, up-project) plus the shared experts on the unprojected input."""
    batch, steps, hidden = x.shape
    tokens = x.reshape(batch * steps, hidden)
    chosen, weights = route(tokens, w, p, cfg, release)
    latent = cfg.get("routed_expert_hidden_size") is not None
    expert_input = linear(tokens, w[f"{p}routed_expert_down_proj.weight"]) if latent else tokens
    routed = torch.zeros_like(expert_input)
    for expert in range(cfg["num_experts"]):
        rows, slots = torch.where(chosen == expert)
        if rows.numel():
            out = routed_expert(expert_input[rows], w, f"{p}experts.{expert}.", cfg)
            routed = routed.index_add(0, rows, out * weights[rows, slots, None])
    if latent:
        if cfg.get("latent_moe_use_norm", False):
            routed = rms_norm(routed, w[f"{p}routed_expert_norm.weight"], cfg["rms_norm_eps"])
        routed = linear(routed, w[f"{p}routed_expert_up_proj.weight"])
    out = routed.view(batch, steps, hidden)
    if cfg.get("num_shared_experts") is not None:
        out = out + dense_mlp(x, w, f"{p}shared_experts.", cfg)
    return out


def depth_read(sources: list[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """K3's AttnRes read: keys are the sources RMS-normed without a weight, scored against norm_weight * query,
    softmax over the sources, and the mix is over the raw sources."""
    values = torch.stack(sources, dim=-2)  # (B, T, S, d)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    probs = (keys * (norm_weight * query.reshape(-1))).sum(-1).softmax(-1)  # (B, T, S)
    return torch.einsum("bts,btsd->btd", probs, values)


class ReleaseReference:
    """logits(ids) and greedy(ids, n) of a released Kimi text model, in fp32 (or `dtype`: float64 tells rounding
    from a real difference)."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.release = release_of(config)
        self.cfg = text_config(config)
        prefix = weight_prefix(config)
        self.w = {name[len(prefix):]: tensor.to(dtype) for name, tensor in state.items() if name.startswith(prefix)}
        self.kinds = mixer_kinds(self.cfg)

    def token_mixer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        mixer = kda if self.kinds[layer] == "kda" else mla
        return mixer(x, self.w, f"model.layers.{layer}.self_attn.", self.cfg)

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if is_moe_layer(self.cfg, layer):
            return sparse_moe(x, self.w, f"model.layers.{layer}.block_sparse_moe.", self.cfg, self.release)
        return dense_mlp(x, self.w, f"model.layers.{layer}.mlp.", self.cfg)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w[f"{name}.weight"], self.cfg["rms_norm_eps"])

    def read(self, name: str, sources: list[torch.Tensor]) -> torch.Tensor:
        return depth_read(sources, self.w[f"{name}_norm.weight"], self.w[f"{name}_proj.weight"], self.cfg["rms_norm_eps"])

    def prenorm_stream(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            x = x + self.token_mixer(layer, self.norm(f"{p}input_layernorm", x))
            x = x + self.ffn(layer, self.norm(f"{p}post_attention_layernorm", x))
        return x

    def attn_res_stream(self, x: torch.Tensor) -> torch.Tensor:
        """Block AttnRes with attn_res_block_size decoder layers a block: a read before attention unless no block
        is sealed yet, a seal (of the partial sum the read just took) at the first layer of each block, a read
        before the MLP, and one final read. The embedding is the first sealed block."""
        block_size = self.cfg["attn_res_block_size"]
        sealed, partial = [], x
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            h = self.read(f"{p}self_attention_res", sealed + [partial]) if sealed else partial
            if layer % block_size == 0:
                sealed, partial = sealed + [partial], None
            attn = self.token_mixer(layer, self.norm(f"{p}input_layernorm", h))
            partial = attn if partial is None else partial + attn
            h = self.read(f"{p}mlp_res", sealed + [partial])
            partial = partial + self.ffn(layer, self.norm(f"{p}post_attention_layernorm", h))
        return self.read("model.output_attn_res", sealed + [partial])

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V)."""
        x = self.w["model.embed_tokens.weight"][ids]
        stream = self.prenorm_stream if self.cfg.get("attn_res_block_size") is None else self.attn_res_stream
        head = self.w["model.embed_tokens.weight" if self.cfg.get("tie_word_embeddings") else "lm_head.weight"]
        return linear(self.norm("model.norm", stream(x)), head)

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """The next new_tokens argmax tokens (B, new_tokens), re-running the full forward for each."""
        for _ in range(new_tokens):
            ids = torch.cat([ids, self.logits(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids[:, -new_tokens:]
