"""debug.profile_steps=[a, b]: a Chrome trace of training steps a..b in <run.dir>/profile/, one per rank."""
import json

import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer


@pytest.mark.slow
def test_a_run_writes_a_trace_of_the_profiled_steps_only(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=4, **{"debug.profile_steps": "[2,3]"})),
            init_distributed()).fit()
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0_steps2-3.json"]
    trace = json.loads((run / "profile" / "rank0_steps2-3.json").read_text())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    assert len(names) > 100
    assert {"train_step 2", "train_step 3"} <= set(names)
    assert not {"train_step 1", "train_step 4"} & set(names)
    assert any(name.startswith("aten::mm") for name in names)  # the model's matrix products
    assert f"profile trace {run / 'profile' / 'rank0_steps2-3.json'}" in (run / "train.log").read_text()


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[2,7]", "[2]"])
def test_a_range_outside_the_run_is_refused_in_one_line(steps):
    with pytest.raises(ConfigError) as error:
        load_config(["train.steps=6", f"debug.profile_steps={steps}"])
    assert str(error.value).endswith("must be [a, b] with 1 <= a <= b <= train.steps=6, or null")
    assert "\n" not in str(error.value)
