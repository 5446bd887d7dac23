"""The released Kimi models' config.json onto our ModelConfig, and back.

Two layouts: Kimi Linear (`model_type: kimi_linear`, the decoder's keys at the top level) and Kimi K3
(`model_type: kimi_k3`, the decoder's keys under `text_config`, a vision tower beside it that we skip).
Every key of the decoder's config is either mapped (DECODER_KEYS), or one of transformers' generic keys
that change nothing we compute (GENERIC_KEYS); a key outside both, or a value we cannot express, is
refused in one line naming it, before anything is built.

Semantics we hold fixed and check: NoPE MLA (`mla_use_nope`), a sigmoid router with renormalised top-k
weights, one MoE every layer after the first `first_k_dense_replace`, no MTP layers, untied head, and
Block AttnRes with K3's read (learned query, softmax, key norm, one head) when `attn_res_block_size` is
set (counted in decoder layers; our block_size counts sublayers, twice as many).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig
from model.residual.geometry import DepthGeometry

KIMI_LINEAR = "kimi_linear"
KIMI_K3 = "kimi_k3"
LAYOUTS = (KIMI_LINEAR, KIMI_K3)
# What a release's decoder config may hold that changes nothing we compute: transformers' generic
# PretrainedConfig and generation keys, token ids, the remote code's class names, and keys its code reads
# but never uses for the decoder (head_dim: KDA and MLA read their own dims; rope_*: NoPE).
GENERIC_KEYS = frozenset({
    "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "add_cross_attention",
    "architectures", "auto_map", "bad_words_ids", "begin_suppress_tokens", "bos_token_id",
    "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty",
    "do_sample", "dtype", "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
    "head_dim", "id2label", "initializer_range", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores", "pad_token_id",
    "prefix", "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "rope_scaling", "rope_theta", "sep_token_id", "suppress_tokens",
    "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k",
    "top_p", "torch_dtype", "torchscript", "transformers_version", "typical_p", "use_bfloat16", "use_cache",
})
# K3's top level around text_config: the vision tower and the multimodal placeholders we skip.
K3_OUTER_KEYS = frozenset({"text_config", "vision_config", "media_placeholder_token_id", "image_placeholder",
                           "ignore_index", "quantization_config"}) | GENERIC_KEYS | {"model_type",
                                                                                   "tie_word_embeddings"}
DECODER_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "max_position_embeddings",
    "model_max_length", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_nope", "mla_use_output_gate", "num_experts", "num_experts_per_token", "moe_intermediate_size",
    "num_shared_experts", "routed_scaling_factor", "moe_renormalize", "moe_router_activation_func",
    "first_k_dense_replace", "moe_layer_freq", "use_grouped_topk", "num_expert_group", "topk_group", "topk_method",
    "num_nextn_predict_layers", "linear_attn_config", "attn_res_block_size", "quantization_config",
    "routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta", "activation_situ_linear_beta",
})
LINEAR_ATTN_KEYS = frozenset({"kda_layers", "full_attn_layers", "head_dim", "num_heads", "short_conv_kernel_size",
                              "use_full_rank_gate", "gate_lower_bound"})
# A key whose only value we can express: (key, that value, the value when the key is absent, what it means).
FIXED_VALUES = (
    ("tie_word_embeddings", False, False, "a separate lm_head"),
    ("mla_use_nope", True, False, "MLA without rotary embeddings"),
    ("moe_router_activation_func", "sigmoid", "sigmoid", "sigmoid router scores"),
    ("moe_layer_freq", 1, 1, "an MoE in every layer after the dense ones"),
    ("topk_method", "noaux_tc", "noaux_tc", "top-k on the bias-corrected scores"),
    ("num_nextn_predict_layers", 0, 0, "no MTP layers"),
)
ACTIVATIONS = {"silu": "swiglu", "situ": "situ"}
# The latent norms' eps in the release's HF code: q_a_layernorm and kv_a_layernorm are built with its RMSNorm
# class's default, not rms_norm_eps (both releases).
RELEASE_LATENT_NORM_EPS = 1e-6


class ReleaseConfigError(ValueError):
    """A release config.json we cannot express; the message is one line."""


@dataclass(frozen=True)
class ReleaseConfig:
    """What a release directory's config.json says: the model we build, the layout its files use, and the
    few values beside the model (context, token ids, quantisation)."""
    model: ModelConfig
    layout: str                        # KIMI_LINEAR (flat) or KIMI_K3 (text_config, language_model.*)
    context: int | None                # max_position_embeddings
    token_ids: dict[str, int | None]   # bos_token_id, eos_token_id, pad_token_id
    quantization: dict | None          # K3's compressed-tensors quantization_config

    @property
    def prefix(self) -> str:
        """The prefix of every decoder tensor name in the release's safetensors."""
        return "language_model." if self.layout == KIMI_K3 else ""


