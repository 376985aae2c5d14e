"""Where the time of `vs_peers.py`'s offline burst goes: each step's wall time by what it ran.

    .venv/bin/python benchmarks/burst_profile.py                  # q4, the defaults
    .venv/bin/python benchmarks/burst_profile.py --weights q4+a8+kv16 --rounds 3

Builds the engine as `vs_peers.py --peers openvino` does (the embedded model, float32, the
weight form of `--weights`, 2 threads, no prefix caching) and runs its burst (32 requests of
`bench serve`'s synthetic prompts, 24-400 tokens, 16-128 greedy output tokens each), timing
every runner step: the steps that prefill (their prompt tokens, with the decodes riding
along), and the decode-only steps grouped by how many sequences they hold (median step, sum,
mean context). Rounds after one warm-up burst of two requests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from batchinfer import LLM
from batchinfer.core.cpu import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_peers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="q4", help="a vs_peers.py weight form")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    workload = argparse.Namespace(burst=32, input_len="24:400", output_len="16:128", seed=0)
    prompts, lengths = vs_peers.burst_workload(workload)
    llm = LLM("default", dtype="float32", **vs_peers.engine_form(args.weights),
              num_threads=args.threads, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    execute = runner.execute
    steps: list[tuple[int, int, int, float]] = []  # prompt tokens, decodes, their context, s

    def timed(scheduled: Any) -> Any:
        start = time.perf_counter()
        out = execute(scheduled)
        seconds = time.perf_counter() - start
        decodes = [s for s in scheduled.sequences if not s.is_prefill]
        steps.append((sum(s.num_tokens for s in scheduled.sequences if s.is_prefill),
                      len(decodes), sum(s.num_computed_tokens for s in decodes), seconds))
        return out

    runner.execute = timed
    vs_peers.ours_burst(llm, prompts[:2], lengths[:2])
    print(f"CPU: {cpu_model()}; {args.threads} threads; {args.weights}; {len(prompts)} requests, "
          f"{sum(map(len, prompts))} prompt and {sum(lengths)} output tokens")
    for round_ in range(args.rounds):
        steps.clear()
        seconds, _ = vs_peers.ours_burst(llm, prompts, lengths)
        prefill = sum(s for tokens, _, _, s in steps if tokens)
        decode = sum(s for tokens, _, _, s in steps if not tokens)
        print(f"round {round_}: {seconds:.2f} s, {sum(lengths) / seconds:.1f} output tok/s; "
              f"{len(steps)} steps: prefilling {prefill:.2f} s, decode-only {decode:.2f} s, "
              f"outside the runner {seconds - prefill - decode:.2f} s")
        by_rows: dict[int, list[tuple[float, float]]] = {}
        for tokens, decodes, context, s in steps:
            if not tokens:
                by_rows.setdefault(decodes // 8 * 8, []).append((s, context / decodes))
        for low, runs in sorted(by_rows.items()):
            print(f"  decode steps of {low}-{low + 7} sequences: {len(runs)}, median "
                  f"{1e3 * statistics.median(s for s, _ in runs):.1f} ms, sum "
                  f"{sum(s for s, _ in runs):.2f} s, mean context "
                  f"{statistics.mean(c for _, c in runs):.0f}")


if __name__ == "__main__":
    main()
