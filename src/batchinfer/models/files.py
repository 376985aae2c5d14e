"""`read_json`: a model folder's JSON file (config.json, modules.json, ...), checked; and
`write_cache_json`, how the measured choices cached on this machine are written.

Every error is a `ValueError` naming the file, so a broken model folder is one line for the
user (HTTP 400 / CLI exit 2), never a `JSONDecodeError` traceback.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any


def read_json(path: Path, *, required: bool = True, expect: type = dict) -> Any:
    """The JSON value in `path`, which must be an `expect` (`dict`: an object, `list`: an array).

    A missing file is a `ValueError` when `required`, else an empty `expect()`; an unreadable
    file, malformed JSON or a value of another type is a `ValueError` naming the file.
    """
    if not path.is_file():
        if required:
            raise ValueError(f"{path.parent}: {path.name} is missing")
        return expect()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot parse ({exc})") from exc
    if not isinstance(data, expect):
        raise ValueError(f"{path}: expected a JSON {'array' if expect is list else 'object'}, "
                         f"got {type(data).__name__}")
    return data


def write_cache_json(path: Path, data: Any, what: str) -> None:
    """Write `data` to `path` atomically (a temporary file per writer, then renamed: a reader
    never sees a torn file). A cache that cannot be written costs a measurement next time,
    nothing more: the failure is a warning naming `what`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logging.getLogger(__name__).warning("could not cache %s in %s: %s", what, path, exc)
