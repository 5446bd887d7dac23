"""`python -m inference.generate`: loads only an export (safetensors + JSON), refuses training checkpoints
without reading them, and checks every input before any work; bad input gets one clear line."""
import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from conftest import cli_error, fast_train_overrides
from json_mutations import dumps, mutated_documents
from model import build_model
from model.generation import generate
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config import load_config
from inference.export import ExportError, export
from inference.generate import GenerateArgs, GenerateError, export_config, load_exported_model, main
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("gen") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    return run


@pytest.fixture(scope="module")
def export_dir(run_dir):
    out = run_dir.parent / "export"
    export(str(run_dir), str(out))
    return out


def run_cli(*args):
    """inference.generate in its own process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "inference.generate", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


def test_generates_text_after_the_prompt(export_dir, capsys):
    main([f"model={export_dir}", "prompt=the king", "max_new_tokens=5", "prefill_chunk=1"])
    text = capsys.readouterr().out
    assert text.startswith("the king") and len(text.strip()) > len("the king")


@pytest.mark.parametrize("prompt", ["ROMEO:", "king: [queen", "${lord}", "123", "null"])
def test_the_prompt_is_taken_verbatim(export_dir, capsys, prompt):
    # The shell strips the quotes of prompt="ROMEO:" (README's example); YAML would read a mapping, a
    # number or null, and OmegaConf an interpolation.
    main([f"model={export_dir}", f"prompt={prompt}", "max_new_tokens=2"])
    assert capsys.readouterr().out.startswith(prompt)


@pytest.fixture(scope="module")
def one_block_export_dir(run_dir, tiny_dataset):
    """The export of a one-block model (an MLA block): decode compiles per block, and checking that compile=true
    reaches the decoder needs only one (tests/model/test_generation.py compiles KDA and MLA decode steps)."""
    run = run_dir.parent / "one_block_run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2, **{"model.n_blocks": 1})),
            init_distributed()).fit()
    export(str(run), str(run.parent / "one_block_export"))
    return run.parent / "one_block_export"


@pytest.mark.compile
def test_compiled_decode_prints_the_eager_text(one_block_export_dir, capsys):
    main([f"model={one_block_export_dir}", "prompt=the king", "max_new_tokens=4"])
    eager = capsys.readouterr().out
    main([f"model={one_block_export_dir}", "prompt=the king", "max_new_tokens=4", "compile=true"])
    assert capsys.readouterr().out == eager


def test_checkpoint_is_an_alias_of_model(export_dir, capsys):
    main([f"checkpoint={export_dir}", "prompt=the king", "max_new_tokens=3"])
    via_alias = capsys.readouterr().out
    main([f"model={export_dir}", "prompt=the king", "max_new_tokens=3"])
    assert capsys.readouterr().out == via_alias


def test_export_generates_the_tokens_of_the_checkpoint(run_dir, export_dir, tiny_dataset, capsys):
    """Greedy tokens from the export equal those of the model loaded from the DCP checkpoint itself."""
    cfg = load_config(fast_train_overrides(run_dir, tiny_dataset, steps=2))
    from_checkpoint = build_model(cfg)
    load_checkpoint(latest_checkpoint(run_dir), from_checkpoint, [], None, rank=0)
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    prompt = torch.tensor([tokenizer.encode("the king").ids])
    expected = generate(from_checkpoint, prompt, max_new_tokens=6)
    assert expected.shape == (1, prompt.shape[1] + 6)

    from_export = load_exported_model(export_dir, cfg)
    assert torch.equal(generate(from_export, prompt, max_new_tokens=6), expected)
    main([f"model={export_dir}", "prompt=the king", "max_new_tokens=6"])
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(expected[0].tolist())


class Planted:
    """Unpickling this creates `marker`: evidence that a loader ran code planted in a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("target", ["run", "checkpoint"])
