"""Degrees.problems: the layout's rules, stated once, and what each caller sees of them."""
import pytest

from parallel.dims import Degrees
from parallel.memory_plan import candidate_layouts
from trainer.config import ConfigError, load_config, validate_layout

XS = load_config(["model=xs"]).model  # 2 heads, dense width 256, 4 routed experts, 4 blocks, conv_kernel 4


def test_a_layout_breaking_every_rule_names_each_one():
    layout = Degrees(dp=2, fsdp=1, pp=4, vp=2, tp=3, ep=4, cp=2)
    assert layout.problems(XS, seq_len=130, micro_batch=4, global_batch=12) == [
        "model.n_heads=2 must be divisible by parallel.tp=3 (heads, channels and the sequence are split tp ways)",
        "model.dense_inter=256 must be divisible by parallel.tp=3 (heads, channels and the sequence are split tp ways)",
        "train.seq_len=130 must be divisible by parallel.tp=3 (heads, channels and the sequence are split tp ways)",
        "train.seq_len=130 must be divisible by parallel.cp * parallel.tp = 2 * 3 (every rank holds an equal slice "
        "of each sequence)",
        "parallel.pp * parallel.vp = 8 chunks is more than model.n_blocks=4 transformer blocks",
        "parallel.ep=4 must divide the data-parallel size dp=2: expert-parallel groups are carved out of the "
        "data-parallel ranks",
        "train.global_batch=12 must be a multiple of train.micro_batch * dp * fsdp = 4 * 2 * 1",
    ]


@pytest.mark.parametrize("layout, seq_len, batch, expected", [
    (Degrees(cp=2), 6, None, "train.seq_len / parallel.cp = 3 tokens per slice must be even"),
    (Degrees(cp=4), 8, None, "train.seq_len / parallel.cp = 2 tokens per slice is fewer than the 3"),
    (Degrees(pp=2, vp=2), 128, (2, 6), "(train.micro_batch * dp * fsdp) = 3) to be a multiple of parallel.pp=2"),
    (Degrees(dp=0), 128, None, "parallel.dp=0 must be positive"),
])
def test_each_rule_alone(layout, seq_len, batch, expected):
    problems = layout.problems(XS, seq_len, *(batch or ()))
    assert len(problems) == 1 and expected in problems[0]


def test_the_batch_rules_apply_only_with_a_batch():
    layout = Degrees(dp=2)
    assert layout.problems(XS, 128) == []
    assert layout.problems(XS, 128, micro_batch=8, global_batch=8) != []


def test_the_trainer_and_the_planner_search_agree_on_every_layout_of_16_ranks():
    cfg = load_config(["model=xs", "train.seq_len=64", "train.micro_batch=2", "train.global_batch=16"])
    accepted = set(candidate_layouts(cfg.model, 16, 64, micro_batch=2, global_batch=16))
    assert 20 < len(accepted) < len(candidate_layouts(cfg.model, 16, 64))
    for layout in candidate_layouts(cfg.model, 16, 64):  # the shapes' rules only: some fail the batch's
        cfg.parallel.dp, cfg.parallel.fsdp, cfg.parallel.cp = layout.dp, layout.fsdp, layout.cp
        cfg.parallel.pp, cfg.parallel.vp, cfg.parallel.tp, cfg.parallel.ep = layout.pp, layout.vp, layout.tp, layout.ep
        try:
            validate_layout(cfg, 16)
            trainer_accepts = True
        except ConfigError:
            trainer_accepts = False
        assert trainer_accepts == (layout in accepted), layout
