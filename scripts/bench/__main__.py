"""The benchmarks, one command: python -m scripts.bench NAME [key=value ...]

    python -m scripts.bench --help          the benchmarks, one line each
    python -m scripts.bench NAME --help     one benchmark: what it measures, its keys and their defaults
    torchrun --nproc-per-node 2 -m scripts.bench pp [key=value ...]     the multi-process ones
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

from inference.export import HELP_FLAGS

# Cheapest first: one process, then several, then the GPU's and the data preparation's.
BENCHES = ("step", "train", "memory", "checkpoint", "inference", "pp", "context", "tp_prefill", "tp_dtensor",
           "host_memory", "export_import", "gloo_staging", "kernels", "prepare")


def summary(name: str) -> str:
    """The first line of the benchmark's docstring, read without importing it (the listing stays fast)."""
    source = (Path(__file__).parent / f"{name}.py").read_text()
    return ast.get_docstring(ast.parse(source)).splitlines()[0]


def listing() -> str:
    width = max(map(len, BENCHES))
    return "\n".join([__doc__.strip(), ""] + [f"  {name:<{width}}  {summary(name)}" for name in BENCHES])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in HELP_FLAGS:
        print(listing())
        return
    if not argv or argv[0] not in BENCHES:
        given = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"error: {given}; valid: {', '.join(BENCHES)} (--help: one line each)", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"scripts.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main()
