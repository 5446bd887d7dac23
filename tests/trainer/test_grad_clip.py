"""train.grad_clip: 0 turns clipping off (Megatron's clip_grad=0), it never zeroes the gradients."""
import json

import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.trainer import Trainer


def losses(run_dir, tiny_dataset, grad_clip):
    overrides = fast_train_overrides(run_dir, tiny_dataset, steps=4, **{"train.grad_clip": grad_clip,
                                                                         "optim.lr": 1e-2})
    Trainer(load_config(overrides), init_distributed()).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_grad_clip_zero_trains_like_an_unreachable_clip(tmp_path, tiny_dataset):
    off = losses(tmp_path / "off", tiny_dataset, 0)
    unreachable = losses(tmp_path / "huge", tiny_dataset, 1e9)
    assert off == unreachable  # bitwise: 0 means no clipping at all
    assert off[-1][0] < off[0][0] - 0.1 and all(norm > 0 for _, norm in off)
