"""Evaluate an exported model on lm-evaluation-harness tasks and on the perplexity of prepared datasets:

    python -m inference.evaluate model=EXPORT_DIR tasks=NAME[,NAME] perplexity=DATASET[,DATASET] out=FILE.json

Tasks run in lm-evaluation-harness (lm_eval) through inference/exported_lm.py; perplexity is measured here.
Only the export is loaded (model.safetensors + config.json, as inference.generate loads it), or a released Kimi
checkpoint directory read in place (trainer/kimi/, as inference.generate reads it). Every input is
checked before the model is loaded: a missing export or dataset, a dataset of another tokenizer, or an
unknown task name is one `error:` line and exit code 2.

Options (key=value, default after the =; give tasks=, perplexity= or both):
  model=            (required) an export directory written by python -m inference.export, or a Kimi release
                    directory
  tasks=            lm_eval tasks or groups, comma-separated. The local ones live in include_path and need no
                    network: attnres_local, the group of attnres_mc_words (multiple choice) and
                    attnres_gen_words (generation), and attnres_text (perplexity). lm_eval's own
                    (hellaswag, arc_easy, mmlu, ...; listed by `lm-eval ls tasks`) download their data on
                    first use, so they need a connected machine
  perplexity=       prepared dataset directories (the data layer's: manifest.json, tokens.bin/.idx, tokenizer.json),
                    comma-separated, tokenised with the export's tokenizer: loss (nats/token), perplexity and
                    bits per byte over each one's valid split (the run's data.split), in samples of the trained
                    context (train.seq_len)
  out=              write the results JSON here (a temporary file renamed into place); without it only the
                    table is printed
  limit=            at most this many examples per task (a fraction below 1: that share of each); empty: all
  batch_size=8      sequences per forward
  num_fewshot=0     few-shot examples before each prompt
  include_path=     a directory of task YAMLs besides lm_eval's own (default: configs/eval/tasks here). A
                    YAML there may run Python (`!function module.name` imports module.py from its
                    directory): a directory whose YAMLs (or the files they include) hold any tag but plain
                    data's (str, int, map, ...), or do not parse, is refused unless allow_task_code=true;
                    so is one naming code in plain data: a metric outside lm_eval's own or one with
                    hf_evaluate: true (evaluate.load imports a script of that name), or a use_prompt from
                    promptsource or a YAML file. Task templates (doc_to_text, doc_to_target, ...) render
                    in jinja2's sandbox unless allow_task_code=true: one that reaches for Python internals
                    stops the run
  allow_task_code=false  true: run the Python that include_path's task YAMLs name, and render every task's
                    templates outside the sandbox (only for code you trust)
  device=auto       auto (cuda when available), cpu, cuda or cuda:N
  tokenizer=        tokenizer.json to use instead of the one in the export directory
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from model.document_masking import document_starts
from trainer.config import Config
from trainer.data import BlendSamples, default_cache_dir, resolve_blend
from trainer.data.format import MANIFEST_NAME, TOKENIZER_NAME, DataError, sha256_file, verify_dataset
from inference.export import parse_key_values, read_export_config, run_cli
from inference.generate import MODEL_DIR_ERRORS, GenerateError, load_exported_model, open_model_dir
from inference.exported_lm import ExportedAttnResLM
from trainer.lm_eval_adapter import AttnResLM, LMEvalError, pick_device
from trainer.lm_tasks import LOCAL_TASKS, run_tasks, task_manager_for
from trainer.files.safe_io import write_file

FUNCTION_TAG = "!function"
# lm_eval parses task YAMLs with libyaml's safe loader when PyYAML has it (the pure-Python parser otherwise);
# the check parses with the same one, so that it sees the tags lm_eval's loader will see.
TASK_YAML_LOADER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
# The tags that build plain data: those a safe loader constructs, and the merge key `<<`. Every other tag is
# refused, not only !function: lm_eval or a later release may hand any tag it registers to code.
DATA_TAGS = frozenset(tag for tag in yaml.SafeLoader.yaml_constructors if tag) | {"tag:yaml.org,2002:merge"}
YAML_SUFFIXES = (".yaml", ".yml")
TRUST_HINT = "pass allow_task_code=true only if you trust that directory's code"
TEMPLATE_SHOWN = 80  # characters of a refused template the error line quotes
PREPARE_HINT = "prepare text with python -m scripts.prepare_data source=TEXT tokenizer={tokenizer}"


@dataclass
class EvaluateArgs:
    model: str | None = None
    tasks: str | None = None
    perplexity: str | None = None
    out: str | None = None
    limit: float | None = None
    batch_size: int = 8
    num_fewshot: int = 0
    include_path: str | None = None
    allow_task_code: bool = False
    device: str = "auto"
    tokenizer: str | None = None


class EvaluateError(ValueError):
    """Bad input to evaluation; the message is one line."""


def names_of(key: str, value: str | None) -> list[str]:
    """A comma-separated option -> its entries; an empty entry (tasks=a,,b) is refused."""
    if not value:
        return []
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise EvaluateError(f"{key}={value} has an empty entry; give names separated by single commas")
    return names


def check_limit(limit: float | None) -> int | float | None:
    """lm_eval's limit: a count of examples (a whole number >= 1) or a share of them (in (0, 1))."""
    if limit is None or 0 < limit < 1:
        return limit
    if limit < 1 or limit != int(limit):
        raise EvaluateError(f"limit={limit} must be a whole number >= 1 (examples per task) or a fraction in (0, 1)")
    return int(limit)


