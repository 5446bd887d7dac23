"""`python -m trainer.generate`: loads a run's checkpoint and tokenizer; bad input gets one clear line."""
import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.generate import main
from trainer.trainer import Trainer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("gen") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    return run


def test_generates_text_after_the_prompt(run_dir, capsys):
    main([f"checkpoint={run_dir}", "prompt=the king", "max_new_tokens=5", "prefill_chunk=1"])
    text = capsys.readouterr().out
    assert text.startswith("the king") and len(text.strip()) > len("the king")


@pytest.mark.parametrize("args, fragment", [
    (["prompt="], "prompt= is empty"),
    (["prompt=" + "the king " * 40], "longer than the model's context of 32"),
    (["prompt=hi", "variant=full"], "holds a variant=block model"),
    (["prompt=hi", "tokenizer=/nonexistent/tokenizer.json"], "tokenizer /nonexistent/tokenizer.json not found"),
])
def test_bad_input_fails_with_one_line(run_dir, capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main([f"checkpoint={run_dir}", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err
