"""`python -m inference.evaluate` and its lm_eval adapter (trainer/ and inference/exported_lm.py): batched scoring equals
scoring one request at a time, rolling windows cover a long text exactly, generation is generate's greedy
text cut at a stop string, the CLI writes local-task and perplexity results; bad input gets one line."""
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

import trainer.check
import inference.evaluate
from conftest import cli_error, fast_train_overrides
from model.generation import generate
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.data.format import read_manifest
from inference.evaluate import main
from inference.export import export
from inference.generate import GenerateError
from inference.exported_lm import ExportedAttnResLM
from trainer.lm_eval_adapter import AttnResLM, LMEvalError
from trainer.lm_tasks import task_manager_for
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 32  # fast_train_overrides' train.seq_len: the export's trained context


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("eval") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    out = run.parent / "export"
    export(str(run), str(out))
    return out


@pytest.fixture(scope="module")
def lm(export_dir):
    return ExportedAttnResLM.from_export(str(export_dir), batch_size=3)


@torch.no_grad()
def plain_scores(model, sequence: list[int], continuation_length: int) -> tuple[float, bool]:
    """log P of the last continuation_length tokens of `sequence` and whether each is the argmax, from one
    unpadded forward over the sequence's last SEQ_LEN + 1 tokens."""
    sequence = sequence[-(SEQ_LEN + 1):]
    logits = model(torch.tensor([sequence[:-1]]))[0]  # (T, vocab)
    log_probs = torch.log_softmax(logits[-continuation_length:].float(), dim=-1)  # (C, vocab)
    targets = torch.tensor(sequence[-continuation_length:])  # (C,)
    return (log_probs.gather(-1, targets[:, None]).sum().item(), bool((log_probs.argmax(-1) == targets).all()))


def greedy_next(model, tokens: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([tokens]))[0, -1].argmax())


@pytest.mark.slow
def test_batched_loglikelihood_equals_one_request_at_a_time(lm, capsys):
    encode = lm.tok_encode
    context = encode("The king and the queen")
    requests = [
        (None, encode("Thou"), encode(" hath a sword")),
        (None, context, [greedy_next(lm.model, context)]),  # a continuation greedy decoding produces
        (None, encode("The ghost of the night doth speak to thee"), encode(" of love and death.")),
        (None, [lm.eot_token_id], encode("fair")),
        (None, encode("the lord " * 20), encode(" crown")),  # longer than the context: cut from the left
    ]
    assert len(requests[-1][1]) + len(requests[-1][2]) > SEQ_LEN + 1
    scores = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (_, context_tokens, continuation), (log_prob, is_greedy) in zip(requests, scores):
        expected, expected_greedy = plain_scores(lm.model, context_tokens + continuation, len(continuation))
        assert log_prob == pytest.approx(expected, abs=1e-5)
        assert is_greedy == expected_greedy
    assert scores[1][1], "the argmax continuation must count as greedy"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: 1 of 5 loglikelihood requests were longer than the context of {SEQ_LEN} tokens; "
                        "their first tokens were cut"]


@torch.no_grad()
def rolling_reference(model, tokens: list[int], eot: int) -> float:
    """log P(tokens | end-of-text): each chunk of SEQ_LEN predictions conditioned on the SEQ_LEN tokens
    before its last one, written out independently of lm_eval's window helpers."""
    stream = [eot] + tokens
    total = 0.0
    for first in range(1, len(stream), SEQ_LEN):  # stream positions first..end-1 are predicted
        end = min(first + SEQ_LEN, len(stream))
        log_prob, _ = plain_scores(model, stream[max(0, end - 1 - SEQ_LEN):end], end - first)
        total += log_prob
    return total


def test_rolling_loglikelihood_covers_a_long_text_in_windows(lm):
    long_text = "the king hath a crown and thou speak of love. " * 8
    short_text = "the queen speak of death."
    tokens = lm.tok_encode(long_text)
    assert len(tokens) > 2 * SEQ_LEN
    assert len(lm.tok_encode(short_text)) < SEQ_LEN
    results = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0),
                                        Instance("loglikelihood_rolling", {}, (short_text,), 1)], disable_tqdm=True)
    assert results[0] == pytest.approx(rolling_reference(lm.model, tokens, lm.eot_token_id), rel=1e-6)
    short = [lm.eot_token_id] + lm.tok_encode(short_text)
    assert results[1] == pytest.approx(plain_scores(lm.model, short, len(short) - 1)[0], abs=1e-5)