def test_run_and_checkpoint_dirs_are_refused_unread(run_dir, tmp_path, capsys, target):
    """Every file of the checkpoint but meta.json is a pickle that runs code when loaded; generate
    refuses the directory, names the export command, and never loads any of them."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    checkpoint = latest_checkpoint(run)
    marker = tmp_path / "planted_code_ran"
    payload = pickle.dumps(Planted(marker))
    for file in checkpoint.rglob("*"):
        if file.is_file() and file.name != "meta.json":
            file.write_bytes(payload)
    pickle.loads(payload)  # the payload works: loading it runs code
    assert marker.exists()
    marker.unlink()

    given = run if target == "run" else checkpoint
    out = run / "export" if target == "run" else run / f"export-{checkpoint.name}"
    assert cli_error(capsys, main, [f"model={given}", "prompt=the king", "max_new_tokens=3"]) == (
        f"error: model={given} is a training run or checkpoint, which generate does not load (DCP checkpoints are "
        "pickle-based, safe only from trusted sources); export it first with "
        f"`python -m inference.export checkpoint={given} out={out}` and pass that out= as model=")
    assert not marker.exists()


@pytest.mark.parametrize("args, message", [
    (["max_new_tokens=0"], "max_new_tokens=0 must be positive"),
    (["max_new_tokens=-3"], "max_new_tokens=-3 must be positive"),
    (["temperature=-0.5"], "temperature=-0.5 must be a finite number >= 0 (0 is greedy)"),
    (["temperature=nan"], "temperature=nan must be a finite number >= 0 (0 is greedy)"),
    (["top_p=0"], "top_p=0.0 must be in (0, 1]"),
    (["top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
    (["prefill_chunk=-1"], "prefill_chunk=-1 must be >= 0 (0 prefills the whole prompt at once)"),
    (["seed=-1"], "seed=-1 must be in [0, 18446744073709551615] (2**64 - 1)"),
    (["seed=99999999999999999999999"], "seed=99999999999999999999999 must be in [0, 18446744073709551615] (2**64 - 1)"),
])
def test_bad_options_are_refused_before_any_file_is_read(capsys, tmp_path, args, message):
    """The model path does not exist: the option, checked first, is what the error names."""
    err = cli_error(capsys, main, [f"model={tmp_path / 'missing'}", "prompt=the king", *args])
    assert err == f"error: {message}"


def test_prompt_plus_new_tokens_beyond_the_trained_context_is_refused(export_dir, capsys):
    prompt_tokens = len(Tokenizer.from_file(str(export_dir / "tokenizer.json")).encode("the king").ids)
    err = cli_error(capsys, main, [f"model={export_dir}", "prompt=the king", "max_new_tokens=40"])
    assert err == (f"error: the prompt is {prompt_tokens} tokens + max_new_tokens=40 = {prompt_tokens + 40}, beyond "
                   f"the model's trained context of 32 (train.seq_len); lower max_new_tokens to {32 - prompt_tokens} "
                   "or shorten the prompt")


@pytest.mark.parametrize("args, fragment", [
    (["prompt="], "prompt= is empty"),
    (["prompt=" + "the king " * 40, "max_new_tokens=1"], "beyond the model's trained context of 32"),
    (["prompt=hi", "max_new_tokens=1", "variant=full"], "holds a variant=block model"),
    (["prompt=hi", "max_new_tokens=1", "tokenizer=/nonexistent/tokenizer.json"],
     "tokenizer /nonexistent/tokenizer.json not found"),
    (["prompt=hi", "colour=red"], "unknown key 'colour'; valid keys: model, checkpoint, prompt, max_new_tokens, "
                                  "temperature, top_p, prefill_chunk, seed, compile, variant, tokenizer"),
    (["--prompt", "hi"], "argument '--prompt' is not key=value; valid keys: model, checkpoint"),
    (["prompt=hi", "max_new_tokens=many"], "max_new_tokens: Value 'many' of type 'str' could not be converted"),
    (["prompt=hi", "compile=sometimes"], "compile: Value 'sometimes' is not a valid bool"),
])
def test_bad_input_fails_with_one_line(export_dir, capsys, args, fragment):
    assert fragment in cli_error(capsys, main, [f"model={export_dir}", *args])


def test_model_must_be_given_and_be_an_export(export_dir, tmp_path, capsys):
    assert cli_error(capsys, main, ["prompt=hi"]) == (
        "error: model= is required: an export directory written by python -m inference.export")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(export_dir / "config.json", partial)
    assert cli_error(capsys, main, [f"model={partial}", "prompt=hi", "max_new_tokens=1"]) == (
        f"error: model={partial} is not an export directory: missing model.safetensors "
        "(write one with python -m inference.export)")


def edited_copy(export_dir, target, edit):
    """A copy of the export whose config.json `edit(described)` changed."""
    shutil.copytree(export_dir, target)
    described = json.loads((target / "config.json").read_text())
    edit(described)
    (target / "config.json").write_text(json.dumps(described))
    return target


def blocks(n: int):
    """An edit of config.json to n transformer blocks, its fingerprint recomputed to match (a forgery, not damage)."""
    def edit(described):
        described["config"]["model"]["n_blocks"] = n
        described["model_fingerprint"] = described["model_fingerprint"].replace("model.n_blocks=4", f"model.n_blocks={n}")
    return edit


@pytest.mark.parametrize("n_blocks, built", [(5, "1,120,070"), (1024, "237,933,980")])
def test_weights_that_do_not_match_the_config_are_refused_before_the_model_is_built(export_dir, tmp_path, capsys,
                                                                                  n_blocks, built):
    """An export whose config.json (and fingerprint) describes another model fails in one line, sized from the
    weights file's header and the config alone: 1024 blocks took 4 s to build even on the meta device."""
    altered = edited_copy(export_dir, tmp_path / "altered", blocks(n_blocks))
    start = time.perf_counter()
    err = cli_error(capsys, main, [f"model={altered}", "prompt=the king", "max_new_tokens=1"])
    assert time.perf_counter() - start < 2
    assert err == (f"error: {altered / 'model.safetensors'} holds 917,090 weights but {altered / 'config.json'} builds "
                   f"a model of {built} (model.n_blocks={n_blocks}, model.d_model=96); restore config.json or re-export "
                   "with inference.export")


