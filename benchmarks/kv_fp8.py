"""FP8 KV cache against float32, on the embedded model: greedy agreement, then capacity.

    .venv/bin/python benchmarks/kv_fp8.py                       # both parts
    .venv/bin/python benchmarks/kv_fp8.py --part accuracy --num-prompts 20

accuracy: `--num-prompts` prompts of 200-500 tokens cut from this repository's docs (natural
text), 64 greedy tokens each with `logprobs=5`, with a float32 cache and with each FP8 variant
(`fp8_e4m3`, with and without `--calculate-kv-scales`, `fp8_e5m2`). Reported: the share of
output tokens identical to float32 at the same position, the share of whole outputs identical,
and the mean |logprob difference| of the float32 choice's token over the positions before the
two outputs first differ (the same context: a like-for-like comparison of the distributions).

capacity: `LLM.generate` of `--num-long` long requests (prompt 1,000-2,000 tokens, 128 out,
`ignore_eos`) at the same `--kv-cache-memory`, float32 against fp8_e4m3: tokens the cache holds,
preemptions, wall time and output tokens per second.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from batchinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e4m3+calibrated": {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
}


def doc_prompts(llm: LLM, n: int, seed: int) -> list[list[int]]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(200, 500)
        start = rng.randrange(0, len(tokens) - length)
        prompts.append(tokens[start : start + length])
    return prompts


def accuracy(args: argparse.Namespace) -> None:
    base = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory)
    prompts = doc_prompts(base, args.num_prompts, args.seed)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=5)
    want = [o.outputs[0] for o in base.generate(prompts, params, use_tqdm=False)]
    del base
    print(f"{'variant':22}{'same tokens':>13}{'same outputs':>14}{'mean |dlogprob|':>17}")
    for name, knobs in VARIANTS.items():
        llm = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory, **knobs)
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        same = total = whole = 0
        diffs = []
        for ref, out in zip(want, got, strict=True):
            pairs = list(zip(ref.token_ids, out.token_ids, strict=True))
            same += sum(a == b for a, b in pairs)
            total += len(pairs)
            whole += ref.token_ids == out.token_ids
            for (a, b), ref_lp, out_lp in zip(pairs, ref.logprobs or [], out.logprobs or [],
                                              strict=True):
                diffs.append(abs(ref_lp.logprob - out_lp.logprob))
                if a != b:
                    break
        print(f"{name:22}{same / total:>13.1%}{whole / len(want):>14.1%}"
              f"{statistics.mean(diffs):>17.4f}")
        del llm


def capacity(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(1000, 2000))]
               for _ in range(args.num_long)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    print(f"{'cache':12}{'tokens held':>12}{'preemptions':>13}{'seconds':>9}{'out tok/s':>11}")
    for name, knobs in (("float32", {}), ("fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"})):
        llm = LLM(args.model, dtype="float32", kv_cache_memory=args.capacity_kv_memory, **knobs)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        scheduler = llm.engine.core.scheduler
        held = scheduler.block_manager.num_blocks * scheduler.block_manager.block_size
        print(f"{name:12}{held:>12}{scheduler.num_preemptions_total:>13}{seconds:>9.1f}"
              f"{num_out / seconds:>11.1f}")
        del llm, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--part", choices=("accuracy", "capacity", "both"), default="both")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--kv-cache-memory", default="1G")
    parser.add_argument("--num-long", type=int, default=16)
    parser.add_argument("--capacity-kv-memory", default="320M")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    if args.part in ("accuracy", "both"):
        accuracy(args)
    if args.part in ("capacity", "both"):
        capacity(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