def test_generate_until_is_greedy_generate_cut_at_the_stop_string(lm):
    prompt = "king queen king queen king"
    ids = lm.tok_encode(prompt)
    tokens = generate(lm.model, torch.tensor([ids]), 8, stop_token=lm.eot_token_id)
    full = lm.tok_decode(tokens[0, len(ids):].tolist())
    assert len(full) >= 2, "the model must generate text to cut"
    stop = full[len(full) // 2]
    expected = full.split(stop)[0]
    generated = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 8}), 0)],
                                  disable_tqdm=True)
    assert generated == [expected] and len(expected) < len(full)


def test_generation_kwargs_it_cannot_honour_are_refused(lm):
    request = Instance("generate_until", {}, ("the king", {"until": ["."], "top_k": 5}), 0)
    with pytest.raises(ValueError, match="top_k are not supported"):
        lm.generate_until([request], disable_tqdm=True)


def test_max_length_beyond_the_trained_context_is_refused(lm):
    with pytest.raises(LMEvalError, match=f"max_length=64 is beyond the trained context of {SEQ_LEN}"):
        AttnResLM(lm.model, lm.tokenizer, SEQ_LEN, max_length=64)


@pytest.mark.lm_eval
def test_lm_eval_builds_the_registered_model_from_model_args(export_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model="attnres", model_args=f"pretrained={export_dir},batch_size=2",
                                      tasks=["attnres_mc_words"], limit=2, log_samples=False,
                                      task_manager=TaskManager(include_path=str(inference.evaluate.LOCAL_TASKS),
                                                               include_defaults=False))
    assert 0 <= results["results"]["attnres_mc_words"]["acc,none"] <= 1


@pytest.mark.slow
def test_registering_attnres_leaves_lm_evals_own_models():
    # lm_eval registers its own models only when its registry is empty at the first lookup: in a fresh process
    # (this one has imported them already), importing the adapter first must not hide them.
    check = "import inference.exported_lm; from lm_eval.api.registry import model_registry; assert 'hf' in model_registry"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]


def valid_split_stream(dataset: Path) -> np.ndarray:
    """The tokens of the valid split of data.split=98,2,0 for tiny_dataset's 30 documents: its last one
    (Megatron gives valid the documents from round(0.98 * 30) = 29 on), read from tokens.bin up to its EOT."""
    manifest = read_manifest(dataset)
    stream = np.fromfile(dataset / "tokens.bin", dtype=manifest["dtype"]).astype(np.int64)
    ends = np.flatnonzero(stream == manifest["eot_id"])
    assert len(ends) == 30
    return stream[ends[-2] + 1:]


