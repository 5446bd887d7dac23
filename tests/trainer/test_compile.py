"""train.compile=true: each transformer block compiled (parallel/compile.py) trains with eager's losses,
in one process and under the pipeline with full activation checkpointing. Inductor compiles a block's
forward and backward in about 45 s on this CPU. Both tests train the same two dense blocks (KDA, then MLA:
the last block always is), so they compile both mixers and the same graphs: one process and the two pp2
stages give a block the same inputs, and the checkpoint wrapper stays outside the compiled forward.
Whichever test runs second loads the graphs from inductor's on-disk cache instead of compiling them again."""
import json

import pytest
import torch

from conftest import fast_train_overrides, launch_job
from parallel.dims import init_distributed
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer

SHORT = {"train.eval_every": 3, "train.diag_every": 100}
TWO_DENSE_BLOCKS = {"model.n_blocks": 2, "model.n_dense_layers": 2, **SHORT}


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.compile
def test_compiled_blocks_train_with_the_eager_losses(tmp_path, tiny_dataset):
    for mode in ("false", "true"):
        overrides = fast_train_overrides(tmp_path / mode, tiny_dataset, steps=3,
                                         **{**TWO_DENSE_BLOCKS, "train.compile": mode})
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        Trainer(load_config(overrides), init_distributed()).fit()
        if mode == "true":  # the block really ran compiled
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    eager, compiled = losses(tmp_path / "false"), losses(tmp_path / "true")
    assert len(eager) == 3
    assert compiled == pytest.approx(eager, abs=1e-4)


@launch_job(2)
def pipeline_runs(root, dataset):
    runs = {"eager": {}, "compiled": {"train.compile": "true", "train.activation_checkpointing": "full"}}
    return [fast_train_overrides(root / name, dataset, steps=3, **{**TWO_DENSE_BLOCKS, "parallel": "pp2", **extra})
            for name, extra in runs.items()]


def test_compiled_blocks_under_the_pipeline_with_full_checkpointing_train_with_the_eager_losses(launched):
    root = launched(pipeline_runs)
    eager, compiled = losses(root / "eager"), losses(root / "compiled")
    assert len(eager) == 3
    assert compiled == pytest.approx(eager, abs=1e-4)


def test_compile_with_selective_checkpointing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^train\.compile=true with train\.activation_checkpointing=selective is "
                                          r"not supported: .*; use full or none$"):
        load_config(["train.compile=true", "train.activation_checkpointing=selective"])
