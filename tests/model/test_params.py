"""config_counts: the size of the model a config builds, counted without building it, equal to the built
model's own count for every model, variant and option, and as fast for 10 million blocks as for 4."""
import time

import pytest

from model import build_model
from model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig
from model.params import config_counts, count_parameters
from model.residual import DepthGeometry
from trainer.config import CONFIG_DIR, load_config

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (CONFIG_DIR / "variant").glob("*.yaml"))


def built_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(total, active, state-dict elements) of the model built on the meta device."""
    model = build_model(cfg, device="meta")
    counts = count_parameters(model)
    return counts["total"], counts["active"], sum(t.numel() for t in model.state_dict().values())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_preset_counts_as_built(model, variant):
    cfg = load_config([f"model={model}", f"variant={variant}"]).model
    counts = config_counts(cfg)
    assert (counts.total, counts.active, counts.state) == built_counts(cfg)


RESIDUAL_OPTIONS = [
    {"kind": "baseline"}, {"kind": "highway"}, {"kind": "highway", "gate": "elementwise"}, {"kind": "x0"},
    {"kind": "mhc", "streams": 2}, {"kind": "hc", "streams": 3}, {"kind": "full"},
    {"kind": "block", "block_size": 3}, {"kind": "full", "mixing": "static"},
    {"kind": "full", "mixing": "scalars", "window": 2}, {"kind": "block", "mixing": "static", "block_size": 3,
                                                            "window": 1},
    {"kind": "block", "mixing": "scalars", "block_size": 100}, {"kind": "full", "heads": 2, "window": 5},
    {"kind": "block", "query": "input_dependent", "key_norm": False},
]
# (n_blocks, n_dense_layers, mla_every, n_shared_experts): MLA every block, none but the last, all dense, no MoE.
SHAPES = [(1, 1, 4, 1), (5, 0, 2, 0), (7, 3, 3, 2), (4, 4, 1, 1), (6, 0, 10, 1)]


@pytest.mark.parametrize("residual", RESIDUAL_OPTIONS, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_residual_option_and_block_mix_counts_as_built(residual, shape):
    n_blocks, dense, mla_every, shared = shape
    cfg = ModelConfig(vocab_size=37, d_model=24, n_blocks=n_blocks, n_heads=2, dense_inter=20, n_dense_layers=dense,
                      mla_every=mla_every, kda=KDAConfig(head_dim=6, conv_kernel=3),
                      mla=MLAConfig(kv_lora_rank=10, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5),
                      moe=MoEConfig(n_routed_experts=5, top_k=2, moe_inter=7, n_shared_experts=shared),
                      residual=ResidualConfig(**residual))
    counts = config_counts(cfg)
    assert (counts.total, counts.active, counts.state) == built_counts(cfg)
    assert counts.routed == sum(p.numel() for name, p in build_model(cfg, device="meta").named_parameters()
                                if ".mlp.w_" in name)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("window", [None, 1, 2, 7])
def test_sources_read_is_the_sum_of_every_reads_sources(size, window):
    for sublayers in range(1, 24):
        geometry = DepthGeometry(sublayers, size, False, window)
        assert geometry.sources_read() == sum(geometry.n_sources(s) for s in range(1, sublayers + 2))


def test_ten_million_blocks_count_in_a_millisecond():
    """What makes a forged n_blocks refusable before anything is built: the count does not loop over blocks."""
    cfg = ModelConfig(n_blocks=10_000_000, residual=ResidualConfig(kind="full", mixing="scalars"))
    start = time.perf_counter()
    counts = config_counts(cfg)
    assert time.perf_counter() - start < 1e-3
    small = ModelConfig(n_blocks=8, residual=ResidualConfig(kind="full", mixing="scalars"))
    assert counts.total > 1e6 * config_counts(small).total / 8  # Full's scalars grow as blocks squared
    assert counts.total == pytest.approx(config_counts(ModelConfig(n_blocks=10_000_000)).total
                                         + 2 * 10_000_000 ** 2, rel=0.01)


def test_a_size_beyond_any_memory_still_counts_exactly():
    """Plain integers, no tensors: 2**45 vocabulary entries (13 PB of fp32) count like 8192."""
    difference = config_counts(ModelConfig(vocab_size=2 ** 45)).total - config_counts(ModelConfig()).total
    assert difference == 2 * (2 ** 45 - 8192) * 256  # embedding and head rows of d_model=256


# K3's attention options (issue 56), alone and together, over block mixes that an explicit MLA list gives.
ATTENTION_OPTIONS = [
    {"mla": {"q_lora_rank": 9}}, {"mla": {"output_gate": True}}, {"kda": {"gate_lower_bound": -5.0}},
    {"kda": {"full_rank_output_gate": True}}, {"kda": {"output_gate_bias": False}},
    {"kda": {"full_rank_output_gate": True, "output_gate_bias": False}, "mla": {"q_lora_rank": 3, "output_gate": True},
     "mla_layers": [0, 2]},
    {"mla_layers": []}, {"mla_layers": [4, 1, 3]},
]


@pytest.mark.parametrize("options", ATTENTION_OPTIONS, ids=str)
def test_every_attention_option_counts_as_built(options):
    kda = KDAConfig(head_dim=6, conv_kernel=3, **options.get("kda", {}))
    mla = MLAConfig(kv_lora_rank=10, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5, **options.get("mla", {}))
    cfg = ModelConfig(vocab_size=37, d_model=24, n_blocks=5, n_heads=2, dense_inter=20, kda=kda, mla=mla,
                      moe=MoEConfig(n_routed_experts=5, top_k=2, moe_inter=7), mla_layers=options.get("mla_layers"))
    counts = config_counts(cfg)
    assert (counts.total, counts.active, counts.state) == built_counts(cfg)
    if "mla_layers" in options:
        model = build_model(cfg, device="meta")
        assert [i for i, block in model.layers.items() if hasattr(block.attn, "kv_b_proj")] == \
            [str(i) for i in sorted(options["mla_layers"])]


def test_the_released_models_count_as_their_configs():
    """model=kimi_linear_48b (variant=baseline: the release has no AttnRes) and model=kimi_k3 (variant=block,
    block_size=24) built on meta hold, weights and buffers together, what the released config.json files imply,
    counted here term by term from their values (docs/VARIANTS.md, "Model sizes"). Kimi Linear's is the published
    count of its safetensors. The expert bias (e_score_correction_bias) is our buffer, so `state`, not `total`, holds it;
    A_log is one per head (K3's checkpoint ships 128 for its 96 heads, 2,208 more over 69 layers)."""
    def release_count(d, V, heads, kda_heads_dim, layers, mla_layers, dense, experts, inter, shared, q_rank, latent,
                      full_rank_gate, output_gate, attn_res):
        P, K, H = heads * kda_heads_dim, kda_heads_dim, heads
        gate = P * d if full_rank_gate else d * K + K * P
        kda = 3 * P * d + 3 * P * 4 + d * K + K * P + d * H + H + P + gate + K + P * d
        query = d * H * 192 if q_rank is None else d * q_rank + q_rank + q_rank * H * 192
        mla = query + d * 576 + 512 + 512 * H * 256 + (d * H * 128 if output_gate else 0) + H * 128 * d
        width = latent or d
        moe = (experts * 3 * inter * width + experts * d + experts + 3 * d * inter * shared
               + (2 * d * latent + latent if latent else 0))
        return (2 * V * d + d + layers * 2 * d + (layers - mla_layers) * kda + mla_layers * mla + 3 * d * dense
                + (layers - 1) * moe + (attn_res * ((2 * layers + 1) * 2 * d)))

    kimi_linear = release_count(2304, 163840, 32, 128, 27, 7, 9216, 256, 1024, 1, None, None, False, False, False)
    kimi_k3 = release_count(7168, 163840, 96, 128, 93, 24, 33792, 896, 3072, 2, 1536, 3584, True, True, True)
    assert (kimi_linear, kimi_k3) == (49_122_681_728, 2_779_484_476_000)
    for overrides, expected in ((["model=kimi_linear_48b", "variant=baseline"], kimi_linear),
                                (["model=kimi_k3"], kimi_k3)):
        cfg = load_config(overrides).model
        assert config_counts(cfg).state == built_counts(cfg)[2] == expected
