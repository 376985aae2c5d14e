"""`batchinfer run-batch`: answer an OpenAI batch file (JSONL) offline, in input order,
resumable (see `batchinfer.batch.offline`; the server app it runs the lines through is built
by `batchinfer.server.offline`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from batchinfer.cli.options import (
    add_engine_flags,
    add_ray_flags,
    collect_flags,
    end_ray_flags,
    refuse_without_ray,
)
from batchinfer.core.config import EngineConfig
from batchinfer.core.validation import check_int


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="answer an OpenAI batch file offline (JSONL in, JSONL out)",
        description="Each input line is {custom_id, method, url, body} for /v1/chat/completions, "
        "/v1/completions or /v1/embeddings; each output line is OpenAI's {id, custom_id, "
        "response: {status_code, request_id, body}, error}, in input order. Rerun with the same "
        "output to resume: answered custom_ids are skipped.")
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the answers go; appended to (resumed) if it exists")
    parser.add_argument("--max-in-flight", type=int, default=256,
                        help="most lines between start and written answer (default: 256)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name lines' `model` must give (also accepted: 'default' and "
                        "--model's value; default: the model's own name)")
    parser.add_argument("--embedding-model", default=None,
                        help="encoder for /v1/embeddings lines (default: the embedded one)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bar on stderr (default: on)")
    ray = add_ray_flags(parser, "Ray Data", "answer the lines on a pool of engine actors with "
                        "Ray Data", "actors in the pool")
    ray.add_argument("--lines-per-batch", type=int, default=None,
                     help="lines handed to an actor at once; a failed actor's batch is retried "
                     "whole (default: --max-in-flight)")
    end_ray_flags(parser, ray)
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchinfer.server.offline import run_batch_file

    check_int("max_in_flight", args.max_in_flight)
    config = EngineConfig.from_kwargs(**collect_flags(args, EngineConfig))
    if args.ray:
        from batchinfer.integrations.ray_cluster import require_ray

        require_ray()
        from batchinfer.integrations.ray_data import run_batch_ray

        result = run_batch_ray(
            Path(args.input_file), Path(args.output_file), config, args.embedding_model,
            args.max_in_flight, args.progress, args.served_model_name, args.num_replicas or 1,
            args.ray_cpus_per_replica, args.ray_address, args.lines_per_batch)
        loaded = f"on {args.num_replicas or 1} Ray actor(s), loads included"
    else:
        refuse_without_ray(args)
        result = asyncio.run(run_batch_file(
            Path(args.input_file), Path(args.output_file), config, args.embedding_model,
            args.max_in_flight, args.progress, args.served_model_name))
        loaded = f"after a {result.load_s:.1f} s load"
    counts = result.counts
    rate = counts.output_tokens / max(1e-9, result.elapsed_s)
    print(f"run-batch: {result.num_lines} lines, {result.skipped} already answered, "
          f"{counts.completed} completed, {counts.failed} failed; {counts.output_tokens} output "
          f"tokens in {result.elapsed_s:.1f} s ({rate:.1f} tok/s) {loaded} -> "
          f"{args.output_file}", file=sys.stderr)
    return 0
