"""`batchinfer run-batch`: an OpenAI batch file in, its output file out, on this machine.

Two passes over the input, neither holding it whole: the first counts the lines, refuses
duplicate custom_ids before any work and notes which endpoints appear (so only the models
needed are loaded); the second streams the lines through the handler the caller opens for
those models (`run-batch`: the server app built in this process, `server.offline`).
Resuming: lines whose custom_id the output file already holds are skipped (lines without a
valid custom_id: as many as the output already answered), and a last line cut short by a kill
is dropped first. The output is appended to, one flushed line per answer, in input order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchinfer.batch.executor import Handler, LineCounts, retrying, run_lines
from batchinfer.batch.lines import BatchLine, parse_line, peek

logger = logging.getLogger(__name__)
GENERATOR_URLS = frozenset({"/v1/chat/completions", "/v1/completions"})
ENCODER_URLS = frozenset({"/v1/embeddings"})


@dataclass
class InputSurvey:
    """The first pass: line count, endpoints used, duplicate custom_ids."""

    num_lines: int = 0
    urls: set[str] = field(default_factory=set)

    @property
    def needs_generator(self) -> bool:
        return bool(self.urls & GENERATOR_URLS)

    @property
    def needs_encoder(self) -> bool:
        return bool(self.urls & ENCODER_URLS)


# Opens the handler that answers a file's lines, loaded for the models its survey found
# needed, and closes it on exit: the caller's, so this package knows nothing of the server.
OpenHandler = Callable[[InputSurvey], AbstractAsyncContextManager[Handler]]


def survey(path: Path) -> InputSurvey:
    """Count the lines of `path` and the endpoints they name; `ValueError` on a duplicate
    custom_id (both line numbers) or an unreadable file."""
    seen: dict[str, int] = {}
    out = InputSurvey()
    for index, text in lines_of(path):
        out.num_lines += 1
        custom_id, url = peek(text)
        if custom_id is None:
            continue
        if custom_id in seen:
            raise ValueError(f"{path}: custom_id {custom_id!r} appears on lines "
                             f"{seen[custom_id] + 1} and {index + 1}; each must be unique")
        seen[custom_id] = index
        if url is not None:
            out.urls.add(url)
    return out


def lines_of(path: Path) -> Iterator[tuple[int, str]]:
    """(0-based index, text) of the non-blank lines, read lazily."""
    try:
        with open(path, encoding="utf-8") as f:
            index = 0
            for text in f:
                if text.strip():
                    yield index, text
                    index += 1
    except OSError as exc:
        raise ValueError(f"input {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"input {path} is not UTF-8 text ({exc.reason})") from None


@dataclass
class Resume:
    """What an earlier run of the same output already answered."""

    custom_ids: set[str] = field(default_factory=set)
    num_without_id: int = 0  # answers to lines that had no valid custom_id

    @property
    def num_done(self) -> int:
        return len(self.custom_ids) + self.num_without_id

    def merge(self, other: Resume) -> Resume:
        return Resume(self.custom_ids | other.custom_ids,
                      self.num_without_id + other.num_without_id)


def read_resume(path: Path) -> Resume:
    """The answers already in `path`; a last line cut short (no newline, or not JSON) is
    removed from the file so the next answer starts a fresh line."""
    resume = Resume()
    if not path.exists():
        return resume
    good_bytes = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("cut short")
                record = json.loads(raw)
            except ValueError:
                break
            good_bytes += len(raw)
            custom_id = record.get("custom_id")
            if isinstance(custom_id, str):
                resume.custom_ids.add(custom_id)
            else:
                resume.num_without_id += 1
    if good_bytes < path.stat().st_size:
        logger.warning("%s: dropping a last line cut short (%d bytes)", path,
                       path.stat().st_size - good_bytes)
        os.truncate(path, good_bytes)
    return resume


def pending_lines(path: Path, resume: Resume, endpoint: str | None = None
                  ) -> Iterator[BatchLine]:
    """The lines of `path` not answered yet, parsed (`endpoint`: the only url allowed)."""
    for _, line in _pending(path, resume, endpoint):
        yield line


def pending_texts(path: Path, resume: Resume) -> Iterator[tuple[int, str]]:
    """(index, text) of the lines of `path` not answered yet."""
    for text, line in _pending(path, resume, None):
        yield line.index, text


def _pending(path: Path, resume: Resume, endpoint: str | None
             ) -> Iterator[tuple[str, BatchLine]]:
    skip_without_id = resume.num_without_id
    for index, text in lines_of(path):
        line = parse_line(index, text, endpoint)
        if line.custom_id is not None and line.custom_id in resume.custom_ids:
            continue
        if line.custom_id is None and skip_without_id > 0:
            skip_without_id -= 1
            continue
        yield text, line


@dataclass
class BatchRunResult:
    num_lines: int
    skipped: int
    counts: LineCounts
    elapsed_s: float  # answering the lines, after the models loaded
    load_s: float = 0.0


async def answer_file(input_path: Path, output_path: Path, open_handler: OpenHandler,
                      max_in_flight: int = 256, progress: bool = True) -> BatchRunResult:
    """Answer every line of `input_path` into `output_path` (resuming it if it exists) through
    the handler `open_handler(survey)` opens; it is not opened when no line needs a model
    (nothing left to answer, or only lines that cannot run)."""
    found = survey(input_path)
    resume = read_resume(output_path)
    remaining = found.num_lines - resume.num_done
    start_s = time.perf_counter()
    if remaining <= 0 or not (found.needs_generator or found.needs_encoder):
        # Nothing to load: every line left (if any) is rejected before it could run.
        counts = await _run(None, input_path, output_path, resume, remaining, max_in_flight,
                            progress)
        return BatchRunResult(found.num_lines, resume.num_done, counts,
                              time.perf_counter() - start_s)
    async with open_handler(found) as handler:
        load_s = time.perf_counter() - start_s
        counts = await _run(handler, input_path, output_path, resume, remaining,
                            max_in_flight, progress)
    return BatchRunResult(found.num_lines, resume.num_done, counts,
                          time.perf_counter() - start_s - load_s, load_s)


async def _run(handler: Handler | None, input_path: Path, output_path: Path, resume: Resume,
               remaining: int, max_in_flight: int, progress: bool) -> LineCounts:
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    async def no_model(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
        raise AssertionError("a valid line needs a model")  # unreachable: survey saw no url

    bar = tqdm(total=max(0, remaining), unit="req", disable=not progress, dynamic_ncols=True)
    start_s = time.perf_counter()
    tokens = 0
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:

        def write(line: BatchLine, result: dict[str, Any]) -> None:
            nonlocal tokens
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
            out.flush()
            usage = (result["response"]["body"] or {}).get("usage") or {}
            tokens += int(usage.get("completion_tokens") or 0)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(1e-9, time.perf_counter() - start_s):.1f} tok/s",
                                refresh=False)

        try:
            send = retrying(handler, asyncio.Event()) if handler is not None else no_model
            return await run_lines(pending_lines(input_path, resume), send, write,
                                   max_in_flight)
        finally:
            bar.close()