def test_a_million_blocks_forged_into_config_json_are_refused_within_a_second(export_dir, tmp_path, capsys):
    """The probe of issue 55: nothing was printed while memory grew 45 MB/s building a million blocks."""
    forged = edited_copy(export_dir, tmp_path / "forged", blocks(1_000_000))
    start = time.perf_counter()
    err = cli_error(capsys, main, [f"model={forged}", "prompt=the king", "max_new_tokens=1"])
    assert time.perf_counter() - start < 1
    assert err == (f"error: {forged / 'config.json'} is not a config of this trainer (model.n_blocks=1000000 must be "
                   "in [1, 1024] (transformer blocks; the deepest released models have about 128)); re-export with "
                   "this version")


def test_a_config_edited_after_export_is_refused_by_its_fingerprint(export_dir, tmp_path, capsys):
    """variant.block_size null -> 4 loads the same weights into another computation (different logits)."""
    edited = edited_copy(export_dir, tmp_path / "edited",
                         lambda described: described["config"]["model"]["residual"].update(block_size=4))
    assert cli_error(capsys, main, [f"model={edited}", "prompt=the king", "max_new_tokens=1"]) == (
        f"error: {edited / 'config.json'} says variant.block_size=4 but its model_fingerprint says "
        "variant.block_size=None: the config was edited after export; restore it or re-export with inference.export")
    unchecked = edited_copy(export_dir, tmp_path / "unchecked", lambda described: described.pop("model_fingerprint"))
    assert cli_error(capsys, main, [f"model={unchecked}", "prompt=the king", "max_new_tokens=1"]) == (
        f"error: {unchecked / 'config.json'} has no model_fingerprint, so its config cannot be checked; re-export "
        "with inference.export")