def _refuse_unknown(config: dict, allowed: frozenset, where: str) -> None:
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ReleaseConfigError(f"{where} has key {unknown[0]!r}, which this importer does not know; it may "
                                 "change what the model computes, so the checkpoint is refused")


def decoder_config(release: dict, where: str) -> dict:
    """The decoder's own keys: the top level of a Kimi Linear config, K3's text_config."""
    if not isinstance(release, dict):
        raise ReleaseConfigError(f"{where} is not a JSON object")
    model_type = release.get("model_type")
    if model_type == KIMI_LINEAR:
        return release
    if model_type == KIMI_K3:
        _refuse_unknown(release, K3_OUTER_KEYS, where)
        text = release.get("text_config")
        if not isinstance(text, dict) or text.get("model_type") != KIMI_LINEAR:
            raise ReleaseConfigError(f"{where}: text_config is not a kimi_linear config")
        return text
    raise ReleaseConfigError(f"{where} has model_type={model_type!r}; a Kimi release is one of {', '.join(LAYOUTS)}")


def _mla_placement(mla_layers: list[int], n_layers: int) -> dict:
    """Our mla_every rule (every k-th layer and the last) when it gives the release's 0-based MLA layers, else
    the explicit list (model.mla_layers)."""
    every = mla_layers[0] + 1 if mla_layers else n_layers + 1
    built = [layer for layer in range(n_layers) if layer == n_layers - 1 or (layer + 1) % every == 0]
    return {"mla_every": every} if built == mla_layers else {"mla_layers": mla_layers}


def _moe(text: dict, model_type: str, where: str) -> MoEConfig:
    top_k, groups = text["num_experts_per_token"], text.get("num_expert_group", 1)
    if model_type == KIMI_LINEAR and groups > 1:
        raise ReleaseConfigError(f"{where}: num_expert_group={groups}; Kimi Linear's code scores the experts of "
                                 "groups it drops 0 (not -inf), which this model does not build")
    activation = text.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ReleaseConfigError(f"{where}: hidden_act={activation!r} is not one of {', '.join(ACTIVATIONS)}")
    situ = {}
    if activation == "situ":  # the release code's defaults when a beta is absent: 1, and no bound on up
        situ = dict(situ_beta=float(text.get("activation_situ_beta") or 1.0),
                    situ_linear_beta=text.get("activation_situ_linear_beta"))
    return MoEConfig(
        n_routed_experts=text["num_experts"], top_k=top_k, moe_inter=text["moe_intermediate_size"],
        n_shared_experts=text.get("num_shared_experts") or 0,  # null: the release builds none
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        # The release renormalises only a top-k of 2 or more.
        renormalize=bool(text.get("moe_renormalize", True)) and top_k > 1,
        # Kimi Linear's code adds the bias in place to the scores it then gathers the weights from; K3's does not.
        bias_in_weights=model_type == KIMI_LINEAR,
        n_expert_groups=groups, topk_groups=text.get("topk_group", 1),
        activation=ACTIVATIONS[activation], **situ,
        latent_dim=text.get("routed_expert_hidden_size"),
        latent_norm=bool(text.get("latent_moe_use_norm", False)) and text.get("routed_expert_hidden_size") is not None,
    )


