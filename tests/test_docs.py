"""The README's configuration table must list every engine knob, with its CLI flag name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from batchinfer.cli.main import build_parser
from batchinfer.core.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def test_readme_lists_every_engine_flag_that_the_cli_accepts():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    serve_flags = {opt for a in subparsers["serve"]._actions for opt in a.option_strings}
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        assert f"`{flag}`" in readme, f"README misses {flag}"
        assert flag in serve_flags, f"batchinfer serve has no {flag}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make serve" in first_block and "make test" in first_block
