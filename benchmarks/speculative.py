"""Speculative decoding on the embedded model, each case side by side with plain decoding.

    .venv/bin/python benchmarks/speculative.py                  # all three parts, 2 rounds
    .venv/bin/python benchmarks/speculative.py --parts one-f32 --repeats 3

Prompts are cut from this repository's docs: each of `--num-prompts` sections (200-600 tokens,
chosen by `--seed`) in the chat template, asking about the section's heading X.

- `one-f32`: one stream, float32 weights (`--quantization none`): plain decoding against
  `--speculative-method draft --speculative-model self-q4` (auto depth, and a fixed depth
  `--depth`), "Summarize the passage about X". Printed next to them: the memory floor of
  plain decoding, the bytes of weights a one-token step reads over the bandwidth measured
  streaming that many bytes (`benchmarks/step_profile.py`'s measure).
- `one-q4`: one stream, q4 weights (the embedded Q4_1 GGUF as stored): plain against
  `--speculative-method ngram` (auto), on "Quote, word for word, the passage about X"
  (an extraction task: the answer's spans are in the prompt).
- `burst`: each of `--bursts` requests at once (default 4 and 32: the first prompts of both
  tasks, repeated to fill), output tokens per second of the whole burst: q4 + ngram auto and float32 + self-q4 auto,
  each against plain decoding. The draft model's cache takes half of `--kv-cache-memory` for
  itself, so the speculative engine gets twice that memory: the same KV blocks for the
  model.

Within a part every engine is built first, then rounds run round robin (each engine once per
round, in turn; `--warmup` rounds first, not counted, so every counted round finds the prompts
in the prefix cache); greedy outputs are equal across engines (checked), so every engine decodes
the same tokens. One stream: decode tokens per second of each request (tokens after the
first over the time from the first to the last), the median over the prompts; the table
shows the median of the rounds and each round's value.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from batchinfer import LLM, SamplingParams
from batchinfer.core.config import parse_bytes
from batchinfer.engine.inputs import Chat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model  # noqa: E402
from step_profile import stream_seconds, weight_bytes  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
PARTS = ("one-f32", "one-q4", "burst")


def sections(llm: LLM, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (heading, text) sections of the docs of 200-600 tokens, in a seeded order."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        for block in re.split(r"\n(?=#{2,3} )", path.read_text()):
            heading, _, body = block.partition("\n")
            if not heading.startswith("#"):
                continue
            size = len(llm.tokenizer.encode(body, add_special_tokens=False))
            if 200 <= size <= 600:
                found.append((heading.lstrip("# ").strip(), body.strip()))
    random.Random(seed).shuffle(found)
    return found[:n]


def prompts(llm: LLM, task: str, n: int, seed: int) -> list[Chat]:
    """One chat prompt per section, asking about its heading."""
    ask = {"summarize": "Summarize the passage about {x}.",
           "quote": "Quote, word for word, the passage about {x}."}[task]
    return [[{"role": "user",
              "content": f"Here is a document.\n\n{text}\n\n{ask.format(x=heading)}"}]
            for heading, text in sections(llm, n, seed)]


def engines(args: argparse.Namespace, variants: dict[str, dict[str, Any]]) -> dict[str, LLM]:
    out = {}
    for name, knobs in variants.items():
        start = time.perf_counter()
        out[name] = LLM(args.model, dtype="float32", **{
            "kv_cache_memory": args.kv_cache_memory, **knobs})
        print(f"  {name}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def one_stream(llm: LLM, batch: list[Chat], params: SamplingParams
               ) -> tuple[float, list[list[int]]]:
    """Median decode tokens/s of the prompts run one at a time, and their outputs."""
    rates, outputs = [], []
    for prompt in batch:
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        m = result.metrics
        tokens = result.outputs[0].token_ids
        outputs.append(tokens)
        if len(tokens) > 1 and m.finished_s is not None and m.first_token_s is not None:
            rates.append((len(tokens) - 1) / (m.finished_s - m.first_token_s))
    return statistics.median(rates), outputs


def burst(llm: LLM, batch: list[Chat], params: SamplingParams
          ) -> tuple[float, list[list[int]]]:
    """Output tokens per second of the whole batch submitted at once, and the outputs."""
    start = time.perf_counter()
    results = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = [r.outputs[0].token_ids for r in results]
    return sum(len(t) for t in outputs) / seconds, outputs


def rounds(args: argparse.Namespace, llms: dict[str, LLM], run: Any, batch: list[Chat],
           params: SamplingParams) -> dict[str, list[float]]:
    """Round robin: every engine once per round, after `--warmup` rounds not counted (the
    prompts enter the prefix cache and every buffer is touched); greedy outputs must agree."""
    for _ in range(args.warmup):
        for llm in llms.values():
            run(llm, batch, params)
    figures: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(args.repeats):
        reference = None
        for name, llm in llms.items():
            value, outputs = run(llm, batch, params)
            figures[name].append(value)
            if reference is None:
                reference = outputs
            elif outputs != reference:
                print(f"  round {r + 1}: {name}'s outputs differ from plain decoding's")
            print(f"  round {r + 1} {name}: {value:.1f} tok/s", flush=True)
    return figures


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    """(verifications, tokens proposed, tokens accepted) so far; zeros without speculation."""
    spec = llm.engine.core.scheduler.speculation
    if spec is None:
        return (0, 0, 0)
    s = spec.stats
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def acceptance(llm: LLM, since: tuple[int, int, int] = (0, 0, 0)) -> str:
    """What the engine proposed and accepted since the counts `since`."""
    if llm.engine.core.scheduler.speculation is None:
        return ""
    drafts, proposed, accepted = (now - then for now, then in zip(spec_counts(llm), since,
                                                                   strict=True))
    rate = accepted / proposed if proposed else 0.0
    per_draft = proposed / drafts if drafts else 0.0
    return f"{proposed} proposed, {rate:.0%} accepted, {per_draft:.1f} per proposal"


def table(title: str, figures: dict[str, list[float]], llms: dict[str, LLM],
          baseline: str, extra: dict[str, str] | None = None,
          since: dict[str, tuple[int, int, int]] | None = None) -> None:
    print(f"\n{title}")
    base = statistics.median(figures[baseline])
    for name, values in figures.items():
        median = statistics.median(values)
        rounds_text = " / ".join(f"{v:.1f}" for v in values)
        note = (extra or {}).get(name, "") or acceptance(llms[name],
                                                          (since or {}).get(name, (0, 0, 0)))
        print(f"  {name:22} {median:7.1f} tok/s  {median / base:5.2f}x  "
              f"(rounds {rounds_text}) {note}")


def part_one_f32(args: argparse.Namespace) -> None:
    print("one stream, float32 weights: plain vs self-q4 draft", flush=True)
    draft = {"quantization": "none", "speculative_method": "draft",
             "speculative_model": "self-q4"}
    llms = engines(args, {"plain": {"quantization": "none"},
                          "self-q4 auto": draft,
                          f"self-q4 depth {args.depth}": {**draft,
                                                          "speculative_depth": args.depth}})
    plain = llms["plain"]
    size = weight_bytes(plain.engine.worker.loaded.model)
    floor_s = stream_seconds(size)
    batch = prompts(plain, "summarize", args.num_prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    figures = rounds(args, llms, one_stream, batch, params)
    floor = (f"memory floor {1 / floor_s:.1f} tok/s: {size / 2**20:.0f} MiB of weights a "
             f"step, streamed at {size / floor_s / 1e9:.1f} GB/s")
    table("one stream, float32 weights (decode tok/s, median over prompts)", figures, llms,
          "plain", {"plain": floor})


def part_one_q4(args: argparse.Namespace) -> None:
    print("one stream, q4 weights: plain vs ngram", flush=True)
    llms = engines(args, {"plain": {}, "ngram auto": {"speculative_method": "ngram"}})
    batch = prompts(llms["plain"], "quote", args.num_prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    figures = rounds(args, llms, one_stream, batch, params)
    table("one stream, q4 weights, quoting (decode tok/s, median over prompts)", figures, llms,
          "plain")


def part_burst(args: argparse.Namespace) -> None:
    cases = {
        "q4": ({}, {"speculative_method": "ngram"}, "quote"),
        "float32": ({"quantization": "none"},
                    {"quantization": "none", "speculative_method": "draft",
                     "speculative_model": "self-q4",
                     "kv_cache_memory": 2 * args.kv_cache_memory}, "summarize"),
    }
    for weights, (plain_knobs, spec_knobs, task) in cases.items():
        if weights not in args.burst_weights.split(","):
            continue
        llms = engines(args, {"plain": plain_knobs, "auto": spec_knobs})
        pool = prompts(llms["plain"], task, args.num_prompts, args.seed)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        for size in (int(text) for text in args.bursts.split(",")):
            print(f"burst of {size}, {weights} weights", flush=True)
            batch = [pool[i % len(pool)] for i in range(size)]
            since = {name: spec_counts(llm) for name, llm in llms.items()}
            figures = rounds(args, llms, burst, batch, params)
            table(f"burst of {size} requests, {weights} weights (output tok/s)", figures,
                  llms, "plain", since=since)
        del llms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--bursts", default="4,32", help="comma-separated burst sizes")
    parser.add_argument("--burst-weights", default="q4,float32",
                        help="the bursts to run: q4 (with ngram), float32 (with self-q4)")
    parser.add_argument("--depth", type=int, default=4, help="the fixed depth compared")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    parser.add_argument("--kv-cache-memory", default=1 << 30,
                        type=lambda text: parse_bytes("--kv-cache-memory", text),
                        help="bytes of KV cache of each plain engine (default 1G)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    print(f"CPU: {cpu_model()}; {args.repeats} round(s), round robin; medians", flush=True)
    for part, run in (("one-f32", part_one_f32), ("one-q4", part_one_q4),
                      ("burst", part_burst)):
        if part in parts:
            run(args)


if __name__ == "__main__":
    main()
