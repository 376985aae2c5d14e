"""Embedding throughput and latency: batchinfer's embed path vs sentence-transformers.

Offline: N texts of mixed length (uniform 4-256 tokens), `embed_offline` (what `batchinfer
embed` runs: length-sorted windows, token-budgeted batches) against sentence-transformers'
`encode()` with its defaults, run alternately (with each weight form of `--quantization none,q8`),
medians of `--repeats` (wall and CPU seconds).
Online: Poisson arrivals at `--load` x the batcher's measured capacity, one text per request,
with learned length buckets and without; p50/p99 latency against the bound
`max_batch_delay_ms + 2 x (time of one full batch)`, and the token-weighted padding ratio.

    .venv/bin/python benchmarks/embed_throughput.py            # prints a table
    .venv/bin/python benchmarks/embed_throughput.py --skip-online --quantization none,q8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchinfer.batching import BatcherConfig, DynamicBatcher
from batchinfer.batching.embedding_service import embed_offline
from batchinfer.models.encoder import Encoder, default_encoder_path


def make_texts(encoder: Encoder, num_texts: int, seed: int) -> list[str]:
    """Texts of whole-word vocabulary tokens, lengths uniform in [4, 256] tokens with specials."""
    vocab = (default_encoder_path() / "vocab.txt").read_text().split("\n")
    words = [w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 3]
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 256) - 2))
             for _ in range(num_texts)]
    return texts


def timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def variant_name(encoder: Encoder) -> str:
    return "batchinfer" + ("" if encoder.quantization == "none" else f" {encoder.quantization}")


def offline(encoders: list[Encoder], texts: list[str], repeats: int, batch_size: int,
            max_batch_tokens: int) -> dict[str, Any]:
    """sentence-transformers and each of our encoders (weight forms) in turn, `repeats`
    rounds; medians, and each one's speedup over sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(default_encoder_path()), device=str(encoders[0].device))
    st.encode(texts[:32])
    for encoder in encoders:
        list(embed_offline(encoder, texts[:32]))

    def ours(encoder: Encoder) -> np.ndarray:
        return np.stack(list(embed_offline(encoder, texts, batch_size=batch_size,
                                           max_batch_tokens=max_batch_tokens)))

    names = ["sentence-transformers", *(variant_name(e) for e in encoders)]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    got: dict[str, np.ndarray] = {}
    for r in range(repeats):  # alternate, so a noisy neighbour hurts all alike
        want, wall, cpu = timed(lambda: st.encode(texts))
        runs["sentence-transformers"].append((wall, cpu))
        for encoder in encoders:
            name = variant_name(encoder)
            got[name], wall, cpu = timed(lambda e=encoder: ours(e))  # type: ignore[misc]
            runs[name].append((wall, cpu))
        print(f"  offline repeat {r + 1}/{repeats}: " + ", ".join(
            f"{name} {values[-1][0]:.1f} s" for name, values in runs.items())
            + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    out: dict[str, Any] = {"variants": names[1:]}
    for name, values in runs.items():
        out[name] = {"wall_s": statistics.median(v[0] for v in values),
                     "cpu_s": statistics.median(v[1] for v in values),
                     "texts_per_s": len(texts) / statistics.median(v[0] for v in values)}
    st_res = out["sentence-transformers"]
    for name in names[1:]:
        cosine = torch.nn.functional.cosine_similarity(torch.from_numpy(got[name]),
                                                       torch.from_numpy(want))
        out[name].update(speedup_wall=st_res["wall_s"] / out[name]["wall_s"],
                         speedup_cpu=st_res["cpu_s"] / out[name]["cpu_s"],
                         min_cosine_vs_st=float(cosine.min()))
    return out


def bf16_accuracy(encoder: Encoder, texts: list[str], num_texts: int) -> dict[str, Any]:
    """bf16 vs float32 on `num_texts` texts spread over the length range (bf16 is emulated,
    hence slow, on CPUs without AVX512-BF16/AMX, so the sample is small)."""
    ordered = sorted(texts, key=len)
    short = [ordered[i * (len(ordered) - 1) // max(1, num_texts - 1)] for i in range(num_texts)]
    bf16 = Encoder("default", dtype="bfloat16", device=str(encoder.device))
    ids = encoder.tokenize(short)
    ref, fp32_wall, _ = timed(lambda: encoder.encode_ids(ids))
    got, bf16_wall, _ = timed(lambda: bf16.encode_ids(ids))
    cosine = torch.nn.functional.cosine_similarity(ref, got)
    return {"num_texts": len(short), "num_tokens": sum(map(len, ids)),
            "min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean()),
            "bf16_over_fp32_time": bf16_wall / fp32_wall}


@dataclass
class BatchLog:
    """Token counts of each batch the batcher ran."""

    num_padded: int = 0
    num_real: int = 0
    sizes: list[int] = field(default_factory=list)

    @property
    def padding_ratio(self) -> float:
        return (self.num_padded - self.num_real) / max(1, self.num_padded)


def make_batcher(encoder: Encoder, config: BatcherConfig,
                 log: BatchLog) -> DynamicBatcher[list[int], np.ndarray]:
    def run(batch: list[list[int]]) -> list[np.ndarray]:
        log.num_padded += max(map(len, batch)) * len(batch)
        log.num_real += sum(map(len, batch))
        log.sizes.append(len(batch))
        return list(encoder.encode_ids(batch).numpy())

    return DynamicBatcher(run, config, length_fn=len, name="bench")


async def saturate(encoder: Encoder, ids: list[list[int]], config: BatcherConfig) -> float:
    """Items/s with everything queued at once: the batcher's capacity."""
    batcher = make_batcher(encoder, config, BatchLog())
    start = time.perf_counter()
    await asyncio.gather(*(batcher.submit(x) for x in ids))
    elapsed = time.perf_counter() - start
    await batcher.close()
    return len(ids) / elapsed


async def poisson(encoder: Encoder, ids: list[list[int]], config: BatcherConfig, rate: float,
                  num_warmup: int, seed: int) -> dict[str, Any]:
    """Open-loop Poisson arrivals at `rate`/s; latencies of the requests after the warm-up."""
    log = BatchLog()
    batcher = make_batcher(encoder, config, log)
    rng = random.Random(seed)
    latencies: list[float] = []

    async def one(x: list[int], measured: bool) -> None:
        start = time.perf_counter()
        await batcher.submit(x)
        if measured:
            latencies.append(time.perf_counter() - start)

    tasks = []
    next_s = time.perf_counter()
    for i, x in enumerate(ids):
        next_s += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
        if i == num_warmup:
            log.num_padded = log.num_real = 0
            log.sizes.clear()
        tasks.append(asyncio.ensure_future(one(x, i >= num_warmup)))
    await asyncio.gather(*tasks)
    await batcher.close()
    q = np.quantile(latencies, [0.5, 0.9, 0.99])
    return {"p50_ms": q[0] * 1e3, "p90_ms": q[1] * 1e3, "p99_ms": q[2] * 1e3,
            "padding_ratio": log.padding_ratio, "mean_batch_size": float(np.mean(log.sizes)),
            "buckets": list(batcher.buckets), "num_requests": len(latencies)}


def online(encoder: Encoder, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    ids = encoder.tokenize(texts)
    delays_ms = [float(x) for x in args.max_batch_delay_ms.split(",")]
    base = BatcherConfig(max_batch_size=args.max_batch_size, max_batch_delay_ms=delays_ms[0],
                         max_batch_tokens=args.max_batch_size * encoder.max_length,
                         max_queue_size=100_000)
    full = [[encoder.tokenizer.cls_token_id] + [2000] * (encoder.max_length - 2)
            + [encoder.tokenizer.sep_token_id]] * args.max_batch_size
    encoder.encode_ids(full)
    full_batch_s = statistics.median(timed(lambda: encoder.encode_ids(full))[1] for _ in range(3))
    sample = rng.sample(ids, min(len(ids), args.capacity_requests))
    capacity = asyncio.run(saturate(encoder, sample, base))
    rate = args.load * capacity
    requests = [rng.choice(ids) for _ in range(args.online_requests + args.warmup_requests)]
    out: dict[str, Any] = {"full_batch_ms": full_batch_s * 1e3, "capacity_per_s": capacity,
                           "rate_per_s": rate, "runs": []}
    for delay_ms in delays_ms:
        for num_buckets in (args.num_buckets, 1):
            config = BatcherConfig(**{**_fields(base), "num_buckets": num_buckets,
                                      "max_batch_delay_ms": delay_ms})
            run = asyncio.run(poisson(encoder, requests, config, rate, args.warmup_requests,
                                      args.seed + 2))
            run.update(delay_ms=delay_ms, num_buckets=num_buckets,
                       p99_bound_ms=delay_ms + 2e3 * full_batch_s)
            out["runs"].append(run)
            print(f"  online delay {delay_ms:g} ms, {num_buckets} bucket(s): p99 "
                  f"{run['p99_ms']:.0f} ms, padding {run['padding_ratio']:.3f}", file=sys.stderr)
    return out


def _fields(config: BatcherConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def print_table(result: dict[str, Any]) -> None:
    meta = result["setup"]
    print(f"\nembed_throughput: {meta['num_texts']} texts, {meta['tokens_min']}-"
          f"{meta['tokens_max']} tokens (mean {meta['tokens_mean']:.0f}), {meta['encoder']}, "
          f"torch threads {meta['torch_threads']}, load avg at start {meta['load_avg']:.1f}")
    if "offline" in result:
        off = result["offline"]
        print(f"\noffline (median of {meta['repeats']})      wall s   cpu s   texts/s  "
              "speedup wall  cpu   min cosine vs st")
        for name in ("sentence-transformers", *off["variants"]):
            r = off[name]
            line = f"  {name:<24} {r['wall_s']:7.1f} {r['cpu_s']:7.1f} {r['texts_per_s']:9.1f}"
            if "speedup_wall" in r:
                line += (f"  {r['speedup_wall']:11.2f}x {r['speedup_cpu']:5.2f}x"
                         f"  {r['min_cosine_vs_st']:.6f}")
            print(line)
    if "bf16" in result:
        b = result["bf16"]
        print(f"\nbf16 vs float32 ({b['num_texts']} texts, {b['num_tokens']} tokens): min cosine "
              f"{b['min_cosine']:.5f}, mean {b['mean_cosine']:.5f}; bf16 takes "
              f"{b['bf16_over_fp32_time']:.1f}x the fp32 time on this CPU")
    if "online" in result:
        on = result["online"]
        print(f"\nonline: capacity {on['capacity_per_s']:.1f} req/s, Poisson at "
              f"{on['rate_per_s']:.1f} req/s ({meta['load']:.0%}); one full batch "
              f"({meta['max_batch_size']} x {meta['max_length']} tokens) "
              f"{on['full_batch_ms']:.0f} ms")
        print("  delay ms  buckets   p50 ms   p90 ms   p99 ms  bound ms  padding  mean batch  "
              "boundaries")
        for r in on["runs"]:
            print(f"  {r['delay_ms']:8g} {r['num_buckets']:8d} {r['p50_ms']:8.0f} "
                  f"{r['p90_ms']:8.0f} {r['p99_ms']:8.0f} {r['p99_bound_ms']:9.0f} "
                  f"{r['padding_ratio']:8.3f} {r['mean_batch_size']:11.2f}  {r['buckets']}")
        for with_b, without in zip(on["runs"][::2], on["runs"][1::2], strict=True):
            p99_ok = with_b["p99_ms"] <= with_b["p99_bound_ms"]
            pad_ok = with_b["padding_ratio"] <= 0.5 * without["padding_ratio"]
            print(f"  delay {with_b['delay_ms']:g} ms: p99 <= bound {'PASS' if p99_ok else 'FAIL'}"
                  f"; padding with buckets <= half of without {'PASS' if pad_ok else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="embed path batch size")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none",
                        help="our encoder's weights: none, int8, q8, or several comma-separated "
                        "(each runs offline in turn with sentence-transformers; the first one "
                        "runs the bf16 and online parts)")
    parser.add_argument("--min-quantized-cosine", type=float, default=0.999,
                        help="the probe check's bound (lower it to measure int8 anyway)")
    parser.add_argument("--bf16-texts", type=int, default=16, help="0 skips the bf16 check")
    parser.add_argument("--max-batch-size", type=int, default=32, help="online batcher")
    parser.add_argument("--max-batch-delay-ms", default="5,100",
                        help="comma-separated windows to measure (default: 5,100)")
    parser.add_argument("--num-buckets", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--capacity-requests", type=int, default=256)
    parser.add_argument("--online-requests", type=int, default=300)
    parser.add_argument("--warmup-requests", type=int, default=64)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    encoders = [Encoder("default", dtype=args.dtype, quantization=quantization,
                        min_quantized_cosine=args.min_quantized_cosine)
                for quantization in args.quantization.split(",")]
    encoder = encoders[0]
    texts = make_texts(encoder, args.num_texts, args.seed)
    lengths = [len(x) for x in encoder.tokenize(texts)]
    result: dict[str, Any] = {"setup": {
        "num_texts": len(texts), "tokens_min": min(lengths), "tokens_max": max(lengths),
        "tokens_mean": statistics.mean(lengths), "repeats": args.repeats, "load": args.load,
        "encoder": f"{encoder.name} {str(encoder.dtype).removeprefix('torch.')} "
                   f"{encoder.device} weights "
                   + ", ".join(e.quantization for e in encoders),
        "probe_cosine": {e.quantization: e.quantization_cosine for e in encoders},
        "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0],
        "max_batch_size": args.max_batch_size, "max_length": encoder.max_length}}
    if not args.skip_offline:
        result["offline"] = offline(encoders, texts, args.repeats, args.batch_size,
                                    args.max_batch_tokens)
    if args.bf16_texts:
        result["bf16"] = bf16_accuracy(encoder, texts, args.bf16_texts)
    if not args.skip_online:
        result["online"] = online(encoder, texts, args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