@torch.no_grad()
def val_loss_reference(model, dataset: Path) -> float:
    """Mean loss over every consecutive window of SEQ_LEN predictions of the valid split."""
    stream = valid_split_stream(dataset)
    windows = torch.from_numpy(stream[:(len(stream) - 1) // SEQ_LEN * SEQ_LEN + 1])
    inputs = windows[:-1].view(-1, SEQ_LEN)  # (W, T)
    targets = windows[1:].view(-1, SEQ_LEN)  # (W, T)
    logits = model(inputs)  # (W, T, vocab)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.lm_eval
def test_evaluate_writes_local_tasks_and_perplexity(export_dir, tiny_dataset, lm, tmp_path, capsys):
    out = tmp_path / "eval.json"
    main([f"model={export_dir}", "tasks=attnres_local", f"perplexity={tiny_dataset}", f"out={out}", "limit=4",
          "batch_size=4"])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(report) == {"export", "step", "tasks", "perplexity", "settings"}
    assert report["export"] == str(export_dir.resolve()) and report["step"] == 2
    assert set(report["tasks"]) == {"attnres_mc_words", "attnres_gen_words"}
    choice, generation = report["tasks"]["attnres_mc_words"], report["tasks"]["attnres_gen_words"]
    assert choice["samples"] == 4 and generation["samples"] == 4
    assert 0 <= choice["metrics"]["acc"]["value"] <= 1 and choice["metrics"]["acc"]["stderr"] is not None
    assert 0 <= generation["metrics"]["exact_match"]["value"] <= 1
    measured = report["perplexity"][str(tiny_dataset)]
    assert measured["perplexity"] == pytest.approx(math.exp(measured["loss"]))
    assert measured["loss"] == pytest.approx(val_loss_reference(lm.model, tiny_dataset), rel=1e-5)
    assert measured["bits_per_byte"] > 0 and measured["bytes"] > 0
    assert measured["tokens"] == (len(valid_split_stream(tiny_dataset)) - 1) // SEQ_LEN * SEQ_LEN
    assert "attnres_mc_words" in printed and f"wrote {out}" in printed


@pytest.fixture
def no_model_load(monkeypatch):
    """Bad input must be refused before the model is loaded."""
    def refuse(*args):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(inference.evaluate, "load_exported_model", refuse)


@pytest.mark.slow  # lm_eval builds its task index (seconds) before it can refuse
def test_an_unknown_task_is_one_line(export_dir, tmp_path, capsys, no_model_load):
    """From the CLI, and from train.eval_tasks in the pre-flight before torchrun starts a rank (lm_eval's catalogue,
    indexed once per process, serves both)."""
    err = cli_error(capsys, main, [f"model={export_dir}", "tasks=attnres_mc_words,hellaswg,no_such_task_at_all"])
    assert "unknown hellaswg (did you mean hellaswag?), no_such_task_at_all;" in err and "attnres_local" in err
    err = cli_error(capsys, trainer.check.main, [f"run.dir={tmp_path / 'run'}", "train.eval_tasks=[attnres_locl]"])
    assert err.startswith("error: train.eval_tasks: unknown attnres_locl (did you mean attnres_local?);")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def other_tokenizer(export_dir, tmp_path):
    """The export's tokenizer written out again: the same tokens in other bytes, so its hash differs."""
    copy = tmp_path / "tokenizer.json"
    copy.write_text(json.dumps(json.loads((export_dir / "tokenizer.json").read_text())))
    return copy


@pytest.fixture
def wide_tokenizer(export_dir, tmp_path):
    """The export's tokenizer with 300 more tokens: ids past the model's 512 rows (an IndexError mid-task)."""
    tokenizer = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    tokenizer.add_tokens([f"extra{i}" for i in range(300)])
    tokenizer.save(str(tmp_path / "wide.json"))
    return tmp_path / "wide.json"


@pytest.mark.parametrize("argv, message", [
    (["model={missing}", "tasks=attnres_local"], "model={missing} does not exist"),
    (["model={export}", "tasks=attnres_local", "tokenizer={wide}"], "tokenizer {wide} has ids up to "),
    (["model={export}"], "nothing to evaluate"),
    (["model={export}", "perplexity={missing}"], "perplexity={missing} does not exist"),
    (["model={export}", "perplexity={export}"], "is not a prepared dataset"),
    (["model={export}", "perplexity={dataset}", "tokenizer={tokenizer}"], "was tokenised with another tokenizer"),
    (["model={export}", "tasks=attnres_local,,attnres_mc_words"], "has an empty entry"),
    (["model={export}", "tasks=attnres_local", "limit=0"], "limit=0.0 must be"),
    (["model={export}", "tasks=attnres_local", "limit=2.5"], "limit=2.5 must be"),
    (["model={export}", "tasks=attnres_local", "device=gpu"], "device=gpu is not a torch device"),
    (["model={export}", "tasks=attnres_local", "include_path={missing}"], "is not a directory"),
    (["model={export}", "tasks=attnres_local", "out={export}"], "is a directory"),
    (["model={export}", "tasks=attnres_local", "bogus=1"], "unknown key 'bogus'"),
])
def test_bad_input_is_one_line(export_dir, tiny_dataset, other_tokenizer, wide_tokenizer, tmp_path, capsys,
                               no_model_load, argv, message):
    names = {"export": export_dir, "missing": tmp_path / "missing", "dataset": tiny_dataset,
             "tokenizer": other_tokenizer, "wide": wide_tokenizer}
    err = cli_error(capsys, main, [arg.format(**names) for arg in argv])
    assert message.format(**names) in err


def test_task_code_outside_the_repositorys_tasks_runs_only_with_allow_task_code(export_dir, tmp_path, capsys,
                                                                                no_model_load):
    """A task YAML's `custom_dataset: !function mod.load` imports mod.py from its directory: code, not data."""
    marker = tmp_path / "ran"
    tasks, shared = tmp_path / "tasks", tmp_path / "shared"
    tasks.mkdir()
    shared.mkdir()
    (tasks / "mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tasks / "mine.yaml").write_text("task: mine\ncustom_dataset: !function mod.load\n")
    err = cli_error(capsys, main, [f"model={export_dir}", "tasks=mine", f"include_path={tasks}"])
    assert err == (f"error: include_path={tasks}: {tasks / 'mine.yaml'}:2 runs Python (!function); pass "
                   "allow_task_code=true only if you trust that directory's code")
    assert not marker.exists()
    # A YAML with no code of its own that includes one with code, outside the directory.
    (tasks / "mine.yaml").write_text("include: ../shared/base.yaml\ntask: mine\n")
    (shared / "base.yaml").write_text("output_type: multiple_choice\nprocess_docs: !function mod.load\n")
    err = cli_error(capsys, main, [f"model={export_dir}", "tasks=mine", f"include_path={tasks}"])
    assert err.startswith(f"error: include_path={tasks}: {shared / 'base.yaml'}:2 runs Python (!function)")
    # The same tag in a spelling only the YAML parser reads as !function.
    (shared / "base.yaml").write_text("output_type: multiple_choice\nprocess_docs: !%66unction mod.load\n")
    err = cli_error(capsys, main, [f"model={export_dir}", "tasks=mine", f"include_path={tasks}"])
    assert err.startswith(f"error: include_path={tasks}: {shared / 'base.yaml'}:2 runs Python (!function)")
    assert not marker.exists()
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=True) == tasks
    assert inference.evaluate.check_include_path(None, allow_task_code=False) == inference.evaluate.LOCAL_TASKS


CODE_TASK = "task: mine\ncustom_dataset: {tag} mod.load\n"
# Each spelling of lm_eval's !function tag as its YAML parser resolves it, and the line the tag is on.
FUNCTION_SPELLINGS = {
    "plain": (CODE_TASK.format(tag="!function").encode(), 2),
    "uri_escape": (CODE_TASK.format(tag="!%66unction").encode(), 2),
    "tag_directive": (("%TAG !x! !fun\n---\n" + CODE_TASK.format(tag="!x!ction")).encode(), 4),
    "primary_handle_redefined": (("%TAG ! !fun\n---\n" + CODE_TASK.format(tag="!ction")).encode(), 4),
    "verbatim": (CODE_TASK.format(tag="!<!function>").encode(), 2),
    "utf16_le_bom": (("\ufeff" + CODE_TASK.format(tag="!function")).encode("utf-16-le"), 2),
    "utf16_be_bom": (("\ufeff" + CODE_TASK.format(tag="!function")).encode("utf-16-be"), 2),
    "mapping_key": (b"task: mine\n? !function mod.load\n: 1\n", 2),
}


def task_dir_with_module(tmp_path) -> tuple[Path, Path]:
    """A task directory whose mod.py leaves a marker file when imported, and that marker."""
    tasks, marker = tmp_path / "tasks", tmp_path / "ran"
    tasks.mkdir()
    (tasks / "mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef load(*args, **kwargs):\n    return None\n")
    return tasks, marker


@pytest.mark.parametrize("spelling", FUNCTION_SPELLINGS)
def test_every_spelling_of_the_function_tag_is_refused_and_lm_eval_would_run_each(tmp_path, spelling):
    """The check decides on the tags the YAML parser resolves, not on the text: most spellings here hide
    `!function` from a text search, and lm_eval's own loader imports mod.py for every one of them."""
    from lm_eval.tasks._yaml_loader import load_yaml

    text, line = FUNCTION_SPELLINGS[spelling]
    tasks, marker = task_dir_with_module(tmp_path)
    (tasks / "mine.yaml").write_bytes(text)
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    assert str(refused.value) == (f"include_path={tasks}: {tasks / 'mine.yaml'}:{line} runs Python (!function); "
                                  "pass allow_task_code=true only if you trust that directory's code")
    assert not marker.exists()
    load_yaml(tasks / "mine.yaml", resolve_func=True)
    assert marker.exists()


@pytest.mark.parametrize("encoding", ["utf-32-le", "utf-32-be"])
def test_a_task_yaml_neither_parser_reads_is_refused(tmp_path, encoding):
    """UTF-32 (with its byte-order mark) is no encoding YAML parsers detect; lm_eval would fail on the file too."""
    from lm_eval.tasks._yaml_loader import load_yaml

    tasks, marker = task_dir_with_module(tmp_path)
    (tasks / "mine.yaml").write_bytes(("\ufeff" + CODE_TASK.format(tag="!function")).encode(encoding))
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    message = str(refused.value)
    assert message.startswith(f"include_path={tasks}: {tasks / 'mine.yaml'} is not YAML lm_eval can read (")
    assert message.endswith("); fix or remove it") and "\n" not in message
    with pytest.raises(yaml.YAMLError):
        load_yaml(tasks / "mine.yaml", resolve_func=True)
    assert not marker.exists()


@pytest.mark.parametrize("including", [
    "include: [../shared/base.yaml]\ntask: mine\n",
    "<<: {include: ../shared/base.yaml}\ntask: mine\n",  # a merge key: `include` only after construction
])
def test_a_tag_in_a_file_reached_through_include_is_refused(tmp_path, including):
    from lm_eval.tasks._yaml_loader import load_yaml

    tasks, marker = task_dir_with_module(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "mod.py").write_text((tasks / "mod.py").read_text())
    (tasks / "mine.yaml").write_text(including)
    (shared / "base.yaml").write_text("output_type: multiple_choice\nprocess_docs: !%66unction mod.load\n")
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    assert str(refused.value).startswith(f"include_path={tasks}: {shared / 'base.yaml'}:2 runs Python (!function);")
    assert not marker.exists()
    load_yaml(tasks / "mine.yaml", resolve_func=True)
    assert marker.exists()


@pytest.mark.parametrize("text, tag", [
    ("task: mine\ncall: !!python/name:os.system\n", "tag:yaml.org,2002:python/name:os.system"),
    ("task: mine\nshared: !include base.yaml\n", "!include"),
    ("task: mine\nweird: !%0Afoo x\n", "!\nfoo"),
])
def test_any_tag_but_plain_datas_is_refused_naming_it(tmp_path, text, tag):
    tasks, _ = task_dir_with_module(tmp_path)
    (tasks / "mine.yaml").write_text(text)
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    assert str(refused.value) == (f"include_path={tasks}: {tasks / 'mine.yaml'}:2 has the YAML tag {tag!r}, which is "
                                  "not plain data (str, int, float, bool, null, map, seq, ...); remove it, or pass "
                                  "allow_task_code=true only if you trust that directory's code")
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=True) == tasks


def test_a_task_of_plain_data_passes_and_lm_eval_indexes_it(tmp_path):
    """Explicit core tags, anchors, merge keys and a UTF-16 file are all plain data."""
    tasks, marker = task_dir_with_module(tmp_path)
    (tasks / "mine.yaml").write_bytes(("\ufeff" + "defaults: &defaults\n  output_type: loglikelihood\n"
                                       "  num_fewshot: !!int 0\ntask: mine\n<<: *defaults\n"
                                       "dataset_path: json\ndoc_to_text: !!str '{{text}}'\n").encode("utf-16-le"))
    (tasks / "base.yml").write_text("metric_list:\n  - metric: acc\n")
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=False) == tasks
    assert "mine" in task_manager_for(["mine"], tasks).all_tasks
    assert not marker.exists()


