"""The release reference checked against closed forms and the release formats, and the tiny checkpoints against
what they were written to hold, so that import tests can trust both."""
import copy
import json
import runpy

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kimi_release import mxfp4, reference
from kimi_release.checkpoints import write_kimi_k3, write_kimi_linear
from kimi_release.read_checkpoint import read_release_checkpoint
from kimi_release.reference import ReleaseReference
from kimi_release.tokenizer_files import BOS_ID, EOS_ID, NUM_BASE, release_encoding

PROMPT = torch.tensor([[BOS_ID, 5, 120, 33, 260, 71, 9, 200], [BOS_ID, 77, 3, 281, 14, 150, 99, 41]])


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    return write_kimi_linear(tmp_path_factory.mktemp("kimi_linear"))


@pytest.fixture(scope="module")
def kimi_k3(tmp_path_factory):
    return write_kimi_k3(tmp_path_factory.mktemp("kimi_k3"))


@pytest.fixture(scope="module", params=["kimi_linear", "kimi_k3"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def test_delta_rule_matches_its_closed_form_over_two_tokens():
    torch.manual_seed(0)
    q, k, g = torch.randn(3, 1, 2, 2, 4).unbind(0)  # each (B=1, T=2, H=2, K=4)
    g = -g.abs()
    v, beta = torch.randn(1, 2, 2, 3), torch.rand(1, 2, 2)
    out = reference.delta_rule(q, k, v, g, beta)
    # Token 0 from the empty state: beta0 (q0 . k0) v0.
    first = beta[:, 0, :, None] * (q[:, 0] * k[:, 0]).sum(-1, keepdim=True) * v[:, 0]
    # Token 1: the decayed state answers k1 with beta0 ((k1 * e^g1) . k0) v0; the error writes beta1 k1 err^T.
    decay = g[:, 1].exp()
    recalled = beta[:, 0, :, None] * ((k[:, 1] * decay) * k[:, 0]).sum(-1, keepdim=True) * v[:, 0]
    error = v[:, 1] - recalled
    second = (beta[:, 0, :, None] * ((q[:, 1] * decay) * k[:, 0]).sum(-1, keepdim=True) * v[:, 0]
              + beta[:, 1, :, None] * (q[:, 1] * k[:, 1]).sum(-1, keepdim=True) * error)
    torch.testing.assert_close(out[:, 0], first, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, 1], second, rtol=1e-6, atol=1e-6)


def test_kda_gates_against_their_formulas():
    f, dt_bias = torch.tensor([[[[0.3, -1.2], [2.0, 0.1]]]]), torch.tensor([0.5, 0.0, -0.25, 1.0])  # (1, 1, H=2, K=2)
    a_log = torch.tensor([0.0, 0.7, 9.0, 9.0])  # K3 ships more entries than heads: only the first H are read
    unbounded = reference.kda_forget_gate(f, a_log[:2].view(1, 1, 2, 1), dt_bias, None)
    bounded = reference.kda_forget_gate(f, a_log, dt_bias, -5.0)
    x = f + dt_bias.view(2, 2)
    rate = torch.tensor([[1.0], [2.0137527]])  # exp(0), exp(0.7)
    torch.testing.assert_close(unbounded, -rate * torch.log1p(torch.exp(x)))
    torch.testing.assert_close(bounded, -5.0 * torch.sigmoid(rate * x))
    assert bounded.min() > -5.0 and bounded.max() < 0


def test_situ_against_its_formula_and_its_swiglu_limit():
    gate, up = torch.tensor([-3.0, -0.5, 0.0, 1.0, 6.0]), torch.tensor([40.0, -2.0, 1.0, 0.5, -30.0])
    situ = {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}
    expected = [4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25) for g, u in zip(gate, up)]
    torch.testing.assert_close(reference.gated_activation(gate, up, situ), torch.stack(expected))
    limit = {"hidden_act": "situ", "activation_situ_beta": 1e6, "activation_situ_linear_beta": None}
    torch.testing.assert_close(reference.gated_activation(gate, up, limit), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_mxfp4_round_trip_through_compressed_tensors_is_exact():
    block = mxfp4.quantization_config()
    weight, scale = mxfp4.random_exact_weight((6, 64), range(-5, 2), torch.Generator().manual_seed(0))
    packed = mxfp4.compress(weight.to(torch.bfloat16), scale.to(torch.bfloat16), block)
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_packed"].shape == (6, 32)
    assert packed["weight_scale"].dtype == torch.uint8 and packed["weight_scale"].shape == (6, 2)
    torch.testing.assert_close(packed["weight_scale"].long(), scale.log2().long() + 127, rtol=0, atol=0)
    assert torch.equal(mxfp4.decompress(packed["weight_packed"], packed["weight_scale"], block).float(), weight)


def test_mxfp4_packs_the_even_column_in_the_low_nibble():
    """Codes: sign 0x8 | index into (0, .5, 1, 1.5, 2, 3, 4, 6); columns (0.5, -1) -> 0x1 | 0xA << 4 = 0xA1."""
    weight = torch.zeros(1, 32)
    weight[0, :2] = torch.tensor([0.5, -1.0])
    packed = mxfp4.compress(weight.to(torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16), mxfp4.quantization_config())
    assert packed["weight_packed"][0, 0].item() == 0xA1 and packed["weight_scale"].item() == 127


def test_mla_on_one_token_returns_each_heads_value_gated_by_the_input():
    """One token attends only to itself, so each head outputs its own v: kv_b_proj's rows per head are
    [k_nope | v], and K3's gate multiplies by sigmoid(g_proj(x)) before o_proj."""
    torch.manual_seed(0)
    cfg = {"num_attention_heads": 2, "num_key_value_heads": 2, "qk_nope_head_dim": 3, "qk_rope_head_dim": 2,
           "v_head_dim": 4, "kv_lora_rank": 5, "q_lora_rank": None, "mla_use_output_gate": True}
    w = {"q_proj.weight": torch.randn(10, 6), "kv_a_proj_with_mqa.weight": torch.randn(7, 6),
         "kv_a_layernorm.weight": torch.rand(5) + 0.5, "kv_b_proj.weight": torch.randn(14, 5),
         "g_proj.weight": torch.randn(8, 6), "o_proj.weight": torch.randn(6, 8)}
    x = torch.randn(1, 1, 6)
    latent = (x @ w["kv_a_proj_with_mqa.weight"].T)[..., :5]
    normed = latent / (latent.pow(2).mean() + 1e-6).sqrt() * w["kv_a_layernorm.weight"]
    per_head = (normed @ w["kv_b_proj.weight"].T).view(2, 7)  # (H, nope + v)
    v = per_head[:, 3:].reshape(1, 1, 8)
    expected = (v * torch.sigmoid(x @ w["g_proj.weight"].T)) @ w["o_proj.weight"].T
    torch.testing.assert_close(reference.mla(x, w, "", cfg), expected)


def test_a_read_with_a_zero_query_is_the_uniform_average():
    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 8) * scale for scale in (1.0, 5.0, 0.1)]
    out = reference.depth_read(sources, torch.randn(8), torch.zeros(1, 8), 1e-5)
    torch.testing.assert_close(out, sum(sources) / 3)
    sharp = reference.depth_read(sources[:2], torch.ones(8), 50 * sources[1][0, 0] / sources[1][0, 0].norm(), 1e-5)
    torch.testing.assert_close(sharp[0, 0], sources[1][0, 0], rtol=1e-4, atol=1e-4)  # the query picks its source


