"""scripts/cli.py, the one command-line shape of scripts/: every script and every benchmark answers --help
with its keys and exit status 0, and refuses an unknown key (or, for scripts.compare, a bad value) in one line
naming it (exit status 2)."""
import contextlib
import importlib
import io
import pkgutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import scripts
import scripts.gpu_checks
from scripts.bench.__main__ import BENCHES
from scripts.bench.__main__ import main as bench_main
from scripts.cli import key, parse

REPO = Path(__file__).resolve().parents[2]
# scripts.compare hands a key it does not declare to every run's trainer config, which only the whole
# experiment's plan checks; its one-line refusal here is of a bad value of its own key.
BAD_ARGUMENT = {"scripts.compare": "shard=x"}
SCRIPTS = sorted(f"{package.__name__}.{info.name}" for package in (scripts, scripts.gpu_checks)
                 for info in pkgutil.iter_modules(package.__path__) if not info.ispkg
                 and hasattr(importlib.import_module(f"{package.__name__}.{info.name}"), "main"))
COMMANDS = [(name, importlib.import_module(name).main, []) for name in SCRIPTS] + \
    [(f"scripts.bench {name}", bench_main, [name]) for name in BENCHES]


def run(main, argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv) or 0
        except SystemExit as exited:
            code = exited.code
    return code, out.getvalue(), err.getvalue()


def test_every_script_with_a_main_is_checked():
    assert {"scripts.compare", "scripts.prepare_data", "scripts.plan_memory", "scripts.kernel_report", "scripts.reskip",
            "scripts.gpu_checks.run", "scripts.gpu_checks.grouped_mm"} <= set(SCRIPTS)


@pytest.mark.parametrize("name, main, prefix", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_help_lists_the_keys_and_an_unknown_key_is_one_line(name, main, prefix):
    code, out, _ = run(main, [*prefix, "--help"])
    assert code == 0 and "keys" in out, (name, out[-500:])
    bad = BAD_ARGUMENT.get(name, "no_such_key=1")
    code, out, err = run(main, [*prefix, bad])
    assert code == 2 and bad.partition("=")[0] in err and len(err.strip().splitlines()) == 1, (name, err)


@pytest.mark.slow
def test_bench_help_lists_every_benchmark_in_one_line_each():
    listed = subprocess.run([sys.executable, "-m", "scripts.bench", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert listed.returncode == 0, listed.stderr
    modules = {path.stem for path in (REPO / "scripts" / "bench").glob("*.py")} - {"__init__", "__main__", "common"}
    assert set(BENCHES) == modules
    rows = [line.split() for line in listed.stdout.splitlines() if line.startswith("  ") and line.split()[0] in BENCHES]
    assert [row[0] for row in rows] == list(BENCHES)
    assert run(bench_main, ["nonesuch"])[2].startswith("error: unknown benchmark 'nonesuch'; valid: step, train")


@dataclass
class Example:
    seq: list[int] = key([2048], "lengths")
    mode: str = key("off", "a mode", choices=("off", "on"))
    text: str | None = key(None, "taken verbatim")


@pytest.mark.parametrize("argv, expected", [
    (["seq=4096"], Example(seq=[4096])),
    (["seq=[1,2]", "mode=on", "text=a: b"], Example(seq=[1, 2], mode="on", text="a: b")),
])
def test_parse_reads_lists_choices_and_verbatim_text(argv, expected):
    assert parse(Example, "doc", argv) == expected


@pytest.mark.parametrize("argv, message", [
    (["mode=maybe"], "error: mode=maybe: maybe is not one of off, on\n"),
    (["seq=x"], "error: seq[0]: Value 'x' of type 'str' could not be converted to Integer\n"),
    (["--seq", "4"], "error: argument '--seq' is not key=value; valid keys: seq, mode, text (--help prints them "
                     "with their meanings)\n"),
])
def test_bad_values_are_one_line(argv, message):
    assert run(lambda a: parse(Example, "doc", a), argv) == (2, "", message)


def test_trainer_overrides_pass_through_in_order():
    assert parse(Example, "doc", ["train.seq_len=8", "mode=on", "model=xs"], trainer_overrides=True) == (
        Example(mode="on"), ["train.seq_len=8", "model=xs"])