def check_out(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise EvaluateError(f"out={out} is a directory; give the JSON file to write, e.g. out={path / 'eval.json'}")
    if not path.parent.is_dir():
        raise EvaluateError(f"out={out}: directory {path.parent} does not exist; create it or pick another out")
    return path


def check_options(args: EvaluateArgs) -> None:
    """Every option that needs no file."""
    if not args.model:
        raise EvaluateError("model= is required: an export directory written by python -m inference.export")
    if not args.tasks and not args.perplexity:
        raise EvaluateError("nothing to evaluate: give tasks=NAME[,NAME] (e.g. tasks=attnres_local), "
                            "perplexity=DATASET[,DATASET], or both")
    if args.batch_size < 1:
        raise EvaluateError(f"batch_size={args.batch_size} must be a positive integer")
    if args.num_fewshot < 0:
        raise EvaluateError(f"num_fewshot={args.num_fewshot} must be >= 0")


def check_dataset(given: str, tokenizer_file: Path, cfg: Config) -> BlendSamples:
    """A prepared dataset whose validation split the export can score: its tokenizer, a valid split (by the
    run's data.split) of one sample of the trained context at least, and files that match their manifest
    with every id inside the model's vocab."""
    path = Path(given)
    hint = PREPARE_HINT.format(tokenizer=tokenizer_file)
    if not path.exists():
        raise EvaluateError(f"perplexity={given} does not exist; give a prepared dataset directory ({hint})")
    if not (path / MANIFEST_NAME).is_file():
        raise EvaluateError(f"perplexity={given} is not a prepared dataset (no {MANIFEST_NAME}); {hint}")
    manifest = verify_dataset(path)
    if manifest["sha256"][TOKENIZER_NAME] != sha256_file(tokenizer_file):
        raise EvaluateError(f"perplexity={given} was tokenised with another tokenizer than {tokenizer_file}; "
                            f"its ids would mean other text to this model: {hint}")
    blend = resolve_blend(None, str(path), None, cfg.model.vocab_size, None)
    return BlendSamples(blend, cfg.data.split, cfg.train.seq_len, cfg.seed, default_cache_dir())


def check_include_path(include_path: str | None, allow_task_code: bool) -> Path:
    """The task directory; one whose YAMLs hold a tag other than plain data's (`!function`, lm_eval's tag that
    imports a module from the YAML's directory, above all) or name code in plain data (refuse_code_named_in)
    only with allow_task_code, except this repository's own."""
    path = Path(include_path) if include_path else LOCAL_TASKS
    if not path.is_dir():
        raise EvaluateError(f"include_path={include_path} is not a directory; give a directory of lm_eval task YAMLs "
                            f"(default {LOCAL_TASKS})")
    if not allow_task_code and path.resolve() != LOCAL_TASKS:
        check_task_yamls(path, f"include_path={include_path}")
    return path


def check_task_yamls(directory: Path, option: str) -> None:
    """Every YAML lm_eval reads for `directory` (those under it, and those their `include:` names) holds plain
    data only, and names no code in it; `option` (the setting that named the directory) starts each refusal."""
    checked = set()
    pending = sorted((p.resolve() for p in directory.rglob("*") if p.suffix in YAML_SUFFIXES and p.is_file()),
                     reverse=True)  # popped from the end: the first refusal is that of the first file by name
    while pending:
        yaml_file = pending.pop()
        if yaml_file not in checked:
            checked.add(yaml_file)
            data = plain_task_data(yaml_file, option)
            refuse_code_named_in(data, f"{option}: {yaml_file}")
            pending.extend(included_files(yaml_file, data))


def plain_task_data(yaml_file: Path, option: str):
    """`yaml_file` parsed as lm_eval parses it, refused unless every node's tag is plain data's. The tag is the
    parser's, after %TAG handles, %-escapes and verbatim !<...> are undone and a UTF-16 byte-order mark has
    picked the encoding (bytes in, as lm_eval reads the file): text search sees none of those spellings."""
    try:
        loader = TASK_YAML_LOADER(yaml_file.read_bytes())
    except OSError as error:
        raise EvaluateError(f"{option}: {yaml_file} cannot be read ({error.strerror}); fix its permissions or "
                            "remove it") from None
    try:
        root = loader.get_single_node()
        node = first_non_data_node(root)
        # Constructed only once every tag is plain data's, for the `include:` it may hold.
        data = None if root is None or node is not None else loader.construct_document(root)
    # ValueError: a scalar the resolver reads as a date that is none (2024-02-30) fails in construction.
    except (yaml.YAMLError, ValueError) as error:
        raise EvaluateError(f"{option}: {yaml_file} is not YAML lm_eval can read ({' '.join(str(error).split())}); "
                            "fix or remove it") from None
    finally:
        loader.dispose()
    if node is not None:
        where = f"{option}: {yaml_file}:{node.start_mark.line + 1}"
        if node.tag == FUNCTION_TAG:
            raise EvaluateError(f"{where} runs Python ({FUNCTION_TAG}); {TRUST_HINT}")
        raise EvaluateError(f"{where} has the YAML tag {node.tag!r}, which is not plain data (str, int, float, "
                            f"bool, null, map, seq, ...); remove it, or {TRUST_HINT}")
    return data


def first_non_data_node(root: yaml.Node | None) -> yaml.Node | None:
    """The first node, in document order, whose tag is not in DATA_TAGS; an alias is walked once."""
    seen, pending = set(), [] if root is None else [root]
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag not in DATA_TAGS:
            return node
        if isinstance(node, yaml.MappingNode):
            pending.extend(child for pair in reversed(node.value) for child in reversed(pair))
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(reversed(node.value))
    return None


def refuse_code_named_in(data, where: str) -> None:
    """The keys through which plain data still makes lm_eval run Python, in any mapping of `data`: a group's
    defaults and its task list carry task keys as well as a task's top level. `where` starts the refusal.

    - metric_list: lm_eval hands a metric its registry lacks, and any with hf_evaluate: true, to evaluate.load,
      which imports NAME.py from a local directory NAME, or the file NAME, and else downloads a script from
      the Hub. Checked even beside a process_results, which skips that lookup: a group's override or an
      including file may set process_results back to null.
    - use_prompt: promptsource renders its templates in its own jinja2 Environment, not the sandbox, read
      from a directory that dataset_path can name; a `FILE.yaml:NAME` prompt is read with yaml.full_load,
      which builds Python objects and is outside the tag check.

    Left to lm_eval, as plain data there runs nothing: aggregation, filter and fewshot sampler names (lookups
    in lm_eval's own registries); process_docs, process_results, custom_dataset, class and doc_to_* as
    strings (only !function makes them callable; a string is a template or a field, or fails); and
    dataset_path, dataset_name and dataset_kwargs: the datasets installed (>= 4) runs no loading script (a
    path ending .py, or a directory DIR holding DIR.py, is an error; lm_eval drops trust_remote_code and
    datasets ignores it) and its pandas builder reads no pickle, which the tests hold it to."""
    import lm_eval.api.metrics  # noqa: F401  registers lm_eval's metrics, as its get_metric does on first use
    from lm_eval.api.registry import metric_registry
    from lm_eval.prompts import PROMPT_REGISTRY

    for mapping in mappings_in(data):
        metric_list = mapping.get("metric_list")
        for entry in metric_list if isinstance(metric_list, list) else []:
            reason = metric_loaded_as_code(entry, metric_registry)
            if reason is not None:
                raise EvaluateError(f"{where}: metric_list {reason}, so lm_eval would load it with evaluate.load "
                                    "(a script at that path, or one from the Hub); use lm_eval's own metrics "
                                    f"({', '.join(sorted(metric_registry))}) without hf_evaluate, or {TRUST_HINT}")
        prompt = mapping.get("use_prompt")
        source = prompt_source(prompt) if isinstance(prompt, str) else None
        if source is not None:
            own = ", ".join(f"{category}:{name}" for category, prompts in PROMPT_REGISTRY.items() for name in prompts)
            raise EvaluateError(f"{where}: use_prompt {prompt!r} takes its prompt from {source}; use one of "
                                f"lm_eval's own prompts ({own}), or {TRUST_HINT}")


def mappings_in(data):
    """Every mapping in `data`, in document order; one that aliases reach twice (or within itself) once."""
    seen, pending = set(), [data]
    while pending:
        value = pending.pop()
        if not isinstance(value, (dict, list)) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            yield value
        pending.extend(reversed(list(value.values()) if isinstance(value, dict) else value))


def metric_loaded_as_code(entry, metric_registry) -> str | None:
    """Why lm_eval would hand the metric_list entry `entry` to evaluate.load (as ConfigurableTask decides), or
    None. The registry only grows once lm_eval runs, so a name found in it now is found then."""
    if not isinstance(entry, dict) or "metric" not in entry:
        return None  # lm_eval refuses the entry before it looks the metric up
    name = entry["metric"]
    if entry.get("hf_evaluate") is True:
        return f"marks {name!r} hf_evaluate: true"
    if not (isinstance(name, str) and name in metric_registry):
        return f"names {name!r}, not one of lm_eval's metrics"
    return None


def prompt_source(prompt: str) -> str | None:
    """Where lm_eval's get_prompt would read `prompt` (CATEGORY:NAME) from, when that can run code or build
    Python objects; None for its own prompt registry."""
    category = prompt.partition(":")[0]
    if category == "promptsource":
        return "promptsource, which renders its templates outside the sandbox"
    if ".yaml" in category:
        return f"the file {category}, which lm_eval reads with yaml.full_load (Python objects, unchecked)"
    return None


def included_files(yaml_file: Path, data) -> list[Path]:
    """The files `data`'s `include:` names, resolved as lm_eval's load_yaml resolves them (from the including
    file's real directory); a name lm_eval could not open is skipped, as lm_eval skips its task."""
    if not isinstance(data, dict) or "include" not in data:
        return []
    names = data["include"] if isinstance(data["include"], list) else [data["include"]]
    found = []
    for name in names:
        if not isinstance(name, str):
            continue
        try:
            included = (yaml_file.parent / name).resolve()
        except (OSError, ValueError, RuntimeError):  # a NUL byte in the name; a symlink loop
            continue
        if included.is_file():
            found.append(included)
    return found


@contextlib.contextmanager
def sandboxed_templates(manager):
    """lm_eval renders task templates (doc_to_text, doc_to_target, doc_to_choice, ...) with lm_eval.utils.env,
    a plain jinja2 Environment, in which a tag-free YAML's `{{ self.__init__.__globals__ ... }}` reaches
    `__import__`. For the evaluation that env is a sandbox made like it; a template that reaches for Python
    internals then stops the run with one line naming its task (`manager` knows the task's YAML)."""
    import lm_eval.utils
    from jinja2.exceptions import SecurityError

    original = lm_eval.utils.env
    # apply_template, through which every task template renders, looks env up at each call and keeps no
    # compiled template, so rebinding the module's name reaches it. (env's one other user, RemoteTokenizer,
    # compiles the chat template of lm_eval's API models, which this model is not.)
    lm_eval.utils.env = sandbox_like(original)
    try:
        yield
    except SecurityError as error:
        raise EvaluateError(template_refusal(error, manager)) from None
    finally:
        lm_eval.utils.env = original


def sandbox_like(env):
    """An ImmutableSandboxedEnvironment that renders what `env` renders: its settings, and the filters, tests
    and globals it holds beyond jinja2's defaults (lm_eval's regex_replace). jinja2's default globals stay
    the sandbox's own: its `range` is the bounded one."""
    from jinja2 import Environment
    from jinja2.defaults import DEFAULT_FILTERS, DEFAULT_NAMESPACE, DEFAULT_TESTS
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Environment keeps each of its arguments under the argument's name, but for these three.
    settings = {name: getattr(env, name) for name in inspect.signature(Environment).parameters
                if name not in ("extensions", "cache_size", "enable_async")}
    sandbox = ImmutableSandboxedEnvironment(**settings, extensions=list(env.extensions), enable_async=env.is_async)
    for added, given, defaults in ((sandbox.filters, env.filters, DEFAULT_FILTERS),
                                   (sandbox.tests, env.tests, DEFAULT_TESTS),
                                   (sandbox.globals, env.globals, DEFAULT_NAMESPACE)):
        added.update({name: value for name, value in given.items() if defaults.get(name) is not value})
    sandbox.policies.update(env.policies)
    return sandbox


def template_refusal(error, manager) -> str:
    """The one line for a template the sandbox refused: its task and the task's YAML (from the innermost lm_eval
    Task whose method was rendering) and the template (apply_template's argument), read off the traceback."""
    import lm_eval.utils
    from lm_eval.api.task import Task

    task, template = None, None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if isinstance(frame.f_locals.get("self"), Task):
            task = frame.f_locals["self"].config.task
        if frame.f_code is lm_eval.utils.apply_template.__code__:
            template = " ".join(frame.f_locals["template"].split())
    entry = manager.task_index.get(task)
    where = f"task {task}" if task else "a task"  # a template lm_eval rendered outside a task's method
    if entry is not None and entry.yaml_path is not None:
        where += f" ({entry.yaml_path})"
    if template is not None:
        where += f": its template {template[:TEMPLATE_SHOWN] + '...' * (len(template) > TEMPLATE_SHOWN)!r}"
    return (f"{where} tried to reach Python internals (SecurityError: {' '.join(str(error).split())}); "
            f"{TRUST_HINT}")


@torch.no_grad()
def dataset_perplexity(lm: AttnResLM, samples: BlendSamples, cfg: Config, batch_size: int) -> dict:
    """Mean loss over every validation sample of train.seq_len predictions (the trainer's validation samples,
    all of them), its exp, and bits per byte: the summed loss in bits over the UTF-8 bytes of the predicted
    tokens' text (the end-of-text token has none)."""
    eot_id = samples.blend.eot_id
    nll, tokens, text_bytes = 0.0, 0, 0
    for inputs, targets in samples.val_batches(batch_size):
        inputs, targets = inputs.to(lm.device), targets.to(lm.device)
        # A model trained with document masking saw no earlier document of its window; score it the same way.
        starts = document_starts(inputs, eot_id) if cfg.data.document_masking else None
        logits = lm.model(inputs, document_starts=starts)  # (B, T, vocab)
        nll += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()
        tokens += targets.numel()
        text_bytes += sum(len(lm.tok_decode(row).encode("utf-8")) for row in targets.tolist())
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": nll / (math.log(2) * text_bytes),
            "tokens": tokens, "bytes": text_bytes}