def test_attn_res_stream_follows_the_release_order():
    """Blocks of 2 layers over 3 layers, zero queries (every read the mean of its sources), sublayers that scale
    their input: a read before attention unless no block is sealed yet, a seal at the first layer of each block
    after that read, a read before the MLP, one final read."""
    d, layers = 4, 3
    res = {f"{site}_{part}.weight": torch.ones(d) if part == "res_norm" else torch.zeros(1, d)
           for site in ("self_attention", "mlp") for part in ("res_norm", "res_proj")}
    state = {f"language_model.model.layers.{i}.{name}": value for i in range(layers) for name, value in res.items()}
    state |= {"language_model.model.output_attn_res_norm.weight": torch.ones(d),
              "language_model.model.output_attn_res_proj.weight": torch.zeros(1, d),
              "language_model.model.embed_tokens.weight": torch.randn(3, d), "language_model.lm_head.weight": torch.eye(d),
              "language_model.model.norm.weight": torch.ones(d)}
    text = {"num_hidden_layers": layers, "attn_res_block_size": 2, "rms_norm_eps": 1e-5,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": []}}
    model = ReleaseReference({"model_type": "kimi_k3", "text_config": text}, state)
    attn_scale, mlp_scale = (2.0, -1.0, 0.5), (3.0, 0.25, -2.0)
    model.token_mixer = lambda layer, x: attn_scale[layer] * x
    model.ffn = lambda layer, x: mlp_scale[layer] * x
    model.norm = lambda name, x: x
    e = state["language_model.model.embed_tokens.weight"][torch.tensor([[1]])]  # (1, 1, d)
    mean = lambda *sources: sum(sources) / len(sources)  # noqa: E731
    a0 = 2.0 * e  # layer 0: nothing sealed, attention reads e; e is sealed
    p = a0 + 3.0 * mean(e, a0)
    a1 = -1.0 * mean(e, p)  # layer 1 reads [e, partial]
    p = p + a1
    p = p + 0.25 * mean(e, p)
    block = p
    a2 = 0.5 * mean(e, block)  # layer 2 reads [e, block 1], then seals block 1
    p = a2 + -2.0 * mean(e, block, a2)
    torch.testing.assert_close(model.logits(torch.tensor([[1]])), mean(e, block, p))


def test_routing_per_release():
    """Kimi Linear's weights come from the biased scores, K3's from the unbiased; both choose on the biased
    scores within the one best group (group score = its two best)."""
    cfg = {"moe_router_activation_func": "sigmoid", "num_expert_group": 2, "topk_group": 1,
           "num_experts_per_token": 2, "moe_renormalize": True, "routed_scaling_factor": 2.0}
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, 0.4, 0.3, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.3, 0.0, 0.0, 0.0])
    w = {"gate.weight": torch.eye(8), "gate.e_score_correction_bias": bias}
    scores = torch.sigmoid(logits[0])
    # biased: group 0 (0.5, 0.731, 1.169, 0.881) scores 2.05, group 1 (0.922, 0.599, 0.574, 0.119) 1.52: the
    # choice is 2 and 3 although expert 4 (0.922) beats expert 3 (0.881) ungrouped.
    for release, source in (("kimi_linear", scores + bias), ("kimi_k3", scores)):
        chosen, weights = reference.route(logits, w, "", cfg, release)
        assert sorted(chosen[0].tolist()) == [2, 3]
        expected = 2.0 * source[chosen[0]] / source[chosen[0]].sum()
        torch.testing.assert_close(weights[0], expected)


