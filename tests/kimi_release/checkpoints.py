"""Writers of tiny checkpoints in the two release layouts, for import tests: config.json with the releases' real
keys and nesting, sharded safetensors read through model.safetensors.index.json, a tokenizer, and stand-ins for
the release's Python files that raise if anything imports them (an importer must never run release code).

- write_kimi_linear: model_type kimi_linear, flat config, every tensor bf16 except A_log [1, 1, H, 1] and
  dt_bias in fp32 (as the real Kimi-Linear-48B-A3B header lists them), tokenizer.json by default.
- write_kimi_k3: model_type kimi_k3, the LM under text_config (with its quantization_config) beside a small
  vision_config; text tensors under language_model., plus vision_tower.* / mm_projector.* tensors an importer
  must skip; routed experts w1/w2/w3 as MXFP4 weight_packed/weight_scale through compressed-tensors; A_log
  shipped as [head_dim] for fewer heads with a zero tail (like K3's [128] for 96 heads); fp32 for A_log,
  dt_bias, the short convs, o_norm and the score-correction bias (one audit of the real header; the public
  accounts conflict) and for the AttnRes norms and pseudo-queries (our choice: not found in public code);
  tiktoken.model by default.

Weights are random from a fixed seed, scaled so that every option moves the logits: the MLA latents are small
enough that the latent norms' eps (1e-6 in the release code, 1e-5 in the config) shows, the MLP inputs large
enough that SiTU's tanh bounds show, AttnRes queries nonzero, layer 0's unused attention read random (the
release never reads it), and the correction bias positive and large enough to change choices."""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import mxfp4
from .reference import is_moe_layer, mixer_kinds, text_config
from .tokenizer_files import BOS_ID, EOS_ID, NUM_BASE, PAD_ID, VOCAB_SIZE, write_tiktoken_files, write_tokenizer_json

EXPERT_WEIGHT = re.compile(r".*\.experts\.\d+\.w[123]\.weight$")
# The stored dtype is bf16 except for names ending in one of these.
FP32_SUFFIXES = {
    "kimi_linear": ("A_log", "dt_bias"),
    "kimi_k3": ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias", "_res_norm.weight",
                "_res_proj.weight"),
}
# Entries of an MXFP4 scale are 2^e for e in this range: expert weights of RMS about 0.2 to 0.7.
EXPERT_EXPONENTS = range(-4, -1)
RELEASE_CODE = {
    "kimi_linear": ("configuration_kimi.py", "modeling_kimi.py", "tokenization_kimi.py"),
    "kimi_k3": ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py", "tokenization_kimi.py"),
}
SHARDS = 3


@dataclass
class ReleaseCheckpoint:
    directory: Path
    config: dict
    state: dict[str, torch.Tensor]  # what the files hold, in fp32, by release name (experts dequantised to .weight)


def kimi_linear_config() -> dict:
    linear = {"full_attn_layers": [3, 5], "head_dim": 16, "kda_layers": [1, 2, 4], "num_heads": 2,
              "short_conv_kernel_size": 4}
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig", "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": BOS_ID, "dtype": "bfloat16", "eos_token_id": EOS_ID, "first_k_dense_replace": 1,
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "kv_lora_rank": 16, "linear_attn_config": linear, "mla_use_nope": True, "model_max_length": 1048576,
        "model_type": "kimi_linear", "moe_intermediate_size": 32, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_attention_heads": 2, "num_expert_group": 1, "num_experts": 8,
        "num_experts_per_token": 2, "num_hidden_layers": 5, "num_key_value_heads": 2, "num_nextn_predict_layers": 0,
        "num_shared_experts": 1, "pad_token_id": PAD_ID, "q_lora_rank": None, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
        "transformers_version": "4.57.1", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 8,
        "vocab_size": VOCAB_SIZE,
    }