def release_config(release: dict, where: str) -> ReleaseConfig:
    """config.json of a release directory (`where` names it in errors) -> ReleaseConfig, or one line."""
    text = decoder_config(release, where)
    model_type = release["model_type"]
    _refuse_unknown(text, DECODER_KEYS | GENERIC_KEYS, where)
    linear = text.get("linear_attn_config")
    if not isinstance(linear, dict):
        raise ReleaseConfigError(f"{where} has no linear_attn_config; a Kimi Linear decoder needs one")
    _refuse_unknown(linear, LINEAR_ATTN_KEYS, f"{where}'s linear_attn_config")
    for key, value, absent, meaning in FIXED_VALUES:
        found = text.get(key, absent)
        if found != value:
            raise ReleaseConfigError(f"{where}: {key}={found!r} is not supported; this model builds only "
                                     f"{key}={value!r} ({meaning})")
    heads = text["num_attention_heads"]
    for key, found in (("num_key_value_heads", text.get("num_key_value_heads")),
                       ("linear_attn_config.num_heads", linear.get("num_heads"))):
        if found not in (None, heads):
            raise ReleaseConfigError(f"{where}: {key}={found} differs from num_attention_heads={heads}; this model "
                                     "gives KDA and MLA the same heads, without grouping")
    n_layers = text["num_hidden_layers"]
    kda_layers = sorted(linear.get("kda_layers") or [])
    mla_layers = sorted(layer - 1 for layer in linear.get("full_attn_layers") or [])
    if sorted([layer - 1 for layer in kda_layers] + mla_layers) != list(range(n_layers)):
        raise ReleaseConfigError(f"{where}: linear_attn_config's kda_layers and full_attn_layers do not cover "
                                 f"layers 1..{n_layers} once each")
    block = text.get("attn_res_block_size")
    residual = (ResidualConfig(kind="baseline") if block is None else
                ResidualConfig(kind="block", block_size=2 * block, query="learned", kernel="softmax",
                               key_norm=True, heads=1))
    model = ModelConfig(
        vocab_size=text["vocab_size"], d_model=text["hidden_size"], n_blocks=n_layers, n_heads=heads,
        dense_inter=text["intermediate_size"], n_dense_layers=text.get("first_k_dense_replace", 0),
        **_mla_placement(mla_layers, n_layers), norm_eps=text["rms_norm_eps"],
        kda=KDAConfig(head_dim=linear["head_dim"], conv_kernel=linear.get("short_conv_kernel_size", 4),
                      gate_lower_bound=linear.get("gate_lower_bound"),
                      full_rank_output_gate=bool(linear.get("use_full_rank_gate", False)), output_gate_bias=False),
        mla=MLAConfig(kv_lora_rank=text["kv_lora_rank"], qk_nope_head_dim=text["qk_nope_head_dim"],
                      qk_rope_head_dim=text["qk_rope_head_dim"], v_head_dim=text["v_head_dim"],
                      q_lora_rank=text.get("q_lora_rank"), output_gate=bool(text.get("mla_use_output_gate", False)),
                      latent_norm_eps=RELEASE_LATENT_NORM_EPS),
        moe=_moe(text, model_type, where),
        residual=residual,
    )
    outer = release if model_type == KIMI_K3 else text
    token_ids = {key: outer.get(key, text.get(key)) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    context = text.get("max_position_embeddings", text.get("model_max_length"))
    quantization = text.get("quantization_config", release.get("quantization_config"))
    return ReleaseConfig(model, model_type, context, token_ids, quantization)


# -- back: our model in the release's config.json -------------------------------------------------------------

def k3_block_size(model: ModelConfig) -> int | None:
    """attn_res_block_size (decoder layers per depth block) of a model K3's config can hold: the baseline
    (None) or Block with K3's read; anything else is refused in one line."""
    r = model.residual
    if r.kind == "baseline":
        return None
    if r.kind != "block":
        raise ReleaseConfigError(f"variant.kind={r.kind} cannot be written in the Kimi format, which holds the "
                                 "baseline and Block AttnRes with K3's read only")
    k3_read = dict(query="learned", kernel="softmax", key_norm=True, mixing="attention", heads=1, window=None)
    for key, value in k3_read.items():
        if getattr(r, key) != value:
            raise ReleaseConfigError(f"variant.{key}={getattr(r, key)} cannot be written in the Kimi format: K3's "
                                     f"AttnRes read has variant.{key}={value}")
    size = DepthGeometry.of(model).size
    if size % 2:
        raise ReleaseConfigError(f"variant.block_size={size} is odd; the Kimi format counts AttnRes blocks in whole "
                                 "decoder layers (two sublayers each), so block_size must be even")
    return size // 2


def export_layout(model: ModelConfig) -> str:
    """The release layout that computes what `model` does: K3's for Block AttnRes, Kimi Linear's for the
    baseline. Their routers differ (Kimi Linear's code gathers the weights from the biased scores), so the
    router must be the layout's: checked here against model.moe.bias_in_weights."""
    layout = KIMI_LINEAR if k3_block_size(model) is None else KIMI_K3
    moe = model.moe
    if moe.bias_in_weights != (layout == KIMI_LINEAR):
        kind = "the baseline" if layout == KIMI_LINEAR else "Block AttnRes"
        raise ReleaseConfigError(f"model.moe.bias_in_weights={moe.bias_in_weights} cannot be written as {kind}: "
                                 f"the {layout} release's router {'takes' if layout == KIMI_LINEAR else 'does not take'}"
                                 " its weights from the biased scores")
    if layout == KIMI_LINEAR and moe.n_expert_groups > 1:
        raise ReleaseConfigError(f"model.moe.n_expert_groups={moe.n_expert_groups} cannot be written as Kimi Linear, "
                                 "whose code scores dropped groups' experts 0 instead of -inf")
    if moe.top_k == 1 and moe.renormalize:
        raise ReleaseConfigError("model.moe.top_k=1 with model.moe.renormalize=true cannot be written in the Kimi "
                                 "format: the release renormalises only a top-k of 2 or more")
    return layout


def release_json(model: ModelConfig, context: int, token_ids: dict[str, int | None]) -> dict:
    """The config.json of our model in the release format (export_layout's): Kimi Linear's flat config, or K3's
    (the same decoder keys under text_config, no vision tower)."""
    layout = export_layout(model)
    layers = range(1, model.n_blocks + 1)
    mla, moe, kda = model.mla, model.moe, model.kda
    text = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": KIMI_LINEAR,
        "vocab_size": model.vocab_size, "hidden_size": model.d_model, "num_hidden_layers": model.n_blocks,
        "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_heads,
        "intermediate_size": model.dense_inter, "rms_norm_eps": model.norm_eps,
        "hidden_act": "situ" if moe.activation == "situ" else "silu",
        "tie_word_embeddings": False, "max_position_embeddings": context,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": mla.output_gate,
        "num_experts": moe.n_routed_experts, "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.moe_inter, "num_shared_experts": moe.n_shared_experts,
        "routed_scaling_factor": moe.routed_scaling_factor, "moe_renormalize": moe.renormalize,
        "moe_router_activation_func": "sigmoid", "first_k_dense_replace": model.n_dense_layers, "moe_layer_freq": 1,
        "use_grouped_topk": True, "num_expert_group": moe.n_expert_groups, "topk_group": moe.topk_groups,
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [layer for layer in layers if not model.is_mla(layer - 1)],
            "full_attn_layers": [layer for layer in layers if model.is_mla(layer - 1)],
            "head_dim": kda.head_dim, "num_heads": model.n_heads, "short_conv_kernel_size": kda.conv_kernel,
            "use_full_rank_gate": kda.full_rank_output_gate, "gate_lower_bound": kda.gate_lower_bound,
        },
        **token_ids,
    }
    if moe.activation == "situ":
        text.update(activation_situ_beta=moe.situ_beta, activation_situ_linear_beta=moe.situ_linear_beta)
    if moe.latent_dim is not None:
        text.update(routed_expert_hidden_size=moe.latent_dim, latent_moe_use_norm=moe.latent_norm)
    if layout == KIMI_LINEAR:
        return text
    text["attn_res_block_size"] = k3_block_size(model)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": KIMI_K3, "text_config": text,
            "tie_word_embeddings": False, **token_ids}


def function_differences(ours: ModelConfig, release: ModelConfig) -> list[str]:
    """The settings (as command-line overrides) where `ours` computes another function than the release's model,
    ignoring the residual mixer (a retrofit adds one) and what only changes how it trains or runs."""
    ignored = {"init", "init_std", "kernel_impl", "residual", "chunk_size", "bias_update_rate", "aux_loss_coef",
               "mla_every", "mla_layers"}

    def differs(a, b, prefix: str) -> list[str]:
        found = []
        for field in dataclasses.fields(a):
            left, right = getattr(a, field.name), getattr(b, field.name)
            if field.name in ignored:
                continue
            if dataclasses.is_dataclass(left):
                found += differs(left, right, f"{prefix}{field.name}.")
            elif left != right:
                found.append(f"{prefix}{field.name}={right}")
        return found

    if release.moe.activation != "situ":  # SiTU's betas change nothing under SwiGLU
        ignored |= {"situ_beta", "situ_linear_beta"}
    found = differs(ours, release, "model.")
    mla_blocks = [block for block in range(release.n_blocks) if release.is_mla(block)]
    if [block for block in range(ours.n_blocks) if ours.is_mla(block)] != mla_blocks:
        found.append(f"model.mla_layers={mla_blocks}")
    return found
