"""`read_json`: a model folder's JSON file (config.json, modules.json, ...), checked.

Every error is a `ValueError` naming the file, so a broken model folder is one line for the
user (HTTP 400 / CLI exit 2), never a `JSONDecodeError` traceback.
"""

from __future__ import annotations

import json
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