def kimi_k3_text_config() -> dict:
    """K3's text_config keys, every one of them (the transformers PretrainedConfig fields it was saved with
    included), with tiny values."""
    linear = {"full_attn_layers": [2, 5], "gate_lower_bound": -5.0, "head_dim": 16, "kda_layers": [1, 3, 4, 6],
              "num_heads": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": True}
    saved_defaults = {
        "_name_or_path": "", "add_cross_attention": False, "bad_words_ids": None, "begin_suppress_tokens": None,
        "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None, "decoder_start_token_id": None,
        "diversity_penalty": 0.0, "do_sample": False, "early_stopping": False, "encoder_no_repeat_ngram_size": 0,
        "exponential_decay_length_penalty": None, "finetuning_task": None, "forced_bos_token_id": None,
        "forced_eos_token_id": None, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "is_decoder": False,
        "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "length_penalty": 1.0,
        "max_length": 20, "min_length": 0, "no_repeat_ngram_size": 0, "num_beam_groups": 1, "num_beams": 1,
        "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False, "output_scores": False,
        "prefix": None, "problem_type": None, "pruned_heads": {}, "remove_invalid_values": False,
        "repetition_penalty": 1.0, "return_dict": True, "return_dict_in_generate": False, "sep_token_id": None,
        "suppress_tokens": None, "task_specific_params": None, "temperature": 1.0, "tf_legacy_loss": False,
        "tie_encoder_decoder": False, "tokenizer_class": None, "top_k": 50, "top_p": 1.0, "torchscript": False,
        "typical_p": 1.0, "use_bfloat16": False,
    }
    return {
        **saved_defaults,
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": 2,
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                     "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
        "bos_token_id": BOS_ID, "dtype": "bfloat16", "eos_token_id": EOS_ID, "first_k_dense_replace": 2,
        "hidden_act": "situ", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "kv_lora_rank": 16, "latent_moe_use_norm": True, "linear_attn_config": linear,
        "max_position_embeddings": 1048576, "mla_use_nope": True, "mla_use_output_gate": True,
        "model_type": "kimi_linear", "moe_intermediate_size": 32, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_attention_heads": 4, "num_expert_group": 2, "num_experts": 16,
        "num_experts_per_token": 4, "num_hidden_layers": 6, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
        "num_shared_experts": 2, "pad_token_id": PAD_ID, "q_lora_rank": 24, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "quantization_config": mxfp4.quantization_config(), "rms_norm_eps": 1e-5,
        "routed_expert_hidden_size": 32, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "transformers_version": "4.56.2", "use_cache": True, "use_grouped_topk": True,
        "v_head_dim": 8, "vocab_size": VOCAB_SIZE,
    }


def kimi_k3_vision_config() -> dict:
    return {
        "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
        "init_pos_emb_height": 4, "init_pos_emb_time": 2, "init_pos_emb_width": 4, "linear_bias": False,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 16,
        "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False, "patch_size": 2,
        "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05, "qkv_hidden_size": 48, "text_hidden_size": 64, "vt_hidden_size": 16,
        "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
    }


def kimi_k3_config() -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "bos_token_id": BOS_ID, "dtype": "bfloat16", "eos_token_id": EOS_ID, "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>", "media_placeholder_token_id": BOS_ID + 21,
        "model_type": "kimi_k3", "pad_token_id": PAD_ID, "text_config": kimi_k3_text_config(),
        "tie_word_embeddings": False, "vision_config": kimi_k3_vision_config(),
    }


def kda_shapes(cfg: dict, release: str) -> dict[str, tuple]:
    linear = cfg["linear_attn_config"]
    d, heads, head_dim = cfg["hidden_size"], linear["num_heads"], linear["head_dim"]
    width = linear["short_conv_kernel_size"]
    proj = heads * head_dim
    shapes = {f"{n}_proj.weight": (proj, d) for n in "qkv"}
    shapes |= {f"{n}_conv1d.weight": (proj, 1, width) for n in "qkv"}
    shapes |= {"f_a_proj.weight": (head_dim, d), "f_b_proj.weight": (proj, head_dim), "b_proj.weight": (heads, d)}
    if linear.get("use_full_rank_gate", False):
        shapes["g_proj.weight"] = (proj, d)
    else:
        shapes |= {"g_a_proj.weight": (head_dim, d), "g_b_proj.weight": (proj, head_dim)}
    shapes["A_log"] = (head_dim,) if release == "kimi_k3" else (1, 1, heads, 1)
    return shapes | {"dt_bias": (proj,), "o_norm.weight": (head_dim,), "o_proj.weight": (d, proj)}


def mla_shapes(cfg: dict) -> dict[str, tuple]:
    d, heads, rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    q_head, rope, v_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if cfg.get("q_lora_rank") is not None:
        q_rank = cfg["q_lora_rank"]
        shapes = {"q_a_proj.weight": (q_rank, d), "q_a_layernorm.weight": (q_rank,),
                  "q_b_proj.weight": (heads * q_head, q_rank)}
    else:
        shapes = {"q_proj.weight": (heads * q_head, d)}
    shapes |= {"kv_a_proj_with_mqa.weight": (rank + rope, d), "kv_a_layernorm.weight": (rank,),
               "kv_b_proj.weight": (heads * (q_head - rope + v_dim), rank)}
    if cfg.get("mla_use_output_gate", False):
        shapes["g_proj.weight"] = (heads * v_dim, d)
    return shapes | {"o_proj.weight": (d, heads * v_dim)}