def test_layer_plan():
    cfg = {"num_hidden_layers": 4, "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]},
           "num_experts": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert reference.mixer_kinds(cfg) == ["kda", "kda", "mla", "kda"]
    assert [reference.is_moe_layer(cfg, i) for i in range(4)] == [False, False, True, False]
    cfg["linear_attn_config"]["full_attn_layers"] = [3, 4]
    with pytest.raises(ValueError, match="layer 4"):
        reference.mixer_kinds(cfg)


def test_a_checkpoint_reads_back_as_written_and_gives_finite_logits(checkpoint):
    config, state = read_release_checkpoint(checkpoint.directory)
    text = {name: tensor for name, tensor in state.items() if not name.startswith(("vision_tower.", "mm_projector."))}
    assert config == checkpoint.config and text.keys() == checkpoint.state.keys()
    assert all(torch.equal(text[name].float(), value) for name, value in checkpoint.state.items())
    logits = ReleaseReference(config, state).logits(PROMPT)
    assert logits.shape == (2, 8, config.get("text_config", config)["vocab_size"]) and logits.isfinite().all()
    assert logits.std() > 0.5  # not degenerate: the tokens are told apart


def test_the_k3_directory_holds_what_an_importer_must_cope_with(kimi_k3):
    """Shards through the index, experts only as uint8 MXFP4 pairs, latent projections plain although the
    quantization regexes would take them, vision tensors, A_log longer than the heads with a zero tail, fp32
    where chosen, and release code that raises if run."""
    index = json.loads((kimi_k3.directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    layer = "language_model.model.layers.3."
    expert = f"{layer}block_sparse_moe.experts.5.w2."
    assert f"{expert}weight_packed" in index and f"{expert}weight_scale" in index and f"{expert}weight" not in index
    assert f"{layer}block_sparse_moe.routed_expert_down_proj.weight" in index
    assert {name.split(".")[0] for name in index} == {"language_model", "vision_tower", "mm_projector"}
    with safe_open(str(kimi_k3.directory / index[f"{expert}weight_packed"]), framework="pt") as shard:
        assert shard.get_tensor(f"{expert}weight_packed").dtype == torch.uint8
    a_log = kimi_k3.state["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (16,) and a_log[4:].eq(0).all() and a_log[:4].ne(0).all()
    with safe_open(str(kimi_k3.directory / index[f"{layer}self_attn.A_log"]), framework="pt") as shard:
        assert shard.get_tensor(f"{layer}self_attn.A_log").dtype == torch.float32
    assert kimi_k3.config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with pytest.raises(RuntimeError, match="must never run"):
        runpy.run_path(str(kimi_k3.directory / "modeling_kimi_linear.py"))


def test_greedy_decoding_is_deterministic_and_follows_the_logits(kimi_k3):
    model = ReleaseReference(kimi_k3.config, kimi_k3.state)
    tokens = model.greedy(PROMPT, 4)
    assert torch.equal(tokens, model.greedy(PROMPT, 4))
    full = torch.cat([PROMPT, tokens], dim=1)
    assert torch.equal(model.logits(full)[:, PROMPT.shape[1] - 1:-1].argmax(-1), tokens)


def per_channel_gate(f, a_log, dt_bias, lower_bound):
    """The reading of K3's [128] A_log that two ports take: one decay rate per key channel, shared by the heads."""
    return lower_bound * torch.sigmoid(a_log.exp() * (f + dt_bias.view(f.shape[-2:])))


def original_route_as(release):
    route = reference.route
    return lambda x, w, p, cfg, _: route(x, w, p, cfg, release)


ALTERNATIVES = {  # a release detail -> (fixture, the module attribute to swap, its plausible wrong value)
    "latent norms at the config's eps": ("kimi_linear", "LATENT_NORM_EPS", lambda: 1e-5),
    "Kimi Linear weights from unbiased scores": ("kimi_linear", "route", lambda: original_route_as("kimi_k3")),
    "K3 weights from biased scores": ("kimi_k3", "route", lambda: original_route_as("kimi_linear")),
    "A_log per channel": ("kimi_k3", "kda_forget_gate", lambda: per_channel_gate),
    "SwiGLU for SiTU": ("kimi_k3", "gated_activation", lambda: lambda gate, up, cfg: F.silu(gate) * up),
}


@pytest.mark.parametrize("alternative", [*ALTERNATIVES, "one AttnRes block"])
def test_each_release_detail_moves_the_logits(alternative, kimi_linear, kimi_k3, monkeypatch):
    """The fixtures tell each release detail from its plausible alternative by far more than the import
    tolerance, so an import that gets one wrong fails its logits check."""
    release = "kimi_k3" if alternative == "one AttnRes block" else ALTERNATIVES[alternative][0]
    fixture = {"kimi_linear": kimi_linear, "kimi_k3": kimi_k3}[release]
    before = ReleaseReference(fixture.config, fixture.state).logits(PROMPT)
    config = copy.deepcopy(fixture.config)
    if alternative == "one AttnRes block":
        config["text_config"]["attn_res_block_size"] = config["text_config"]["num_hidden_layers"]
    else:
        _, attribute, wrong = ALTERNATIVES[alternative]
        monkeypatch.setattr(reference, attribute, wrong())
    after = ReleaseReference(config, fixture.state).logits(PROMPT)
    assert (after - before).abs().max() > 1e-3


def test_tokenizer_json_and_tiktoken_model_agree(kimi_linear, kimi_k3):
    from tokenizers import Tokenizer

    text = "The theatre's 2026 season: 演员 and rest\n\n  at the end.  "
    encoding = release_encoding(kimi_k3.directory, "kimi_k3")
    from_json = Tokenizer.from_file(str(kimi_linear.directory / "tokenizer.json"))
    ids = encoding.encode(text)
    assert from_json.encode(text).ids == ids
    assert encoding.decode(ids) == text and any(i >= 256 for i in ids)
    assert encoding.encode("[BOS]", allowed_special="all") == [BOS_ID] == [NUM_BASE]
    assert from_json.token_to_id("<|im_end|>") == EOS_ID
