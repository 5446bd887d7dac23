"""The one command-line shape of scripts/: key=value arguments, as the trainer takes its overrides
(`python -m scripts.bench step model=xs rounds=2`, lists as `dims=[1024,4096]`).

A script declares its keys as a dataclass whose fields are `key(default, meaning)`; `parse` checks the
arguments against it (an unknown key or a bad value is one `error: ...` line naming it, exit status 2),
and --help prints the script's docstring, then every key with its default and meaning. A script that
builds a trainer config takes the keys it does not declare as trainer overrides and hands them to
trainer.config.load_config, inside `one_line_errors(ConfigError)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Iterator, NoReturn

from inference.export import HELP_FLAGS, parse_key_values


KEY_WIDTH = 24  # of `key=default` in --help's table


class UsageError(ValueError):
    """A bad argument; one line."""


@dataclasses.dataclass
class NoKeys:
    """The keys of a script that takes none (--help still answers)."""


def key(default: Any, meaning: str, choices: tuple = ()) -> Any:
    """A dataclass field: its default, its one-line meaning for --help and, when given, the values it
    may take (for a list, each element)."""
    metadata = {"meaning": meaning, "choices": tuple(choices)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _shown(value: Any) -> str:
    """A value as it is typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(map(_shown, value))}]"
    return str(value)


def usage(doc: str, schema: type, trainer_overrides: bool = False) -> str:
    rows = []
    for field in dataclasses.fields(schema):
        choices = field.metadata.get("choices")
        meaning = field.metadata.get("meaning", "") + (f" ({' | '.join(map(_shown, choices))})" if choices else "")
        rows.append((f"{field.name}={_shown(_default(field))}", meaning))
    lines = [doc.strip(), "", "keys (key=value, shown with their defaults):" if rows else "keys: none"]
    for left, meaning in rows:
        if len(left) > KEY_WIDTH:  # a long default: its meaning on the next line
            lines += [f"  {left}", f"  {'':<{KEY_WIDTH}}  {meaning}"]
        else:
            lines.append(f"  {left:<{KEY_WIDTH}}  {meaning}")
    if trainer_overrides:
        lines.append("any other key=value is a trainer override (configs/, trainer.config.load_config), "
                     "e.g. train.seq_len=128")
    return "\n".join(lines)


def fail(message: str) -> NoReturn:
    """Bad input: one `error: ...` line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def one_line_errors(*errors: type[Exception]) -> Iterator[None]:
    """A UsageError or one of `errors` inside becomes `fail`'s line."""
    try:
        yield
    except (UsageError, *errors) as error:
        fail(str(error))


def _check_choices(args: Any) -> None:
    for field in dataclasses.fields(args):
        choices = field.metadata.get("choices")
        value = getattr(args, field.name)
        for item in value if isinstance(value, list) else [value]:
            if choices and item not in choices:
                raise UsageError(f"{field.name}={_shown(value)}: {_shown(item)} is not one of "
                                 f"{', '.join(map(_shown, choices))}")


def _one_item_list(arg: str, schema: type) -> str:
    """A list key given one value (seq=4096) is the list of that value (seq=[4096])."""
    name, _, value = arg.partition("=")
    types = {field.name: str(field.type) for field in dataclasses.fields(schema)}
    if types.get(name, "").startswith("list") and not value.startswith("["):
        return f"{name}=[{value}]"
    return arg


def parse(schema: type, doc: str, argv: list[str] | None = None, trainer_overrides: bool = False):
    """argv (default: sys.argv[1:]) -> an instance of `schema`; with trainer_overrides, (that instance,
    the arguments whose keys the schema lacks, in order). --help prints `usage` and exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in HELP_FLAGS for arg in argv):
        print(usage(doc, schema, trainer_overrides))
        sys.exit(0)
    names = [field.name for field in dataclasses.fields(schema)]
    with one_line_errors():
        if argv and not names:
            raise UsageError(f"{argv[0]!r}: this script takes no arguments (--help says what it does)")
        for arg in argv:
            if "=" not in arg:
                raise UsageError(f"argument {arg!r} is not key=value; valid keys: {', '.join(names)} "
                                 "(--help prints them with their meanings)")
        own = [arg for arg in argv if arg.partition("=")[0] in names] if trainer_overrides else argv
        args = parse_key_values([_one_item_list(arg, schema) for arg in own], schema, UsageError)
        _check_choices(args)
    if trainer_overrides:
        return args, [arg for arg in argv if arg not in own]
    return args
