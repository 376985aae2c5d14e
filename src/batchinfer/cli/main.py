"""Entry point of the `batchinfer` console script."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules; each defines `register(subparsers)` which adds its parser and sets
# `func(args) -> int` as the default handler.
SUBCOMMANDS = ("generate", "serve", "embed", "run-batch", "bench", "tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchinfer", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module_name = f"batchinfer.cli.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from batchinfer.cli.config_file import expand_config

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(parser, argv)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        # Bad input (a flag value, a file, a model path): one line, exit code 2, no traceback.
        print(f"batchinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
