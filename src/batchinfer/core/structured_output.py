"""What a constrained request's output must match, as plain data: a JSON schema, any JSON
object, a regular expression, one of a list of strings, or an EBNF grammar.

This is only the specification; the grammar engine that compiles it and masks the logits lives
in the runner layer (`runner/structured.py`). A spec is frozen and hashable, so the compiled
grammar is cached per distinct spec: a JSON schema given as a dict is kept as compact JSON text
(keys in their given order: properties are generated in the schema's order), so two requests
with the same schema share one compiled grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one of the fields is set; a bad value raises `ValueError` naming the field.

    `json_schema`: a JSON Schema (a dict, or a string holding a JSON object), kept as compact
    JSON text. `json_object`: any JSON object. `regex`: the whole output matches this regular
    expression. `choice`: the output is exactly one of these strings. `grammar`: an EBNF grammar
    (GBNF, llama.cpp's dialect, as xgrammar reads it) whose `root` rule the output matches.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_output.json_object must be true or false, got "
                             f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set: one of `KINDS`."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """`json_schema` as a dict (None for the other kinds)."""
        return json.loads(self.json_schema) if self.json_schema is not None else None


def _schema_text(schema: object) -> str:
    """A schema dict or JSON text as compact JSON text; `ValueError` unless a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_output.json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise ValueError("structured_output.json_schema must be a JSON object, got "
                         f"{type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_output.json_schema cannot be written as JSON: {exc}") \
            from None


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
        raise ValueError("structured_output.choice must be a non-empty list of strings, got "
                         f"{choice!r}")
    for item in choice:
        if not isinstance(item, str) or not item:
            raise ValueError("structured_output.choice must hold non-empty strings, got "
                             f"{item!r}")
    return tuple(choice)
