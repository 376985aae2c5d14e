"""`batchinfer embed`: texts (JSONL or plain lines) -> vectors (JSONL), offline, input order.

Texts are tokenized, sorted by length inside each window, run in token-budgeted batches and
written back in input order, one JSON object a line: `{"index": i, "embedding": [...]}` (plus
the input's `id` when it had one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from batchinfer.core.config import DEVICES, ENCODER_QUANTIZATIONS
from batchinfer.core.validation import check_choice, check_int

INPUT_FORMATS = ("auto", "jsonl", "text")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "embed", help="embed texts offline (JSONL in, JSONL out)",
        description="Embed texts with a sentence encoder; output keeps the input order.")
    io = parser.add_argument_group("input/output")
    io.add_argument("--input", required=True,
                    help="JSONL (a string, or an object with --text-field, per line) or a .txt "
                    "file (one text per line); '-' reads stdin")
    io.add_argument("--output", required=True, help="JSONL of vectors; '-' writes stdout")
    io.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                    help="auto: .txt files are text, anything else JSONL (default: auto)")
    io.add_argument("--text-field", default="text",
                    help="field holding the text in JSONL objects (default: text)")
    io.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="show a progress bar on stderr (default: on)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="default",
                       help="'default' (embedded all-MiniLM-L6-v2), a local Hugging Face "
                       "folder or a hub id such as sentence-transformers/all-MiniLM-L6-v2 "
                       "(fetched into the hub cache; HF_HUB_OFFLINE=1: the cache only) "
                       "(default: default)")
    model.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="auto: bfloat16 where the hardware has fast bf16, else float32 "
                       "(default: auto)")
    model.add_argument("--device", default="auto", choices=DEVICES,
                       help="default: auto (cuda if present)")
    model.add_argument("--max-length", type=int, default=None,
                       help="longest input in tokens (default: the model's)")
    model.add_argument("--quantization", default="none", choices=ENCODER_QUANTIZATIONS,
                       help="int8 (per output channel) or q8 (8-bit in groups of 32, native CPU "
                       "kernels): 8-bit weights where the probe sentences' vectors stay within "
                       "cosine 0.999 of float32's, else float32 with a warning (default: none)")
    model.add_argument("--truncate", action="store_true",
                       help="cut texts longer than --max-length instead of failing")
    batching = parser.add_argument_group("batching")
    batching.add_argument("--batch-size", type=int, default=64,
                          help="most texts in one batch (default: 64)")
    batching.add_argument("--max-batch-tokens", type=int, default=8192,
                          help="padded tokens (longest x count) in one batch (default: 8192)")
    batching.add_argument("--sort-window", type=int, default=4096,
                          help="texts sorted by length together; bounds memory (default: 4096)")
    batching.add_argument("--num-workers", type=int, default=1,
                          help="batches run at once, each in its own thread (default: 1)")
    batching.add_argument("--num-threads", type=int, default=None,
                          help="torch CPU threads per process (default: torch's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Embed `args.input` into `args.output`; `ValueError` for bad flags or input."""
    from batchinfer.batching.embedding_service import EmbeddingConfig, embed_offline

    for name in ("batch_size", "max_batch_tokens", "sort_window", "num_workers"):
        check_int(name, getattr(args, name))
    if args.num_threads is not None:
        check_int("num_threads", args.num_threads)
    ids, texts = read_texts(args.input, args.input_format, args.text_field)
    if not texts:
        raise ValueError(f"input {args.input!r} holds no texts")
    config = EmbeddingConfig(model=args.model, dtype=args.dtype, device=args.device,
                             max_length=args.max_length, quantization=args.quantization)
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    encoder = config.load_encoder()
    start_s = time.perf_counter()
    vectors = embed_offline(encoder, texts, batch_size=args.batch_size,
                            max_batch_tokens=args.max_batch_tokens, sort_window=args.sort_window,
                            truncate=args.truncate, progress=args.progress,
                            num_workers=args.num_workers)
    with _open_output(args.output) as out:
        count = write_vectors(out, vectors, ids)
    elapsed_s = time.perf_counter() - start_s
    weights = "" if encoder.quantization == "none" else f", {encoder.quantization} weights"
    print(f"embedded {count} texts with {encoder.name} ({encoder.dtype}{weights}) in {elapsed_s:.2f} s "
          f"({count / elapsed_s:.1f} texts/s) -> {args.output}", file=sys.stderr)
    return 0


def read_texts(path: str, input_format: str = "auto",
               text_field: str = "text") -> tuple[list[Any], list[str]]:
    """(ids, texts) from a JSONL or text file; ids are `None` where the input had none."""
    check_choice("input_format", input_format, INPUT_FORMATS)
    if input_format == "auto":
        input_format = "text" if path.endswith(".txt") else "jsonl"
    if path != "-" and not Path(path).is_file():
        raise ValueError(f"input {path!r} is not a file")
    ids: list[Any] = []
    texts: list[str] = []
    with _open_input(path) as f:
        for line_number, line in enumerate(f, start=1):
            record_id, text = _parse_line(line, line_number, input_format, text_field)
            if text is None:
                continue
            ids.append(record_id)
            texts.append(text)
    return ids, texts


def _parse_line(line: str, line_number: int, input_format: str,
                text_field: str) -> tuple[Any, str | None]:
    where = f"input line {line_number}"
    if input_format == "text":
        text = line.rstrip("\n")
        if not text.strip():
            raise ValueError(f"{where} is empty")
        return None, text
    if not line.strip():
        return None, None  # blank lines separate nothing in JSONL
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc.msg}") from None
    if isinstance(record, dict):
        if text_field not in record:
            raise ValueError(f"{where} has no {text_field!r} field")
        record_id, text = record.get("id"), record[text_field]
    else:
        record_id, text = None, record
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: the text must be a non-empty string, got {text!r}")
    return record_id, text


def write_vectors(out: IO[str], vectors: Iterator[Any], ids: list[Any]) -> int:
    """One JSON line per vector, in input order; returns how many were written."""
    count = 0
    for index, (record_id, vector) in enumerate(zip(ids, vectors, strict=True)):
        row: dict[str, Any] = {"index": index}
        if record_id is not None:
            row["id"] = record_id
        row["embedding"] = vector.tolist()
        out.write(json.dumps(row) + "\n")
        count += 1
    return count


@contextlib.contextmanager
def _open_input(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdin
    else:
        with open(path, encoding="utf-8") as f:
            yield f


@contextlib.contextmanager
def _open_output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    if target.parent and not target.parent.is_dir():
        raise ValueError(f"output directory {str(target.parent)!r} does not exist")
    # Write to a temporary name and rename, so a failed run leaves no half-written file.
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            yield f
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
