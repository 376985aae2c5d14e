"""`batchinfer generate`: run prompts through the engine and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchinfer.cli.options import add_dataclass_flags, add_engine_flags, collect_flags
from batchinfer.core.config import EngineConfig
from batchinfer.core.sampling_params import SamplingParams

SAMPLING_FLAGS_EXCLUDE = ("n", "stop", "stop_token_ids", "skip_special_tokens")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions. Prompts come from the arguments or from --input "
        "(JSONL with a 'prompt' or 'messages' field per line).",
    )
    parser.add_argument("prompts", nargs="*", help="prompt texts")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message and apply the chat template")
    parser.add_argument("--input", help="JSONL file of prompts ('prompt' or 'messages')")
    parser.add_argument("--output", help="write results as JSONL here instead of printing")
    parser.add_argument("--stop", action="append", default=None,
                        help="stop string (repeatable)")
    parser.add_argument("--n", type=int, default=None, help="completions per prompt")
    sampling = parser.add_argument_group("sampling")
    add_dataclass_flags(sampling, SamplingParams, exclude=SAMPLING_FLAGS_EXCLUDE)
    # --seed is the sampling seed here; it also seeds the engine so a run is reproducible.
    add_engine_flags(parser, exclude=("seed",))
    parser.set_defaults(func=run, max_tokens=None)


def _read_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = []
    if args.input:
        try:
            with open(args.input, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"--input {args.input}: {exc.strerror}") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--input {args.input}:{lineno}: not JSON ({exc.msg})") from None
            if isinstance(item, dict) and "messages" in item:
                prompts.append(item["messages"])
            elif isinstance(item, dict) and "prompt" in item:
                prompts.append(item["prompt"])
            else:
                raise ValueError(f"--input {args.input}:{lineno}: needs 'prompt' or 'messages'")
    for text in args.prompts:
        prompts.append([{"role": "user", "content": text}] if args.chat else text)
    if not prompts:
        raise ValueError("no prompt given: pass prompt texts or --input FILE")
    return prompts


def run(args: argparse.Namespace) -> int:
    sampling_kwargs = collect_flags(args, SamplingParams)
    if args.stop:
        sampling_kwargs["stop"] = args.stop
    if args.n is not None:
        sampling_kwargs["n"] = args.n
    params = SamplingParams(**sampling_kwargs)
    engine_kwargs = collect_flags(args, EngineConfig)
    if params.seed is not None and "seed" not in engine_kwargs:
        engine_kwargs["seed"] = params.seed
    prompts = _read_prompts(args)
    config = EngineConfig.from_kwargs(**engine_kwargs)

    from batchinfer.engine.llm import LLM  # torch is imported only once the input is valid

    llm = LLM(**{k: getattr(config, k) for k in engine_kwargs} | {"model": config.model})
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    records = [
        {
            "prompt": result.prompt,
            "index": completion.index,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "num_prompt_tokens": result.num_prompt_tokens,
            "num_output_tokens": len(completion.token_ids),
        }
        for result in outputs
        for completion in result.outputs
    ]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        print(f"wrote {len(records)} results to {args.output}", file=sys.stderr)
    elif len(records) == 1:
        print(records[0]["text"])
    else:
        for record in records:
            print(json.dumps(record, ensure_ascii=False))
    return 0
