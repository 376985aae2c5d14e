"""What a constrained request's output must match, as plain data: a JSON schema, any JSON
object, a regular expression, one of a list of strings, an EBNF grammar, or a structural tag
(xgrammar's composition of literal text, free text, triggers and JSON schemas: the form tool
calls take in a model's own syntax).

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

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
# JSON Schema keywords the grammar engine (xgrammar 0.2.9) would not enforce: a schema that uses
# them is refused, since its output could break them. (`oneOf` is generated as `anyOf`: exact
# where the alternatives exclude each other, as a discriminated union's do.)
UNENFORCED_KEYWORDS = frozenset({
    "contains", "minContains", "maxContains", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
})
# String formats it does not check (other names are annotations, as JSON Schema has them).
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = frozenset({"additionalProperties", "items", "additionalItems", "propertyNames",
                        "unevaluatedProperties"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one of the fields is set; a bad value raises `ValueError` naming the field.

    `json_schema`: a JSON Schema (a dict, or a string holding a JSON object), kept as compact
    JSON text. `json_object`: any JSON object. `regex`: the whole output matches this regular
    expression. `choice`: the output is exactly one of these strings. `grammar`: an EBNF grammar
    (GBNF, llama.cpp's dialect, as xgrammar reads it) whose `root` rule the output matches.
    `structural_tag`: an xgrammar structural tag (`{"type": "structural_tag", "format": ...}`,
    a dict or JSON text), kept as compact JSON text; its JSON schemas are checked as
    `json_schema` is.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _tag_text(self.structural_tag))
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
    _check_keywords(schema, "")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_output.json_schema cannot be written as JSON: {exc}") \
            from None


def _tag_text(tag: object) -> str:
    """A structural tag (dict or JSON text) as compact JSON text, its schemas checked."""
    name = "structured_output.structural_tag"
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(tag, Mapping) or tag.get("type") != "structural_tag" \
            or not isinstance(tag.get("format"), Mapping):
        raise ValueError(f'{name} must be an object {{"type": "structural_tag", "format": '
                         '{...}}')
    for schema, where in _tag_schemas(tag["format"], "format"):
        try:
            _check_keywords(schema, "")
        except ValueError as exc:
            raise ValueError(str(exc).replace("structured_output.json_schema",
                                              f"{name} ({where})")) from None
    try:
        return json.dumps(tag, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} cannot be written as JSON: {exc}") from None


def _tag_schemas(node: object, where: str) -> list[tuple[object, str]]:
    """The `json_schema` formats inside a structural tag's format tree, with their paths."""
    if isinstance(node, list):
        return [found for i, item in enumerate(node) for found in _tag_schemas(item, f"{where}[{i}]")]
    if not isinstance(node, Mapping):
        return []
    if node.get("type") == "json_schema":
        return [(node.get("json_schema"), where)]
    return [found for key, value in node.items() for found in _tag_schemas(value, f"{where}.{key}")]


def _check_keywords(schema: object, where: str) -> None:
    """`ValueError` naming the first keyword (and where it is) that the output could break."""
    if not isinstance(schema, Mapping):
        return  # true / false, or a malformed value the compiler will name
    at = f" (at {where.lstrip('.')})" if where else ""
    for keyword, value in schema.items():
        refused = keyword in UNENFORCED_KEYWORDS or (keyword == "uniqueItems" and value is True) \
            or (keyword == "allOf" and isinstance(value, list) and len(value) > 1)
        if keyword == "format" and value in UNENFORCED_FORMATS:
            raise ValueError(f"structured_output.json_schema: format {value!r}{at} is not "
                             "supported: the output could not be guaranteed to match it")
        if keyword in ("pattern", "format") and ({"minLength", "maxLength"} & set(schema)):
            raise ValueError(f"structured_output.json_schema: minLength / maxLength beside "
                             f"{keyword}{at} is not supported: the grammar would follow the "
                             f"{keyword} alone (bound the length inside a pattern instead)")
        if refused:
            what = "allOf with more than one schema" if keyword == "allOf" else keyword
            raise ValueError(f"structured_output.json_schema: {what}{at} is not supported: "
                             "the output could not be guaranteed to satisfy it")
        if keyword in _SUBSCHEMA:
            _check_keywords(value, f"{where}.{keyword}")
        elif keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                _check_keywords(item, f"{where}.{keyword}[{i}]")
        elif keyword in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            for name, item in value.items():
                _check_keywords(item, f"{where}.{keyword}.{name}")


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
        raise ValueError("structured_output.choice must be a non-empty list of strings, got "
                         f"{choice!r}")
    for item in choice:
        if not isinstance(item, str) or not item:
            raise ValueError("structured_output.choice must hold non-empty strings, got "
                             f"{item!r}")
    return tuple(choice)
