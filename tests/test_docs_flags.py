"""Every `--flag` the README and docs/ name exists: on a `batchinfer` command or a benchmark
script. A flag renamed or removed in code must leave the docs too."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from batchinfer.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# Lines of other tools' commands (`ray start --head`): their flags are not ours.
OTHER_TOOLS = re.compile(r"\s*(ray|pip) ")


def cli_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= cli_flags(sub)
    return flags


def benchmark_flags() -> set[str]:
    flags: set[str] = set()
    for script in (ROOT / "benchmarks").glob("*.py"):
        for match in re.finditer(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", script.read_text()):
            flags.add(match.group(1))
    # BooleanOptionalAction flags also have their --no- form.
    return flags | {f"--no-{f[2:]}" for f in flags}


def test_every_documented_flag_exists() -> None:
    known = cli_flags(build_parser()) | benchmark_flags()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {
        f"{page.relative_to(ROOT)}: {flag}"
        for page in pages
        for line in page.read_text().splitlines() if not OTHER_TOOLS.match(line)
        for flag in FLAG.findall(line)
        if flag not in known
    }
    assert not missing, sorted(missing)