@pytest.fixture(scope="module")
def evaluate_modules_cache(tmp_path_factory):
    """evaluate.load copies each script it imports into its modules cache (~/.cache/huggingface/modules): here one
    directory for all of this module's tests, as the package it imports them from is bound at its first use."""
    import evaluate.config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path_factory.mktemp("evaluate_modules"))
        yield


# A metric_list entry's name, the script (under tmp_path) evaluate.load imports for it, and its hf_evaluate.
EVALUATE_LOADS = {
    "directory": ("{tmp}/m", "m/m.py", False),  # a directory NAME: NAME/NAME.py
    "script": ("{tmp}/m.py", "m.py", False),
    "hf_evaluate": ("acc", "acc/acc.py", True),  # lm_eval's own name, looked up in the working directory first
}


@pytest.mark.parametrize("form", EVALUATE_LOADS)
def test_a_metric_lm_eval_would_load_with_evaluate_is_refused_and_lm_eval_would_run_it(
        tmp_path, monkeypatch, evaluate_modules_cache, form):
    """A tag-free task: lm_eval hands a metric its registry lacks, or any marked hf_evaluate: true, to
    evaluate.load, which imports a local script of that name before it looks on the Hub."""
    from lm_eval.api.registry import get_metric

    name, script, hf_evaluate = EVALUATE_LOADS[form]
    name = name.format(tmp=tmp_path)
    tasks, marker = task_dir_with_module(tmp_path)
    (tmp_path / script).parent.mkdir(exist_ok=True)
    (tmp_path / script).write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tasks / "mine.yaml").write_text(yaml.safe_dump({"task": "mine", "metric_list": [
        {"metric": "acc"}, {"metric": name, "hf_evaluate": hf_evaluate, "higher_is_better": True}]}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    reason = f"marks {name!r} hf_evaluate: true" if hf_evaluate else f"names {name!r}, not one of lm_eval's metrics"
    message = str(refused.value)
    assert message.startswith(f"include_path={tasks}: {tasks / 'mine.yaml'}: metric_list {reason}, so lm_eval would "
                              "load it with evaluate.load (a script at that path, or one from the Hub); use lm_eval's "
                              "own metrics (acc, acc_all, ")
    assert message.endswith(") without hf_evaluate, or pass allow_task_code=true only if you trust that directory's "
                            "code") and "\n" not in message
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=True) == tasks
    assert not marker.exists()
    get_metric(name, hf_evaluate)  # as lm_eval's ConfigurableTask calls it for this entry
    assert marker.exists()


def test_a_metric_in_a_groups_task_list_is_refused_from_the_cli(export_dir, tmp_path, capsys, no_model_load):
    """A group's task list overrides the keys of the tasks it names (here one of lm_eval's own), metric_list too."""
    tasks, marker = task_dir_with_module(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "m.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tasks / "mine.yaml").write_text(yaml.safe_dump({"group": "mine", "task": [
        {"task": "arc_easy", "metric_list": [{"metric": str(tmp_path / "m")}]}]}))
    err = cli_error(capsys, main, [f"model={export_dir}", "tasks=mine", f"include_path={tasks}"])
    assert err.startswith(f"error: include_path={tasks}: {tasks / 'mine.yaml'}: metric_list names "
                          f"{str(tmp_path / 'm')!r}, not one of lm_eval's metrics, so lm_eval would load it with "
                          "evaluate.load")
    assert not marker.exists()