def mlp_shapes(d: int, width: int) -> dict[str, tuple]:
    return {"gate_proj.weight": (width, d), "up_proj.weight": (width, d), "down_proj.weight": (d, width)}


def moe_shapes(cfg: dict) -> dict[str, tuple]:
    d, experts, width = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    expert_d = cfg.get("routed_expert_hidden_size") or d
    shapes = {"gate.weight": (experts, d), "gate.e_score_correction_bias": (experts,)}
    for e in range(experts):
        shapes |= {f"experts.{e}.w1.weight": (width, expert_d), f"experts.{e}.w2.weight": (expert_d, width),
                   f"experts.{e}.w3.weight": (width, expert_d)}
    if cfg.get("routed_expert_hidden_size") is not None:
        shapes |= {"routed_expert_down_proj.weight": (expert_d, d), "routed_expert_up_proj.weight": (d, expert_d)}
        if cfg.get("latent_moe_use_norm", False):
            shapes["routed_expert_norm.weight"] = (expert_d,)
    if cfg.get("num_shared_experts") is not None:  # the release builds no shared experts for null
        shapes |= {f"shared_experts.{n}": s for n, s in mlp_shapes(d, width * cfg["num_shared_experts"]).items()}
    return shapes


def text_shapes(cfg: dict, release: str) -> dict[str, tuple]:
    """Every text tensor's release name (without the language_model. prefix) and shape, in checkpoint order."""
    d, attn_res = cfg["hidden_size"], cfg.get("attn_res_block_size") is not None
    res_shapes = {"_res_norm.weight": (d,), "_res_proj.weight": (1, d)}
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for layer, kind in enumerate(mixer_kinds(cfg)):
        p = f"model.layers.{layer}."
        shapes |= {f"{p}input_layernorm.weight": (d,), f"{p}post_attention_layernorm.weight": (d,)}
        if attn_res:
            shapes |= {f"{p}{site}{suffix}": s for site in ("self_attention", "mlp") for suffix, s in res_shapes.items()}
        mixer = kda_shapes(cfg, release) if kind == "kda" else mla_shapes(cfg)
        shapes |= {f"{p}self_attn.{n}": s for n, s in mixer.items()}
        if is_moe_layer(cfg, layer):
            shapes |= {f"{p}block_sparse_moe.{n}": s for n, s in moe_shapes(cfg).items()}
        else:
            shapes |= {f"{p}mlp.{n}": s for n, s in mlp_shapes(d, cfg["intermediate_size"]).items()}
    shapes["model.norm.weight"] = (d,)
    if attn_res:
        shapes |= {f"model.output_attn{suffix}": s for suffix, s in res_shapes.items()}
    return shapes | {"lm_head.weight": (cfg["vocab_size"], d)}


