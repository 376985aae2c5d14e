"""OpenVINO GenAI's half of `vs_peers.py`, run by the python of OpenVINO's own venv.

    <venv>/bin/python benchmarks/openvino_runner.py JOB.json      # prints one JSON object

Each of `repeats` rounds times the burst, then the single stream (its prefill alone, then the
prefill and 128 tokens); the JSON holds every round's figures and the burst's output tokens.

It imports nothing of batchinfer (that venv does not have it): `vs_peers.py` writes the job
(model folder, threads, token-id prompts and output lengths) and reads back the timings.
Everything goes through `ContinuousBatchingPipeline` with token ids, greedy, every output
exactly its length (`min_new_tokens = max_new_tokens`, `ignore_eos`): the burst as one
`generate` call over all its requests, the single stream as one request alone (on CPU the
`LLMPipeline` runs this same paged-attention backend, so it would time the same thing).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def token_ids(prompts: list[list[int]]) -> list[ov.Tensor]:
    """`[1, n]` int64 tensors, the form `generate` takes token ids in."""
    return [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]


def exact(n: int) -> ov_genai.GenerationConfig:
    """Greedy, exactly `n` new tokens whatever the model would say."""
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = n
    config.min_new_tokens = n
    config.ignore_eos = True
    config.do_sample = False
    return config


def run(pipe: ov_genai.ContinuousBatchingPipeline, prompts: list[ov.Tensor],
        lengths: list[int]) -> tuple[float, list[list[int]]]:
    """Seconds for one `generate` over all `prompts`, and each one's output tokens (checked to
    be exactly as many as asked)."""
    start = time.perf_counter()
    results = pipe.generate(prompts, [exact(n) for n in lengths])
    seconds = time.perf_counter() - start
    tokens = [list(r.m_generation_ids[0]) for r in results]
    if [len(t) for t in tokens] != lengths:
        raise RuntimeError(f"asked for {lengths} tokens, got {[len(t) for t in tokens]}")
    return seconds, tokens


def kv_cache_precision(model_dir: str, properties: dict[str, Any]) -> dict[str, str]:
    """The KV cache element types the pipeline gets: it allocates its cache with the types of
    the compiled paged-attention model's `key_cache.0` / `value_cache.0` inputs, which the CPU
    plugin chooses (on this Xeon: u8 for int8 and int4 weights, f16 for fp32 ones). Compiles
    the same transformed model to read them."""
    from openvino._offline_transformations import paged_attention_transformation

    core = ov.Core()
    model = core.read_model(f"{model_dir}/openvino_model.xml")
    paged_attention_transformation(model)
    compiled = core.compile_model(model, "CPU", properties)
    found = {}
    for port in compiled.inputs:
        for name in ("key_cache.0", "value_cache.0"):
            if name in port.get_names():
                found[name.split("_")[0]] = port.get_element_type().get_type_name()
    for name in ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
                 "INFERENCE_PRECISION_HINT"):
        with contextlib.suppress(RuntimeError):  # a property this release does not have
            value = compiled.get_property(name)
            found[name] = value.get_type_name() if isinstance(value, ov.Type) else str(value)
    return found


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("kv_cache_precision"):  # else the CPU plugin's default
        properties["KV_CACHE_PRECISION"] = job["kv_cache_precision"]
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = job["cache_gb"]
    scheduler.max_num_seqs = job["max_num_seqs"]
    scheduler.max_num_batched_tokens = job["max_num_batched_tokens"]
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = False  # the runs repeat prompts; each must prefill
    pipe = ov_genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)

    burst = token_ids(job["prompts"])
    lengths = job["max_tokens"]
    single = token_ids([job["single_prompt"]])
    run(pipe, burst[:2], lengths[:2])  # warm-up
    burst_s, first, decode = [], [], []
    for _ in range(job["repeats"]):
        seconds, outputs = run(pipe, burst, lengths)
        burst_s.append(seconds)
        prefill_s, _ = run(pipe, single, [1])
        total_s, _ = run(pipe, single, [129])
        first.append(prefill_s)
        decode.append(128 / (total_s - prefill_s))

    print(json.dumps({
        "openvino": ov.get_version(), "openvino_genai": ov_genai.__version__,
        "kv_cache": kv_cache_precision(job["model"], properties),
        "burst_s": burst_s, "ttft_s": first, "decode_tok_s": decode, "outputs": outputs,
    }))


if __name__ == "__main__":
    main()
