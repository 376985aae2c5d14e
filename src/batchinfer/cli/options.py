"""Flags generated from config dataclasses, so each CLI flag is the field name with dashes."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any

from batchinfer.core.config import BYTE_SIZES, EngineConfig, parse_bytes


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `float` -> float."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0] if args else str
    return annotation


def add_dataclass_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    exclude: tuple[str, ...] = (),
    prefix: str = "",
) -> None:
    """Add `--field-name` for each field of `cls`; defaults stay None so only given flags
    override the dataclass default (read back with `collect_flags`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        base = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if default is not None:
            help_text = f"{help_text} (default: {default})"
        if base is bool:
            parser.add_argument(flag, dest=prefix + f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif f.name in BYTE_SIZES:
            parser.add_argument(flag, dest=prefix + f.name, default=None, help=help_text,
                                type=functools.partial(parse_bytes, f.name))
        elif base in (int, float, str):
            parser.add_argument(flag, dest=prefix + f.name, type=base, default=None, help=help_text)


def collect_flags(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` the user actually gave on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, prefix + f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def add_engine_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    add_dataclass_flags(group, EngineConfig, exclude=exclude)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**collect_flags(args, EngineConfig))


def add_ray_flags(parser: argparse.ArgumentParser, title: str, ray_help: str,
                  what: str) -> Any:
    """`--ray` (`ray_help`) and the flags every `--ray` command shares (`what`: what a replica
    is there); returns the group for the command's own. Check that none was given without
    `--ray` with `refuse_without_ray`, after `end_ray_flags`. Every Ray flag defaults to None:
    the defaults the help names are the Ray integration's own."""
    group = parser.add_argument_group(f"{title} (pip install 'batchinfer[ray]'; "
                                      "docs/scale-out.md)")
    group.add_argument("--ray", action="store_true", help=ray_help)
    group.add_argument("--num-replicas", type=int, default=None,
                       help=f"{what}, each with its own engine (default: 1)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto': the one `ray start` made here); "
                       "default: $RAY_ADDRESS, else start a local one")
    group.add_argument("--ray-cpus-per-replica", type=float, default=None,
                       help="CPUs Ray reserves per replica, also its torch threads (default: "
                       "--num-threads, else 1)")
    return group


def end_ray_flags(parser: argparse.ArgumentParser, group: Any) -> None:
    """Note the flags of `group` (from `add_ray_flags`, with the command's own) as Ray-only."""
    parser.set_defaults(ray_only=tuple(a.dest for a in group._group_actions if a.dest != "ray"))


def refuse_without_ray(args: argparse.Namespace) -> None:
    """`ValueError` for a Ray-only flag given without `--ray`."""
    for name in args.ray_only:
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} needs --ray")
