"""The data of the task YAMLs beside this file, read from the jsonl files next to them.

`dataset_path: json` with `dataset_kwargs.data_files` would hand the paths to datasets.load_dataset, which
resolves them against the working directory: the tasks would run only from the repository root. lm_eval
imports `!function` modules from the YAML's own directory, so this loader resolves them against that instead
(and, reading the files itself, writes nothing to the datasets cache and never asks the hub).
"""
from __future__ import annotations

import json
from pathlib import Path

import datasets

TASK_DIR = Path(__file__).resolve().parent


def read_rows(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def load_jsonl(data_files: dict[str, str], **task_metadata) -> datasets.DatasetDict:
    """custom_dataset of these tasks: {split: jsonl file relative to this directory} -> the splits.
    lm_eval also passes the task's metadata (its version), which the data does not depend on."""
    return datasets.DatasetDict({split: datasets.Dataset.from_list(read_rows(TASK_DIR / name))
                                 for split, name in data_files.items()})