@pytest.mark.parametrize("prompt, source", [
    ("promptsource:GPT-3 Style", "promptsource, which renders its templates outside the sandbox"),
    ("{tmp}/prompts.yaml:mine", "the file {tmp}/prompts.yaml, which lm_eval reads with yaml.full_load (Python "
                                "objects, unchecked)"),
], ids=["promptsource", "yaml_file"])
def test_a_prompt_from_outside_lm_evals_own_is_refused(tmp_path, prompt, source):
    """promptsource, no dependency here, is only refused. A prompt file is read with yaml.full_load: one out of
    include_path, which the tag check does not see, hands lm_eval a Python object (here os.system) for a prompt."""
    from lm_eval.prompts import get_prompt

    tasks, _ = task_dir_with_module(tmp_path)
    prompt, source = prompt.format(tmp=tmp_path), source.format(tmp=tmp_path)
    (tmp_path / "prompts.yaml").write_text("prompts:\n  mine: !!python/name:os.system\n")
    (tasks / "mine.yaml").write_text(yaml.safe_dump({"task": "mine", "use_prompt": prompt}))
    with pytest.raises(inference.evaluate.EvaluateError) as refused:
        inference.evaluate.check_include_path(str(tasks), allow_task_code=False)
    assert str(refused.value) == (f"include_path={tasks}: {tasks / 'mine.yaml'}: use_prompt {prompt!r} takes its "
                                  f"prompt from {source}; use one of lm_eval's own prompts (qa-basic:question-newline-"
                                  "answer, qa-basic:q-newline-a), or pass allow_task_code=true only if you trust that "
                                  "directory's code")
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=True) == tasks
    if prompt.startswith(str(tmp_path)):
        assert get_prompt(prompt).prompt_string is os.system


