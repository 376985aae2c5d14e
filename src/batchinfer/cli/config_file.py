"""`--config FILE`: a YAML or JSON mapping whose keys are a command's flag names (dashes or
underscores, without the leading `--`), as vLLM's `--config`. The file's values become flags
placed before the command line's own, so a flag given on the command line wins.

    # serve.yaml
    model: default
    max-num-seqs: 32
    enable_prefix_caching: false
    goodput: [ttft:500, tpot:100]     # a flag taking several values: a list
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--config FILE` replaced by the flags it holds (right after the command
    name, before the other flags); `ValueError` naming a bad file or key."""
    path, rest = _take_config(argv)
    if path is None:
        return argv
    # Descend through the command words (`bench serve`) to the parser that owns the flags.
    words = 0
    sub = parser
    while words < len(rest):
        child = _subparser(sub, rest[words])
        if child is None:
            break
        sub, words = child, words + 1
    given = {item.split("=", 1)[0] for item in rest[words:] if item.startswith("--")}
    flags = config_flags(sub, load_config(path), path, given)
    return [*rest[:words], *flags, *rest[words:]]


def _is_config_flag(item: str) -> bool:
    """`--config` or an abbreviation argparse would accept for it (`--conf`)."""
    name = item.split("=", 1)[0]
    return len(name) >= len("--conf") and CONFIG_FLAG.startswith(name)


def _take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    rest: list[str] = []
    path: str | None = None
    items = iter(argv)
    for item in items:
        if item == "--":  # what follows is not flags
            rest += [item, *items]
            break
        if _is_config_flag(item) and "=" not in item:
            path = next(items, None)
            if path is None:
                raise ValueError(f"{CONFIG_FLAG} needs a file")
        elif _is_config_flag(item):
            path = item.split("=", 1)[1]
        else:
            rest.append(item)
    return path, rest


def _subparser(parser: argparse.ArgumentParser, word: str
               ) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and word in action.choices:
            sub: argparse.ArgumentParser = action.choices[word]
            return sub
    return None


def load_config(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (or JSON, a subset of YAML) file."""
    import yaml  # type: ignore[import-untyped]

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path} is not valid YAML or JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FLAG} {path} must hold a mapping of flag names to values")
    return data


def config_flags(parser: argparse.ArgumentParser, data: dict[str, Any],
                 source: str | Path = "the config", given: set[str] | None = None) -> list[str]:
    """The command-line flags that say what `data` says, but for those the command line
    `given` already has (in any of their spellings): the command line wins."""
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).strip().removeprefix("--").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or flag == CONFIG_FLAG:
            raise ValueError(f"{CONFIG_FLAG} {source}: unknown key {key!r} (no flag {flag})")
        if given and given & set(action.option_strings):
            continue
        out += _as_flags(flag, action, value, source)
    return out


def _as_flags(flag: str, action: argparse.Action, value: Any, source: str | Path) -> list[str]:
    where = f"{CONFIG_FLAG} {source}: {flag}"
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        # The key names the switch itself (`no-plots: true` gives --no-plots).
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(action, argparse._AppendAction):  # given once per value
        values = value if isinstance(value, list) else [value]
        return [f"{flag}={_text(v, where)}" for v in values]
    if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
        values = value if isinstance(value, list) else [value]
        return [flag, *(_text(v, where) for v in values)]
    if isinstance(value, list | dict):
        raise ValueError(f"{where} takes one value, got {value!r}")
    return [f"{flag}={_text(value, where)}"]  # `=`: a value may start with "--"


def _text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        raise ValueError(f"{where}: {value!r} is not a single value")
    return str(value)
