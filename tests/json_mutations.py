"""Seeded mutations of a valid JSON document, for property tests of the readers of our own files.

A reader of a file we wrote (a checkpoint's meta.json, a prepared dataset's manifest, an export's
config.json) must answer any damage or edit with its own one-line error or a fallback, never another
exception. These generators turn one valid document into many invalid ones, the same ones for a seed:

  mutated_documents(document, seed, count)  (what, document): one value of the tree replaced (wrong type,
                                            missing, huge or negative, NaN/inf, nested garbage), a key
                                            deleted or added, or the whole document replaced
  mutated_bytes(data, seed, count)          (what, bytes): one bit flipped, or the file truncated
  dumps(document)                           the bytes a mutated document is written as (NaN and inf as
                                            the NaN/Infinity literals Python's json reads back)

A test writes each case, resealing whatever checksum the file carries when it means to test the content
rather than the damage, and calls the reader.
"""
from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Iterator

# Values that are wrong for most fields: other types, empty containers, edge and out-of-range numbers.
GARBAGE = ("abc", "", "1", "-1", "nan", 0, -1, -100, 1, 2 ** 31, 2 ** 45, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30,
           0.5, -0.5, 1e308, -1e308, 1e-320, math.nan, math.inf, -math.inf, True, False, None, [], {}, [None],
           [1, "x", None], {"": None}, {"nested": {"deeper": [math.nan, {"x": -1}, "y" * 40]}})

KeyPath = tuple  # keys (str) and list indices (int) from the root


def dumps(document: Any) -> bytes:
    return json.dumps(document).encode()


def _paths(value: Any, path: KeyPath = ()) -> Iterator[KeyPath]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _at(document: Any, path: KeyPath) -> Any:
    for part in path:
        document = document[part]
    return document


def _name(path: KeyPath) -> str:
    return ".".join(map(str, path)) or "<root>"


def _near(value: Any, rng: random.Random) -> list:
    """Wrong values close to `value`: off by one, negated, scaled far up, the right number as a string."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower()]
    if isinstance(value, int):
        return [value + 1, value - 1, -value - 1, value * 2 ** 40 + 1, str(value), float(value) + 0.5]
    if isinstance(value, float):
        return [-value, value * 1e300, str(value), math.nan]
    if isinstance(value, str):
        return [value + "x", value[: len(value) // 2], value.upper(), len(value)]
    if isinstance(value, list):
        return [value[:-1], [*value, rng.choice(GARBAGE)], list(reversed(value)), {str(i): v for i, v in enumerate(value)}]
    if isinstance(value, dict):
        return [list(value.values()), {}]
    return []


def _mutate(document: Any, rng: random.Random) -> tuple[str, Any]:
    mutated = copy.deepcopy(document)
    path = rng.choice(list(_paths(mutated)))
    current = _at(mutated, path)
    kinds = ["replace", "near"] + (["delete"] if path else []) + (["add"] if isinstance(current, dict) else [])
    kind = rng.choice(kinds)
    if kind == "add":
        key = rng.choice(["extra", "", "step", "x" * 3, "__class__"])
        while key in current:
            key += "_"
        current[key] = rng.choice(GARBAGE)
        return f"added {_name((*path, key))}", mutated
    if kind == "delete":
        parent = _at(mutated, path[:-1])
        del parent[path[-1]]
        return f"deleted {_name(path)}", mutated
    choices = _near(current, rng) if kind == "near" else []
    new = copy.deepcopy(rng.choice(choices or GARBAGE))
    if not path:
        return f"document -> {new!r}", new
    _at(mutated, path[:-1])[path[-1]] = new
    return f"{_name(path)}: {current!r:.60} -> {new!r:.60}", mutated


def mutated_documents(document: Any, seed: int, count: int) -> Iterator[tuple[str, Any]]:
    """`count` mutations of `document` (unchanged itself), each one change that alters its JSON, described;
    the same for a seed."""
    rng = random.Random(seed)
    original = dumps(document)
    for _ in range(count):
        what, mutated = _mutate(document, rng)
        while dumps(mutated) == original:  # e.g. a one-element list reversed
            what, mutated = _mutate(document, rng)
        yield what, mutated


def mutated_bytes(data: bytes, seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    """`count` damaged copies of `data`: one bit flipped (most cases) or the file cut short."""
    rng = random.Random(seed)
    for _ in range(count):
        if rng.random() < 0.2:
            size = rng.randrange(len(data))
            yield f"truncated to {size} of {len(data)} bytes", data[:size]
            continue
        damaged = bytearray(data)
        position, bit = rng.randrange(len(data)), rng.randrange(8)
        damaged[position] ^= 1 << bit
        yield f"bit {bit} of byte {position} flipped", bytes(damaged)