def vision_shapes(vision: dict) -> dict[str, tuple]:
    width, inner, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = width * math.prod(vision["merge_kernel_size"])
    shapes = {"vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
              "vision_tower.patch_embed.pos_emb.weight":
                  (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width)}
    for block in range(vision["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{block}."
        shapes |= {f"{p}norm0.weight": (width,), f"{p}norm1.weight": (width,),
                   f"{p}wqkv.weight": (vision["qkv_hidden_size"], width), f"{p}wo.weight": (width, width),
                   f"{p}mlp.fc0.weight": (inner, width), f"{p}mlp.fc1.weight": (width, inner)}
    return shapes | {"vision_tower.encoder.final_layernorm.weight": (width,),
                     "mm_projector.proj.0.weight": (merged, merged),
                     "mm_projector.proj.2.weight": (vision["text_hidden_size"], merged),
                     "mm_projector.post_norm.weight": (vision["text_hidden_size"],)}


def initial_value(name: str, shape: tuple, cfg: dict, release: str, generator: torch.Generator) -> torch.Tensor:
    randn = lambda *size: torch.randn(size or shape, generator=generator)  # noqa: E731
    uniform = lambda low, high, *size: low + (high - low) * torch.rand(size or shape, generator=generator)  # noqa: E731
    if name.endswith("A_log"):
        heads = cfg["linear_attn_config"]["num_heads"]
        # Kimi Linear's init range for A = exp(A_log); K3's lower-bounded gate saturates with it, so a narrower one.
        per_head = uniform(1.0, 16.0, heads).log() if release == "kimi_linear" else uniform(0.5, 2.0, heads).log()
        return torch.cat([per_head, torch.zeros(math.prod(shape) - heads)]).view(shape)  # K3: a zero tail
    if name.endswith("dt_bias"):
        # Kimi Linear: softplus^-1 of dt log-uniform in [1e-3, 1e-1] (fla's init); K3: around 0, where the sigmoid bites.
        if release == "kimi_linear":
            dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
            return dt + torch.log(-torch.expm1(-dt))
        return randn()
    if name.endswith("e_score_correction_bias"):
        return uniform(0.0, 0.3)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * randn()
    if name.endswith("_res_proj.weight"):
        return 1.5 * randn() / math.sqrt(shape[-1])
    if name.endswith("conv1d.weight"):
        return 0.5 * randn()
    if name.endswith("embed_tokens.weight"):
        return randn()
    gain = {"gate.weight": 2.0, "q_a_proj.weight": 0.03}.get(name.rsplit(".", 2)[-2] + ".weight", 1.0)
    value = gain * randn() / math.sqrt(math.prod(shape[1:]))
    if name.endswith("kv_a_proj_with_mqa.weight"):
        value[:cfg["kv_lora_rank"]] *= 0.03  # the latent rows; the shared k_pe rows keep unit gain
    if name.endswith("lm_head.weight"):
        value[NUM_BASE:] *= 0.25  # special tokens seldom win, so that greedy decoding writes text
    return value


def stored_tensors(cfg: dict, release: str, generator: torch.Generator) -> tuple[dict, dict]:
    """(the tensors as the files hold them, keyed by file name; the fp32 values they stand for, keyed by the
    logical release name)."""
    prefix = "language_model." if release == "kimi_k3" else ""
    files, logical = {}, {}
    for name, shape in text_shapes(cfg, release).items():
        full = prefix + name
        if release == "kimi_k3" and EXPERT_WEIGHT.match(name):
            weight, scale = mxfp4.random_exact_weight(shape, EXPERT_EXPONENTS, generator)
            packed = mxfp4.compress(weight.to(torch.bfloat16), scale.to(torch.bfloat16), cfg["quantization_config"])
            files |= {full[:-len("weight")] + suffix: tensor for suffix, tensor in packed.items()}
            logical[full] = weight
            continue
        dtype = torch.float32 if name.endswith(FP32_SUFFIXES[release]) else torch.bfloat16
        files[full] = initial_value(name, shape, cfg, release, generator).to(dtype).contiguous()
        logical[full] = files[full].float()
    return files, logical


def write_shards(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """Consecutive runs of tensors of about equal bytes into model-0000k-of-0000n.safetensors, and the index."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total, before, weight_map = sum(sizes.values()), 0, {}
    for name, size in sizes.items():
        shard = min(shards - 1, before * shards // total)
        weight_map[name] = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        before += size
    for file in sorted(set(weight_map.values())):
        shard = {name: tensors[name] for name, owner in weight_map.items() if owner == file}
        save_file(shard, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_release_code_stand_ins(directory: Path, release: str) -> None:
    for file in RELEASE_CODE[release]:
        (directory / file).write_text(f'raise RuntimeError("{file}: the release\'s Python code must never run")\n')


def write_tokenizer(directory: Path, release: str, tokenizer: str) -> None:
    if tokenizer == "tiktoken":
        write_tiktoken_files(directory, release)
    elif tokenizer == "json":
        write_tokenizer_json(directory, release)
    else:
        raise ValueError(f"tokenizer={tokenizer!r}: expected 'tiktoken' or 'json'")


def write_checkpoint(directory: Path, config: dict, seed: int, tokenizer: str) -> ReleaseCheckpoint:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    release, cfg = config["model_type"], text_config(config)
    generator = torch.Generator().manual_seed(seed)
    files, logical = stored_tensors(cfg, release, generator)
    if release == "kimi_k3":
        files |= {name: (0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
                  for name, shape in vision_shapes(config["vision_config"]).items()}
    write_shards(directory, files, SHARDS)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, release, tokenizer)
    write_release_code_stand_ins(directory, release)
    return ReleaseCheckpoint(directory, config, logical)


def write_kimi_linear(directory: Path, seed: int = 0, tokenizer: str = "json") -> ReleaseCheckpoint:
    return write_checkpoint(directory, kimi_linear_config(), seed, tokenizer)


def write_kimi_k3(directory: Path, seed: int = 0, tokenizer: str = "tiktoken") -> ReleaseCheckpoint:
    return write_checkpoint(directory, kimi_k3_config(), seed, tokenizer)
