"""Engine.logits, the collective forward train.eval_tasks scores through: the width each layout pads to, and one
process's call against the model's own forward. Every layout's call against one process's scores: the launched
runs of test_tensor_parallel (tp2, dp2_ep2, cp2), test_pipeline (pp2_vp2) and test_fsdp (dp2_fsdp2)."""
import contextlib

import pytest
import torch

from model import build_model
from parallel.dims import Degrees, build_layout, init_distributed
from parallel.engine import build_engine, eval_width, padded
from trainer.config import load_config

CFG = load_config(["model=xs"])  # conv_kernel 4: a cp slice needs 3 tokens of history


@pytest.mark.parametrize("degrees, width, expected", [
    (Degrees(), 5, 5),
    (Degrees(tp=2), 5, 6),
    # cp2 x tp2: a multiple of 4 whose cp slice is even and holds >= 3 tokens
    (Degrees(cp=2, tp=2), 3, 8),
    (Degrees(cp=2, tp=2), 9, 12),
    (Degrees(cp=2, tp=2), 127, 128),
])
def test_the_eval_width_is_the_least_one_the_layout_splits(degrees, width, expected):
    assert eval_width(CFG.model, degrees, width, limit=128) == expected
    assert not degrees.problems(CFG.model, expected)


def test_padding_repeats_the_last_row_and_column():
    inputs = torch.tensor([[1, 2], [3, 4]])
    assert padded(inputs, rows=3, width=4).tolist() == [[1, 2, 2, 2], [3, 4, 4, 4], [3, 4, 4, 4]]


def test_one_process_logits_are_the_models_forward_of_the_unpadded_rows():
    torch.manual_seed(0)
    model = build_model(CFG.model)
    reference = build_model(CFG.model)
    reference.load_state_dict(model.state_dict())
    info = init_distributed()
    engine = build_engine(model, info, build_layout(info, Degrees()), CFG.parallel, micro_batch=4, seq_len=16,
                          microbatches=1)
    inputs = torch.randint(0, CFG.model.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    logits = engine.logits(inputs, contextlib.nullcontext)
    assert engine.eval_rows == 4 and logits.shape == (3, 10, CFG.model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference.eval()(inputs), rtol=0, atol=1e-5)
    assert model.training  # put back as the step left it
