"""The GPU check: batchinfer's engine with the `triton` attention backend against Hugging Face
`transformers` on the same device and the same random weights, one table.

Needs only torch, triton and transformers (and tokenizers, which transformers brings): the
model is built from random weights of a named shape, so no checkpoint is copied to the GPU
machine. Rows, per shape:
- greedy: the first `--tokens` greedy tokens equal Hugging Face's (float32, and the model dtype);
- decode step at batch 1 / 16 / 64: milliseconds, next to the HBM floor (weight + KV bytes a
  step reads, over the device's copy bandwidth measured here);
- burst: `--burst` requests of mixed prompt lengths, `--burst-tokens` outputs each: useful output
  tok/s, against `generate` in static batches of 16; and with an FP8 KV cache (e4m3) at the same
  `gpu_memory_utilization`.
CUDA graphs and host/device overlap are not built yet: the table says so.

    python benchmarks/gpu_check.py                       # on a GPU: both shapes, < 5 minutes
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --shapes tiny --tokens 8 \
        --burst 4 --burst-tokens 8 --batches 1    # the same code path, interpreted, on a CPU
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# name -> Llama config fields: Llama-3.2-1B's and SmolLM2-135M's shapes, and a tiny one.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "tie_word_embeddings": True, "rope_theta": 500000.0},
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
             "tie_word_embeddings": True, "rope_theta": 100000.0},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
             "tie_word_embeddings": False, "rope_theta": 10000.0},
}
EOS = 0  # the word-level tokenizer's only special token


def make_model(folder: Path, shape: str, device: torch.device) -> Path:
    """A random Llama of `shape` (Hugging Face's own initialisation, float32) and a word-level
    tokenizer covering its vocabulary, saved into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    fields = SHAPES[shape]
    config = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=EOS, **fields)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(fields["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t0", bos_token="t1",
                            pad_token="t0").save_pretrained(folder)
    del model
    return folder


def prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine(folder: Path, device: torch.device, dtype: str, **knobs: Any) -> Any:
    from batchinfer import LLM

    memory = {"gpu_memory_utilization": 0.85} if device.type == "cuda" else \
        {"kv_cache_memory": 64 << 20}
    return LLM(str(folder), device=device.type, dtype=dtype, attention_backend="triton",
               **memory, **knobs)


def greedy_row(folder: Path, device: torch.device, dtype: str, tokens: int) -> dict[str, Any]:
    """Greedy tokens of batchinfer and of Hugging Face `generate`, one prompt, same device."""
    from transformers import AutoModelForCausalLM

    from batchinfer import SamplingParams

    torch_dtype = getattr(torch, dtype)
    vocab = SHAPES_IN_USE["vocab_size"]
    prompt = prompts(1, 24, 24, vocab, seed=1)[0]
    llm = engine(folder, device, dtype)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=EOS)
    theirs = out[0, len(prompt):].tolist()
    del hf
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                tokens)
    return {"row": f"greedy {dtype}", "value": f"{same}/{tokens} tokens equal HF's",
            "ok": same == tokens}


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy (read + write)."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    source = torch.empty(size // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    sync(device)
    return 2 * size * 5 / (time.perf_counter() - start)


def decode_rows(folder: Path, device: torch.device, dtype: str, batches: list[int],
                context: int = 256) -> list[dict[str, Any]]:
    """Milliseconds of a decode step at each batch size, next to its HBM floor."""
    from batchinfer import SamplingParams

    llm = engine(folder, device, dtype)
    fields = SHAPES_IN_USE
    weight_bytes = sum(p.numel() * p.element_size()
                       for p in llm.engine.core.runner.model.parameters())
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    kv_token_bytes = (2 * fields["num_hidden_layers"] * fields["num_key_value_heads"] * head_dim
                      * torch.empty(0, dtype=getattr(torch, dtype)).element_size())
    rate = bandwidth(device)
    rows = []
    steps = 32
    for batch in batches:
        batch_prompts = prompts(batch, context, context, fields["vocab_size"], seed=batch)
        timings = []
        for max_tokens in (1, 1 + steps):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate(batch_prompts, params, use_tqdm=False)  # warm (and cache prefixes)
            sync(device)
            start = time.perf_counter()
            llm.generate(batch_prompts, params, use_tqdm=False)
            sync(device)
            timings.append(time.perf_counter() - start)
        step_s = (timings[1] - timings[0]) / steps
        floor_s = (weight_bytes + batch * (context + steps // 2) * kv_token_bytes) / rate
        rows.append({"row": f"decode step, batch {batch}",
                     "value": f"{step_s * 1e3:.2f} ms (HBM floor {floor_s * 1e3:.2f} ms, "
                              f"{step_s / floor_s:.1f}x)", "ok": None})
    del llm
    return rows


def burst_rows(folder: Path, device: torch.device, dtype: str, count: int, tokens: int
               ) -> list[dict[str, Any]]:
    """Useful output tok/s of a burst: batchinfer (bf16 and FP8 KV) vs HF static batches."""
    from transformers import AutoModelForCausalLM

    from batchinfer import SamplingParams

    burst = prompts(count, 32, 256, SHAPES_IN_USE["vocab_size"], seed=7)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows = []
    rates = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = engine(folder, device, dtype, kv_cache_dtype=kv)
        llm.generate(burst[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        sync(device)
        start = time.perf_counter()
        llm.generate(burst, params, use_tqdm=False)
        sync(device)
        rates[kv] = count * tokens / (time.perf_counter() - start)
        del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, count, 16):
            group = burst[first:first + 16]
            longest = max(len(p) for p in group)
            ids = torch.tensor([[EOS] * (longest - len(p)) + p for p in group], device=device)
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group],
                                device=device)
            hf.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                        do_sample=False, eos_token_id=None, pad_token_id=EOS)
    sync(device)
    hf_rate = count * tokens / (time.perf_counter() - start)
    del hf
    rows.append({"row": f"burst of {count}, {dtype} KV",
                 "value": f"{rates['auto']:.0f} out tok/s ({rates['auto'] / hf_rate:.2f}x HF "
                          f"static batches of 16: {hf_rate:.0f})", "ok": None})
    rows.append({"row": f"burst of {count}, FP8 e4m3 KV",
                 "value": f"{rates['fp8_e4m3']:.0f} out tok/s "
                          f"({rates['fp8_e4m3'] / rates['auto']:.2f}x the {dtype} KV)",
                 "ok": None})
    return rows


SHAPES_IN_USE: dict[str, Any] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="135m,1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--burst-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    table: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        SHAPES_IN_USE.clear()
        SHAPES_IN_USE.update(SHAPES[shape])
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_model(Path(tmp), shape, device)
            rows = [greedy_row(folder, device, "float32", args.tokens)]
            if args.dtype != "float32":
                rows.append(greedy_row(folder, device, args.dtype, args.tokens))
            rows += decode_rows(folder, device, args.dtype,
                                [int(b) for b in args.batches.split(",")])
            rows += burst_rows(folder, device, args.dtype, args.burst, args.burst_tokens)
            rows.append({"row": "CUDA graphs", "value": "not built yet (eager steps)",
                         "ok": None})
        for row in rows:
            row["shape"] = shape
        table += rows
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreted)"
    print(f"\nbatchinfer GPU check on {name}, torch {torch.__version__}\n")
    print("| shape | check | result |\n|---|---|---|")
    for row in table:
        mark = "" if row["ok"] is None else (" ok" if row["ok"] else " FAILED")
        print(f"| {row['shape']} | {row['row']} | {row['value']}{mark} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