def test_lm_evals_own_metrics_prompts_and_registry_names_pass(tmp_path):
    """Every metric the repository's tasks use (their YAMLs read by lm_eval's loader, which leaves !function
    unresolved) and others of lm_eval's, a prompt of its own, and names that reach only lm_eval's registries:
    aggregations, filters, a group's aggregate_metric_list."""
    from lm_eval.tasks._yaml_loader import load_yaml

    repository_metrics = [entry for path in sorted(inference.evaluate.LOCAL_TASKS.glob("*.yaml"))
                          for entry in load_yaml(path, resolve_func=False).get("metric_list", [])]
    assert {entry["metric"] for entry in repository_metrics} == {"acc", "acc_norm", "exact_match", "word_perplexity",
                                                                 "byte_perplexity", "bits_per_byte"}
    tasks, marker = task_dir_with_module(tmp_path)
    (tasks / "mine.yaml").write_text(yaml.safe_dump({
        "task": "mine", "use_prompt": "qa-basic:q-newline-a",
        "metric_list": repository_metrics + [{"metric": name, "hf_evaluate": False} for name in ("bleu", "f1", "mcc")],
        "filter_list": [{"name": "strict", "filter": [{"function": "regex", "regex_pattern": "(\\d+)"},
                                                      {"function": "take_first"}]}]}))
    (tasks / "group.yaml").write_text(yaml.safe_dump({"group": "mine_group", "task": [
        {"task": "mine", "metric_list": [{"metric": "acc", "aggregation": "mean"}]}],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean"}]}))
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=False) == tasks
    assert not marker.exists()


class OpensMarkerWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("form", ["directory_script", "script", "pandas_pickle"])
def test_a_dataset_is_left_to_datasets_which_runs_no_code_from_it(tmp_path, form):
    """dataset_path, dataset_name and dataset_kwargs pass the check: the datasets installed (>= 4) runs no loading
    script, whether dataset_path names a directory DIR holding DIR.py or the script itself (and lm_eval drops
    trust_remote_code), and its pandas builder reads no pickle. An older datasets would run each: this says so."""
    tasks, marker = task_dir_with_module(tmp_path)
    code = f"open({str(marker)!r}, 'w').close()\n"
    kwargs = {"trust_remote_code": True, "cache_dir": str(tmp_path / "hf")}
    if form == "directory_script":
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "docs.py").write_text(code)
        dataset_path, refusal = str(tmp_path / "docs"), "Dataset scripts are no longer supported, but found docs.py"
    elif form == "script":
        (tmp_path / "docs.py").write_text(code)
        dataset_path, refusal = str(tmp_path / "docs.py"), "Dataset scripts are no longer supported, but found docs.py"
    else:
        (tmp_path / "docs.pkl").write_bytes(pickle.dumps(OpensMarkerWhenUnpickled(marker)))
        kwargs["data_files"] = {"test": str(tmp_path / "docs.pkl")}
        dataset_path, refusal = "pandas", "Pickle loading with the pandas dataset builder is disabled"
    (tasks / "mine.yaml").write_text(yaml.safe_dump({
        "task": "mine", "dataset_path": dataset_path, "dataset_kwargs": kwargs, "output_type": "loglikelihood_rolling",
        "test_split": "test", "doc_to_text": "", "doc_to_target": "text"}))
    assert inference.evaluate.check_include_path(str(tasks), allow_task_code=False) == tasks
    with pytest.raises((RuntimeError, ValueError), match=refusal):
        task_manager_for(["mine"], tasks).load(["mine"])
    assert not marker.exists()
    if form == "pandas_pickle":
        pickle.loads((tmp_path / "docs.pkl").read_bytes()).close()
        assert marker.exists(), "the pickle runs code when read as pandas.read_pickle would read it"


def test_help_prints_the_usage(capsys):
    main(["--help"])
    assert "python -m inference.evaluate model=EXPORT_DIR" in capsys.readouterr().out


# A tag-free task whose prompt template walks from jinja2's `self` to Python's builtins and leaves a marker file.
REACHING_TEMPLATE = "{{{{ self.__init__.__globals__.__builtins__.open({marker!r}, 'w').close() }}}} {{{{ text }}}}"


def plain_data_task(tmp_path, doc_to_text: str) -> Path:
    """A directory holding one task of plain data (passes check_include_path) over a two-line JSON file."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text('{"text": "the king"}\n{"text": "the queen"}\n')
    (tasks / "mine.yaml").write_text(yaml.safe_dump({
        "task": "mine", "dataset_path": "json", "output_type": "loglikelihood_rolling", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tasks / "docs.jsonl")}, "cache_dir": str(tmp_path / "hf")},
        "doc_to_text": doc_to_text, "doc_to_target": "text",
        "metric_list": [{"metric": "word_perplexity", "aggregation": "weighted_perplexity",
                         "higher_is_better": False}]}))
    return tasks


@pytest.mark.lm_eval
def test_a_template_reaching_python_is_refused_unless_task_code_is_allowed(export_dir, tmp_path, capsys):
    """No YAML tag runs code here: lm_eval's plain jinja2 environment would, and the sandbox stops it. The
    allowed run after the refusal also shows the refusal left lm_eval's own environment in place."""
    marker = tmp_path / "ran"
    template = REACHING_TEMPLATE.format(marker=str(marker))
    tasks = plain_data_task(tmp_path, template)
    argv = [f"model={export_dir}", "tasks=mine", f"include_path={tasks}", "limit=1", "batch_size=2"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the datasets library's progress bar
    shown = " ".join(template.split())[:inference.evaluate.TEMPLATE_SHOWN] + "..."
    assert err == (f"error: task mine ({tasks / 'mine.yaml'}): its template {shown!r} tried to reach Python "
                   "internals (SecurityError: access to attribute '__init__' of 'TemplateReference' object is "
                   "unsafe.); pass allow_task_code=true only if you trust that directory's code")
    assert not marker.exists()
    main(argv + ["allow_task_code=true"])
    assert marker.exists()
    assert "word_perplexity" in capsys.readouterr().out


def local_task_requests() -> dict:
    """Every request lm_eval builds for the repository's tasks: the prompts and continuations a model scores."""
    names = ["attnres_mc_words", "attnres_gen_words", "attnres_text"]
    requests = {}
    for name, task in task_manager_for(names, inference.evaluate.LOCAL_TASKS).load(names)["tasks"].items():
        task.build_all_requests()
        requests[name] = [instance.arguments for instance in task.instances]
    return requests


def test_the_repositorys_tasks_build_the_same_requests_in_the_sandbox():
    import lm_eval.utils

    plain_env, plain = lm_eval.utils.env, local_task_requests()
    with inference.evaluate.sandboxed_templates(task_manager_for([], inference.evaluate.LOCAL_TASKS)):
        assert lm_eval.utils.env is not plain_env
        sandboxed = local_task_requests()
    assert lm_eval.utils.env is plain_env
    assert sandboxed == plain
    # Both choices of each multiple-choice question; a generation prompt per word pattern; a text per line.
    assert {name: len(requests) for name, requests in plain.items()} == {"attnres_mc_words": 2 * 20,
                                                                         "attnres_gen_words": 10, "attnres_text": 4}
    assert plain["attnres_mc_words"][:2] == [("The king", " and the queen speak of love."),
                                             ("The king", " nad teh neueq epaks fo eolv.")]


# Templates in the idioms of lm_eval's own tasks (arc, lambada_cloze, the lettered-choices prompts), lm_eval's
# regex_replace filter, and a trailing newline (lm_eval's env keeps it), with what each renders.
LM_EVAL_TEMPLATES = [
    ("Question: {{question}}\nAnswer:", {"question": "Who hath the crown?"}, "Question: Who hath the crown?\nAnswer:"),
    ("{{text.split(' ')[:-1]|join(' ')}} ____. ->", {"text": "the king and the queen"}, "the king and the ____. ->"),
    ("{{choices.label.index(answerKey)}}", {"choices": {"label": ["A", "B", "C"]}, "answerKey": "C"}, "2"),
    ("{% for i in range(choices|length) %}{{ 'ABCD'[i] }}. {{ choices[i] | upper }}\n{% endfor %}",
     {"choices": ["love", "death"]}, "A. LOVE\nB. DEATH\n"),
    ("{{ text | regex_replace(' +', ' ') | trim }}\n", {"text": "  thou   art "}, "thou art\n"),
    ("{{ '{} of {}'.format(a, b) }}", {"a": "lord", "b": "night"}, "lord of night"),
]


@pytest.mark.parametrize("template, doc, rendered", LM_EVAL_TEMPLATES)
def test_the_sandbox_renders_what_lm_evals_environment_renders(template, doc, rendered):
    from lm_eval.utils import apply_template

    assert apply_template(template, doc) == rendered
    with inference.evaluate.sandboxed_templates(task_manager_for([], inference.evaluate.LOCAL_TASKS)):
        assert apply_template(template, doc) == rendered


def test_a_missing_field_is_an_error_in_the_sandbox_as_in_lm_evals_environment():
    """lm_eval's StrictUndefined: a template naming a field the document lacks fails rather than render ''."""
    from jinja2.exceptions import UndefinedError
    from lm_eval.utils import apply_template

    with pytest.raises(UndefinedError, match="'answer' is undefined"):
        apply_template("{{ question }} {{ answer }}", {"question": "Who?"})
    with inference.evaluate.sandboxed_templates(task_manager_for([], inference.evaluate.LOCAL_TASKS)):
        with pytest.raises(UndefinedError, match="'answer' is undefined"):
            apply_template("{{ question }} {{ answer }}", {"question": "Who?"})