def table(report: dict) -> str:
    """The results on one screen: a row per task metric, then one per dataset."""
    lines = [f"export {report['export']} (step {report['step']})"]
    if report["tasks"]:
        lines.append(f"{'task':<28} {'metric':<16} {'value':>8} {'stderr':>8} {'n':>6}")
        for task, entry in report["tasks"].items():
            for metric, measured in entry["metrics"].items():
                stderr = "" if measured["stderr"] is None else f"{measured['stderr']:.4f}"
                lines.append(f"{task:<28} {metric:<16} {measured['value']:>8.4f} {stderr:>8} "
                             f"{entry['samples'] or '':>6}")
    if report["perplexity"]:
        lines.append(f"{'dataset (val split)':<40} {'loss':>8} {'ppl':>10} {'bits/byte':>9} {'tokens':>10}")
        for dataset, measured in report["perplexity"].items():
            lines.append(f"{dataset:<40} {measured['loss']:>8.4f} {measured['perplexity']:>10.2f} "
                         f"{measured['bits_per_byte']:>9.4f} {measured['tokens']:>10,}")
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    try:
        write_file(out, json.dumps(report, indent=2) + "\n")
    except OSError as error:
        raise EvaluateError(f"out={out} cannot be written ({error.strerror})") from None


def run(args: EvaluateArgs) -> str:
    check_options(args)
    limit, out, device = check_limit(args.limit), check_out(args.out), pick_device(args.device)
    task_names, dataset_names = names_of("tasks", args.tasks), names_of("perplexity", args.perplexity)
    source = open_model_dir("model", args.model, None, args.tokenizer)
    cfg, tokenizer = source.cfg, source.tokenizer
    tokenizer_file = Path(args.tokenizer) if args.tokenizer else source.tokenizer_file
    if dataset_names and tokenizer_file is None:
        raise EvaluateError(f"perplexity= checks each dataset against the tokenizer.json it was prepared with, and "
                            f"{source.path} has none; pass tokenizer=PATH")
    datasets = {name: check_dataset(name, tokenizer_file, cfg) for name in dataset_names}
    manager = task_manager_for(task_names, check_include_path(args.include_path, args.allow_task_code)) if task_names else None

    model = source.load() if source.release is not None else load_exported_model(source.path, cfg)
    lm = ExportedAttnResLM(model, tokenizer, cfg.train.seq_len, args.batch_size, device=device)
    with contextlib.nullcontext() if args.allow_task_code else sandboxed_templates(manager):
        tasks = run_tasks(lm, task_names, manager, limit, args.num_fewshot) if task_names else {}
    perplexity = {name: dataset_perplexity(lm, path, cfg, args.batch_size) for name, path in datasets.items()}
    step = None if source.release is not None else read_export_config(source.path).get("step")
    report = {"export": str(source.path.resolve()), "step": step,
              "tasks": tasks, "perplexity": perplexity,
              "settings": {"limit": limit, "num_fewshot": args.num_fewshot, "batch_size": args.batch_size,
                           "max_length": lm.max_length}}
    if out is not None:
        write_report(out, report)
    return table(report) + (f"\nwrote {out}" if out is not None else "")


def parse(argv: list[str]) -> EvaluateArgs:
    return parse_key_values(argv, EvaluateArgs, EvaluateError)


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, __doc__, lambda args: run(parse(args)),
            (EvaluateError, LMEvalError, GenerateError, DataError, *MODEL_DIR_ERRORS))


if __name__ == "__main__":
    main()
