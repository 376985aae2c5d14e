"""Weight quantization on the embedded model: quality against float32, and single-stream speed.

    .venv/bin/python benchmarks/quantization.py                  # none, int8, q4
    .venv/bin/python benchmarks/quantization.py --num-prompts 20 --repeats 3

quality: `--num-prompts` prompts of 200-500 tokens cut from this repository's docs, 64 greedy
tokens each; the share of output tokens identical to float32's at the same position, and of
whole outputs. Perplexity of `benchmarks/data/perplexity.txt` (a fixed text shipped here),
teacher-forced in windows of `--window` tokens, against float32's.

speed (one sequence, the interactive case): prefill of a 512-token prompt (time to the first
token) and decode of 128 tokens after it (tokens per second), medians of `--repeats` runs,
for each `--variants` entry: a weight form, its kernels (default `auto`, measured at
start-up), with `+a8` 8-bit prefill activations (`q4+a8`), with `+kv16` a float16 KV
cache (`q4+kv16`); `int8:int8_dense` keeps float32 activations everywhere, so it shows what the weights'
rounding alone costs, `auto` adds bfloat16 activations where those kernels win). Prefix caching
is off, so every run prefills.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_fp8 import doc_prompts  # noqa: E402
from pressure import cpu_model  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> torch.Tensor:
    """Plain causal attention over one window (no cache): `[n, heads, d]` in and out."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def perplexity(llm: LLM, window: int) -> float:
    """exp(mean negative log-likelihood) of the text's tokens, each window scored alone."""
    model = llm.engine.worker.loaded.model
    tokens = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, window):
            ids = torch.tensor(tokens[start : start + window + 1])
            if len(ids) < 2:
                break
            hidden = model(ids[:-1], torch.arange(len(ids) - 1), causal_attention)
            logits = model.compute_logits(hidden)
            total += F.cross_entropy(logits, ids[1:], reduction="sum").item()
            count += len(ids) - 1
    return math.exp(total / count)


def speed(llm: LLM, repeats: int, prompt_len: int = 512) -> tuple[float, float]:
    """Median seconds to the first token of a `prompt_len`-token prompt, and decode tokens/s
    of the 128 tokens after it."""
    prompt = [(37 * i + 11) % 40000 + 100 for i in range(prompt_len)]
    first, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=129, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        total_s = time.perf_counter() - start
        first.append(prefill_s)
        decode.append(128 / (total_s - prefill_s))
    return statistics.median(first), statistics.median(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--variants", default="none,int8,q8,q4,int8:int8_dense,q4:q4_dense",
                        help="QUANTIZATION[:LINEAR_KERNELS][+a8][+kv16] list; kernels default "
                        "to auto; +a8: --prefill-activations int8; +kv16: --kv-cache-dtype "
                        "float16")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="512M")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rows = []
    want = None
    prompts: list[list[int]] = []
    for variant in args.variants.split(","):
        spec, *suffixes = variant.split("+")
        if set(suffixes) - {"a8", "kv16"}:
            parser.error(f"--variants: {variant!r}: suffixes are +a8 and +kv16")
        quantization, _, kernels = spec.partition(":")
        # No prefix caching: the speed runs repeat one prompt, which must be prefilled anew.
        llm = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory,
                  quantization=quantization, linear_kernels=kernels or "auto",
                  enable_prefix_caching=False,
                  prefill_activations="int8" if "a8" in suffixes else "int16",
                  kv_cache_dtype="float16" if "kv16" in suffixes else "auto")
        if not prompts:
            prompts = doc_prompts(llm, args.num_prompts, args.seed)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if want is None:
            want = outputs
        same = sum(a == b for got, ref in zip(outputs, want, strict=True)
                   for a, b in zip(got, ref, strict=True))
        whole = sum(got == ref for got, ref in zip(outputs, want, strict=True))
        ppl = perplexity(llm, args.window)
        ttft_s, tok_s = speed(llm, args.repeats)
        plan = llm.engine.worker.linear_kernels
        rows.append((variant, same / sum(map(len, want)), whole / len(want), ppl, ttft_s,
                     tok_s, plan.describe() if plan else ""))
        print(f"{variant}: kernels {rows[-1][-1]}", flush=True)
        del llm
    base_ppl = rows[0][3]
    print(f"\nCPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'weights':18}{'same tokens':>13}{'same outputs':>14}{'perplexity':>12}"
          f"{'vs fp32':>9}{'TTFT 512 (s)':>14}{'decode tok/s':>14}")
    for name, same, whole, ppl, ttft_s, tok_s, _ in rows:
        print(f"{name:18}{same:13.1%}{whole:14.1%}{ppl:12.3f}{ppl / base_ppl - 1:+9.1%}"
              f"{ttft_s:14.3f}{tok_s:14.1f}")


if __name__ == "__main__":
    main()
