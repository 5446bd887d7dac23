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
  mutated_arrays(array, seed, count)        (what, array): an integer array (an index) with one entry set
                                            out of range, negative or to a neighbour's value, entries
                                            swapped, zeroed, cut short or extended, or another dtype or shape

A test writes each case, resealing whatever checksum the file carries when it means to test the content
rather than the damage, and calls the reader.
"""
from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Iterator

import numpy as np

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


def _mutate_array(array: np.ndarray, rng: random.Random) -> tuple[str, np.ndarray]:
    mutated = np.array(array)
    flat = mutated.reshape(-1)
    kind = rng.choice(["entry", "entry", "entry", "swap", "zeroed", "cut", "extended", "dtype", "shape"])
    if kind == "entry" and flat.size:
        position = rng.randrange(flat.size)
        limit = int(np.iinfo(flat.dtype).max)
        value = rng.choice([-1, int(flat.max()) + 1, limit, 0, int(flat[rng.randrange(flat.size)]), int(flat[position]) + 1])
        flat[position] = np.array(value).astype(flat.dtype)  # wraps a negative into an unsigned dtype
        return f"entry {position}: {int(array.reshape(-1)[position])} -> {int(flat[position])}", mutated
    if kind == "swap" and flat.size > 1:
        i, j = rng.sample(range(flat.size), 2)
        flat[i], flat[j] = flat[j], flat[i]
        return f"entries {i} and {j} swapped", mutated
    if kind == "zeroed":
        return "zeroed", np.zeros_like(array)
    if kind == "cut" and len(array):
        size = rng.randrange(len(array))
        return f"cut to {size} of {len(array)} rows", mutated[:size]
    if kind == "extended":
        return "one row repeated at the end", np.concatenate([mutated, mutated[-1:]]) if len(mutated) else mutated[:0]
    if kind == "dtype":
        dtype = rng.choice([np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.float32, np.float64])
        return f"as {np.dtype(dtype).name}", mutated.astype(dtype)
    return "flattened" if mutated.ndim > 1 else "as a column", mutated.reshape(-1) if mutated.ndim > 1 else mutated[:, None]


def mutated_arrays(array: np.ndarray, seed: int, count: int) -> Iterator[tuple[str, np.ndarray]]:
    """`count` damaged copies of an integer `array`, each one change that alters its .npy bytes, described;
    the same for a seed."""
    rng = random.Random(seed)
    for _ in range(count):
        what, mutated = _mutate_array(array, rng)
        while mutated.dtype == array.dtype and mutated.shape == array.shape and np.array_equal(mutated, array):
            what, mutated = _mutate_array(array, rng)
        yield what, mutated