def test_non_finite_weights_are_refused_naming_the_tensor(export_dir, tmp_path, capsys):
    poisoned = tmp_path / "poisoned"
    shutil.copytree(export_dir, poisoned)
    state = load_file(poisoned / "model.safetensors")
    name = next(name for name, tensor in state.items() if tensor.is_floating_point())
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, poisoned / "model.safetensors")
    assert cli_error(capsys, main, [f"model={poisoned}", "prompt=the king", "max_new_tokens=1"]) == (
        f"error: {poisoned / 'model.safetensors'}: tensor {name} holds {state[name].numel():,} non-finite values "
        f"(NaN or inf) of {state[name].numel():,}; export a checkpoint whose weights are finite")


def test_a_context_beyond_what_the_weights_were_trained_at_is_refused(export_dir, tmp_path, capsys):
    """train.seq_len is only text in config.json; the export's weights file records the context trained at."""
    with safe_open(export_dir / "model.safetensors", "pt") as weights:
        assert weights.metadata()["seq_len"] == "32"
    stretched = edited_copy(export_dir, tmp_path / "stretched",
                            lambda described: described["config"]["train"].update(seq_len=10 ** 12))
    args = ["prompt=the king", "max_new_tokens=40"]
    assert cli_error(capsys, main, [f"model={stretched}", *args]) == (
        f"error: {stretched / 'config.json'} has train.seq_len=1000000000000 but {stretched / 'model.safetensors'} "
        "was trained at seq_len=32; restore config.json or re-export with inference.export")
    # An export written before the context was recorded: train.seq_len must still be a plausible one.
    save_file(load_file(stretched / "model.safetensors"), stretched / "model.safetensors")
    assert cli_error(capsys, main, [f"model={stretched}", *args]) == (
        f"error: {stretched / 'config.json'} has train.seq_len=1000000000000, not a trained context (1 to 1,048,576 "
        "tokens); restore it or re-export with inference.export")


def test_help_prints_every_option_with_its_default_and_exits_0(capsys):
    result = run_cli("--help")
    assert result.returncode == 0 and result.stderr == ""
    for field in dataclasses.fields(GenerateArgs):
        default = "" if field.default is None else field.default
        assert f"  {field.name}={default}" in result.stdout
    main(["prompt=hi", "-h"])
    assert capsys.readouterr().out.strip() == result.stdout.strip()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
     "model.safetensors could not be read (Error while deserializing header"),
    (lambda d: (d / "config.json").write_text('{"config": '), "config.json could not be read (Expecting value"),
    (lambda d: (d / "config.json").write_text('{"config": {"model": {"d_model": "wide"}}}'),
     "config.json is not a config of this trainer (model.d_model: Value 'wide' of type 'str' could not be converted "
     "to Integer)"),
])
def test_a_damaged_export_fails_in_one_line(export_dir, tmp_path, capsys, damage, message):
    damaged = tmp_path / "damaged"
    shutil.copytree(export_dir, damaged)
    damage(damaged)
    err = cli_error(capsys, main, [f"model={damaged}", "prompt=the king", "max_new_tokens=1"])
    assert err.startswith(f"error: {damaged}/") and message in err


@pytest.mark.slow
def test_every_mutation_of_an_exports_config_is_one_line_or_a_config(export_dir, tmp_path):
    """Seeded mutations of config.json (issue 24's property test of our own files): reading it is either a
    config or generate's one-line refusal (a mistyped or out-of-range setting, a bad step or fingerprint)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(export_dir, damaged)
    described = json.loads((export_dir / "config.json").read_text())
    outcomes = {"config": 0, "refused": 0}
    for what, mutated in mutated_documents(described, seed=7, count=120):
        (damaged / "config.json").write_bytes(dumps(mutated))
        try:
            export_config(damaged, None)
            outcomes["config"] += 1
        except (GenerateError, ExportError) as error:
            assert "\n" not in str(error), what
            outcomes["refused"] += 1
    assert outcomes["refused"] > 60 and outcomes["config"] > 5, outcomes
