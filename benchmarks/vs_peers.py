"""batchinfer against llama.cpp and OpenVINO GenAI on the same CPU, model and threads.

    .venv/bin/python benchmarks/vs_peers.py                          # both; builds what is missing
    .venv/bin/python benchmarks/vs_peers.py --peers llama.cpp --concurrency 1,4,32
    .venv/bin/python benchmarks/vs_peers.py --peers openvino --repeats 2

llama.cpp: its `llama-server`, `llama-bench` and `llama-batched-bench`, built from the source
that the `llama-cpp-python` sdist on PyPI vendors (`--llama-version`), with `GGML_NATIVE`, into
`--llama-dir` (default `$BATCHINFER_CACHE/llama.cpp`) the first time: about 15 minutes on 2
cores, once per machine.

One sequence: `llama-bench -p 512 -n 128 -d 0,512` (prefill of 512 tokens; decode of 128 from
an empty cache and after 512 tokens) on the embedded SmolLM2-135M GGUF (Q4_1) next to
`LLM.generate` with each `--weights` form: time to the first token of a 512-token prompt, and
decode tokens per second after a 1-token and after the 512-token prompt; `--repeats` rounds
alternating between the two, medians (prefix caching off).

Serving: `llama-server -np 32` and `batchinfer serve` (the last `--weights` form), each measured
by `batchinfer bench serve` with the same seed and workload (prompts `--input-len`, outputs
`--output-len`, `ignore_eos`) at each `--concurrency` (`--max-concurrency`, every request sent
at once): useful output tokens per second, TTFT p50 / p99.

OpenVINO GenAI: its own venv in `--openvino-dir` (default `$BATCHINFER_CACHE/openvino-genai`),
made once with the releases pinned in `OPENVINO_PINS` (torch held at the CPU build by a
constraints file); transformers reads the GGUF into a float32 Hugging Face folder, which
`optimum-cli export openvino` turns into one model per weight format (fp32, int8, and int4 with
`--group-size 64`: 576 is no multiple of 128), all once (a few minutes). Each of ours `none`,
`int8` (or `q8`), `q4` meets fp32, int8, int4: the `--burst` requests (`bench serve`'s synthetic prompts
for `--seed`, `--input-len`, `--output-len`, as token ids) all at once through one
`LLM.generate` and through `ContinuousBatchingPipeline` (`benchmarks/openvino_runner.py`, run by
that venv's python), useful output tokens per second; then the one sequence above through both.
Both get the engine's defaults: 2 GiB of KV cache, 64 sequences and 2048 tokens a step. Its CPU
plugin picks the KV cache's type (here u8 for the int8 and int4 models, f16 for fp32; ours is
float32, float16 with a `+kv16` form): the table says which it used, `--openvino-kv-cache f32`
asks for float32. Rounds
alternate between the two, so a passing load on a shared machine falls on both. Prints one
table and writes `vs_openvino.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from batchinfer import LLM, SamplingParams
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, free_port, running_server, stop_process
from batchinfer.bench.workload import parse_length_spec, synthetic_workload
from batchinfer.core.cpu import cpu_model
from batchinfer.core.paths import default_cache_dir
from batchinfer.models.gguf import convert_gguf
from batchinfer.models.loader import load_tokenizer
from batchinfer.models.registry import default_gguf_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantization import speed  # noqa: E402
from step_profile import stream_seconds, weight_bytes  # noqa: E402

LLAMA_TARGETS = ("llama-server", "llama-bench", "llama-batched-bench")
# The one-sequence table's row for float32 weights' memory floor (see one_sequence).
FLOOR = "float32 memory floor"
# OpenVINO GenAI's venv: torch is pinned through a constraints file, since optimum-intel would
# otherwise pull the newest (multi-GB, CUDA) torch; the rest is pinned so a rerun measures the
# same releases.
OPENVINO_TORCH = "torch==2.13.0"
OPENVINO_PINS = ("openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
                 "openvino==2026.4.1", "optimum-intel[openvino]==2.2.0", "optimum==2.3.0",
                 "nncf==3.4.0", "transformers==5.5.4", "gguf==0.19.0", "accelerate==1.15.0")
# batchinfer's --quantization form -> the optimum-cli --weight-format it is compared with.
OPENVINO_FORMS = {"none": "fp32", "int8": "int8", "q8": "int8", "q4": "int4"}


def engine_form(form: str) -> dict[str, str]:
    """A `--weights` entry as engine knobs: `q4`, with `+a8` 8-bit prefill activations
    (`--prefill-activations int8`), with `+kv16` a float16 KV cache (`--kv-cache-dtype
    float16`): `q4+a8+kv16`."""
    quantization, *suffixes = form.split("+")
    if set(suffixes) - {"a8", "kv16"}:
        raise ValueError(f"weight form {form!r}: suffixes are +a8 and +kv16")
    return {"quantization": quantization,
            "prefill_activations": "int8" if "a8" in suffixes else "int16",
            "kv_cache_dtype": "float16" if "kv16" in suffixes else "auto"}


def build_llama_cpp(dest: Path, version: str) -> Path:
    """llama.cpp's binaries in `dest/bin`, built from the llama-cpp-python sdist if absent."""
    bin_dir = dest / "bin"
    if all((bin_dir / name).exists() for name in LLAMA_TARGETS):
        return bin_dir
    print(f"building llama.cpp (llama-cpp-python {version}) into {dest}; ~15 minutes",
          flush=True)
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", work],
                       check=True)
        (archive,) = Path(work).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        source = Path(work) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        build = Path(work) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator,
                        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(build), f"-j{os.cpu_count() or 2}", "--target",
                        *LLAMA_TARGETS], check=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in LLAMA_TARGETS:
            shutil.copy2(build / "bin" / name, bin_dir / name)
    return bin_dir


def openvino_venv(root: Path) -> Path:
    """The python of OpenVINO GenAI's own venv under `root`, built once (kept apart from
    batchinfer's, whose torch and transformers it must not disturb)."""
    venv = root / "venv"
    python = venv / "bin" / "python"
    stamp = venv / "pins.txt"
    wanted = "\n".join((OPENVINO_TORCH, *OPENVINO_PINS))
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"installing OpenVINO GenAI into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    constraints = root / "constraints.txt"
    constraints.write_text(OPENVINO_TORCH + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    subprocess.run([*pip, OPENVINO_TORCH], check=True)
    subprocess.run([*pip, *OPENVINO_PINS], check=True)
    # optimum-intel requires torchvision (for vision models), and PyPI's is a CUDA build that
    # cannot load beside the CPU torch; transformers then fails on import. Text models need none.
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "torchvision"],
                   check=True)
    stamp.write_text(wanted)
    return python


# Run by the OpenVINO venv's python: transformers reads the GGUF (dequantized to float32), not
# batchinfer's own converter, so a mistake of ours cannot reach the peer's model.
GGUF_TO_HF = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
"""


def openvino_models(python: Path, root: Path, gguf: Path, formats: list[str]) -> dict[str, Path]:
    """OpenVINO IR folders of the GGUF, one per `--weight-format`, exported once each into
    `root/models/<format>` (through a Hugging Face folder `root/hf`, also made once)."""
    hf = root / "hf"
    if not (hf / "config.json").exists():
        print(f"converting {gguf.name} to a Hugging Face folder", flush=True)
        with tempfile.TemporaryDirectory(dir=root) as work:
            subprocess.run([str(python), "-c", GGUF_TO_HF, str(gguf.parent), gguf.name, work],
                           check=True)
            shutil.rmtree(hf, ignore_errors=True)
            Path(work).rename(hf)
    cli = python.parent / "optimum-cli"
    folders = {}
    for fmt in formats:
        folder = root / "models" / fmt
        if not (folder / "openvino_model.xml").exists():
            print(f"exporting the OpenVINO model ({fmt})", flush=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            # int4 groups weights along the 576-wide hidden dimension: 128 does not divide it.
            group = ["--group-size", "64"] if fmt == "int4" else []
            with tempfile.TemporaryDirectory(dir=folder.parent) as work:
                subprocess.run([str(cli), "export", "openvino", "--model", str(hf), "--task",
                                "text-generation-with-past", "--weight-format", fmt, *group,
                                work], check=True)
                shutil.rmtree(folder, ignore_errors=True)
                Path(work).rename(folder)
        folders[fmt] = folder
    return folders


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """One run of llama-bench: pp512, tg128 (from an empty cache) and tg128 @ d512 (after 512
    tokens in the cache, as ours is measured) tokens per second."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "512", "-n",
                          "128", "-d", "0,512", "-t", str(threads), "-r", "1", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    figures = {}
    for test in json.loads(out):
        key = "pp512" if test["n_prompt"] else "tg128"
        if test.get("n_depth"):
            key += f"@d{test['n_depth']}"
        figures[key] = float(test["avg_ts"])
    return figures


def one_sequence(args: argparse.Namespace, bin_dir: Path, gguf: Path, weights: list[str]
                 ) -> dict[str, dict[str, float]]:
    """llama-bench and ours, round robin for `--repeats` rounds (a load that comes and goes
    falls on both); medians. Ours: time to the first token of a 512-token prompt (pp512),
    decode of 128 tokens after a 1-token prompt (tg128) and after the 512-token one
    (tg128@d512). With float32 weights (`none`), each round also times streaming their bytes
    once (`step_profile.stream_seconds`): float32 decode's memory floor, as tokens per
    second."""
    llms = {form: LLM("default", dtype="float32", num_threads=args.threads, **engine_form(form),
                      enable_prefix_caching=False, kv_cache_memory="512M") for form in weights}
    rounds: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for key, value in llama_bench(bin_dir, gguf, args.threads).items():
            rounds.setdefault("llama.cpp", {}).setdefault(key, []).append(value)
        for form, llm in llms.items():
            ttft_s, deep = speed(llm, 1)
            _, shallow = speed(llm, 1, prompt_len=1)
            for key, value in (("pp512", 512 / ttft_s), ("tg128", shallow),
                               ("tg128@d512", deep)):
                rounds.setdefault(f"batchinfer {form}", {}).setdefault(key, []).append(value)
            if form == "none":
                floor_tok_s = 1 / stream_seconds(weight_bytes(llm.engine.worker.loaded.model))
                for key in ("tg128", "tg128@d512"):
                    rounds.setdefault(FLOOR, {}).setdefault(key, []).append(floor_tok_s)
                rounds[FLOOR].setdefault("pp512", []).append(float("nan"))
        print(f"round: { {name: {k: v[-1] for k, v in r.items()} for name, r in rounds.items()} }",
              flush=True)
    return {name: {key: statistics.median(values) for key, values in figures.items()}
            for name, figures in rounds.items()}


def serve_llama(bin_dir: Path, gguf: Path, threads: int, bench: BenchConfig, log: Path
                ) -> Any:
    port = free_port()
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", "32", "-c", str(32 * 2048),
               "-t", str(threads), "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (log: {log})")
            time.sleep(0.25)
        return bench_serve(dataclasses.replace(bench, base_url=base_url))
    finally:
        stop_process(process, 30.0)


def llama_half(args: argparse.Namespace, weights: list[str], result_dir: Path) -> None:
    """llama.cpp's one sequence and serving figures next to ours (see the module docstring)."""
    bin_dir = build_llama_cpp(Path(args.llama_dir), args.llama_version)
    gguf = default_gguf_path()

    one = one_sequence(args, bin_dir, gguf, weights)

    served = weights[-1]
    serving: dict[str, dict[int, dict[str, float]]] = {"llama.cpp": {}, "batchinfer": {}}
    for concurrency in map(int, args.concurrency.split(",")):
        bench = BenchConfig(
            endpoint="completions", num_prompts=max(8, 2 * concurrency) if concurrency < 32
            else concurrency, request_rate=float("inf"), max_concurrency=concurrency,
            input_len=args.input_len, output_len=args.output_len, seed=args.seed,
            result_dir=str(result_dir), plots=False, show_progress=False, num_warmups=1,
        )
        runs = {
            "llama.cpp": lambda b=bench, c=concurrency: serve_llama(
                bin_dir, gguf, args.threads, dataclasses.replace(b, result_name=f"llama-c{c}"),
                result_dir / f"llama-c{c}.log"),
            "batchinfer": lambda b=bench, c=concurrency: serve_ours(
                b, c, served, args.threads, result_dir),
        }
        for name, run in runs.items():
            m = run().metrics
            serving[name][concurrency] = {
                "output_tok_s": m.output_throughput,
                "ttft_p50_ms": m.ttft.p50_ms if m.ttft else float("nan"),
                "ttft_p99_ms": m.ttft.p99_ms if m.ttft else float("nan"),
                "completed": m.completed, "failed": m.failed,
            }
            print(f"{name} c={concurrency}: {serving[name][concurrency]}", flush=True)

    print(f"\nCPU: {cpu_model()}; {args.threads} threads; GGUF {gguf.name}")
    print(f"one sequence, medians of {args.repeats} rounds: prefill 512 tokens; decode 128 "
          "from an empty cache (tg128) and after 512 tokens (tg128@d512)")
    print(f"{'':24}{'pp512 tok/s':>12}{'ratio':>7}{'tg128 tok/s':>13}{'ratio':>7}"
          f"{'tg128@d512':>12}{'ratio':>7}")
    base = one["llama.cpp"]
    for name, figures in one.items():
        print(f"{name:24}" + "".join(
            f"{figures[key]:{width}.1f}{figures[key] / base[key]:6.2f}x"
            for key, width in (("pp512", 12), ("tg128", 13), ("tg128@d512", 12))))
    if FLOOR in one:
        floor, float32 = one[FLOOR], one["batchinfer none"]
        print(f"float32 decode against its memory floor: tg128 {float32['tg128']:.1f} / "
              f"{floor['tg128']:.1f} tok/s = {float32['tg128'] / floor['tg128']:.2f}x "
              f"(medians of each round's figures)")
    print(f"\n{'serving (' + served + ')':24}{'concurrency':>12}{'llama.cpp tok/s':>17}"
          f"{'batchinfer tok/s':>18}{'ratio':>8}{'TTFT p99 (s) l / b':>22}")
    for concurrency, ours in serving["batchinfer"].items():
        theirs = serving["llama.cpp"][concurrency]
        print(f"{'':24}{concurrency:12}{theirs['output_tok_s']:17.1f}"
              f"{ours['output_tok_s']:18.1f}{ours['output_tok_s'] / theirs['output_tok_s']:7.2f}x"
              f"{theirs['ttft_p99_ms'] / 1e3:11.2f} / {ours['ttft_p99_ms'] / 1e3:.2f}")
    summary = {"cpu": cpu_model(), "args": vars(args), "one_sequence": one, "serving": serving}
    (result_dir / "vs_peers.json").write_text(json.dumps(summary, indent=2))




def burst_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The offline burst: `batchinfer bench`'s synthetic prompts (same seed and lengths as the
    serving runs) as token ids of the embedded model, and each request's output length."""
    requests = synthetic_workload(args.burst, parse_length_spec(args.input_len, "--input-len"),
                                  parse_length_spec(args.output_len, "--output-len"), args.seed)
    tokenizer = load_tokenizer(convert_gguf(default_gguf_path(), default_cache_dir()))
    prompts = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    return prompts, [r.max_tokens for r in requests]


def ours_burst(llm: LLM, prompts: list[list[int]], lengths: list[int]
               ) -> tuple[float, list[list[int]]]:
    """Seconds of one `LLM.generate` over the whole burst, and each request's output tokens."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert [len(t) for t in tokens] == lengths
    return seconds, tokens


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of output tokens that are the same at the same position: both run greedy on
    the same weights, so a low figure would mean OpenVINO runs some other model."""
    same = sum(a == b for x, y in zip(ours, theirs, strict=True)
               for a, b in zip(x, y, strict=True))
    return same / sum(map(len, ours))


def figures(runs: dict[str, list[float]], output_tokens: int) -> dict[str, Any]:
    """Medians of the rounds as tokens per second, and every round's seconds."""
    return {"burst_tok_s": output_tokens / statistics.median(runs["burst_s"]),
            "decode_tok_s": statistics.median(runs["decode_tok_s"]),
            "prefill_tok_s": 512 / statistics.median(runs["ttft_s"]), "runs": runs}


def openvino_half(args: argparse.Namespace, weights: list[str], result_dir: Path) -> None:
    """Each weight form's burst and single stream, ours then OpenVINO GenAI's (its runner in its
    own venv), back to back so that both see the same machine; one table and one JSON."""
    root = Path(args.openvino_dir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    python = openvino_venv(root)
    models = openvino_models(python, root, default_gguf_path(),
                             [OPENVINO_FORMS[engine_form(form)["quantization"]]
                              for form in weights])
    setup_s = time.perf_counter() - start
    prompts, lengths = burst_workload(args)
    single = [(37 * i + 11) % 40000 + 100 for i in range(512)]  # speed()'s prompt
    runner = Path(__file__).resolve().parent / "openvino_runner.py"
    rows: dict[str, dict[str, Any]] = {}
    theirs: dict[str, Any] = {}
    for form in weights:
        fmt = OPENVINO_FORMS[engine_form(form)["quantization"]]
        load = os.getloadavg()[0]  # another process on these cores skews both sides
        # The engine's defaults (2 GiB of KV cache, 64 sequences, 2048 tokens a step), which
        # OpenVINO's scheduler gets too.
        llm = LLM("default", dtype="float32", **engine_form(form), num_threads=args.threads,
                  enable_prefix_caching=False)
        config = llm.engine.config
        ours_burst(llm, prompts[:2], lengths[:2])  # warm-up
        job = result_dir / f"openvino-{fmt}-job.json"
        job.write_text(json.dumps({
            "model": str(models[fmt]), "threads": args.threads, "repeats": 1,
            "prompts": prompts, "max_tokens": lengths, "single_prompt": single,
            "cache_gb": max(1, config.kv_cache_memory >> 30),
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "kv_cache_precision": args.openvino_kv_cache,
        }))
        # Rounds alternate between the two (OpenVINO's runner starts anew each round, untimed),
        # so a load that comes and goes on this shared machine falls on both.
        ours_runs: dict[str, list[float]] = {"burst_s": [], "ttft_s": [], "decode_tok_s": []}
        theirs_runs: dict[str, list[float]] = {key: [] for key in ours_runs}
        for _ in range(args.repeats):
            seconds, ours_tokens = ours_burst(llm, prompts, lengths)
            ours_runs["burst_s"].append(seconds)
            ttft_s, decode = speed(llm, 1)
            ours_runs["ttft_s"].append(ttft_s)
            ours_runs["decode_tok_s"].append(decode)
            out = subprocess.run([str(python), str(runner), str(job)], check=True,
                                 capture_output=True, text=True).stdout
            theirs = json.loads(out.strip().splitlines()[-1])
            for key, runs in theirs_runs.items():
                runs.extend(theirs[key])
        del llm
        rows[form] = {"openvino_format": fmt, "load_before": load,
                      "openvino_kv_cache": theirs["kv_cache"],
                      "same_tokens": agreement(ours_tokens, theirs["outputs"]),
                      "batchinfer": figures(ours_runs, sum(lengths)),
                      "openvino": figures(theirs_runs, sum(lengths))}
        print(f"{form} / {fmt}: {rows[form]}", flush=True)

    print(f"\nCPU: {cpu_model()}; {args.threads} threads; OpenVINO {theirs['openvino']} "
          f"(GenAI {theirs['openvino_genai']}); KV cache: OV's own choice (key/value), "
          f"batchinfer's float32 (float16 in +kv16 forms)")
    print(f"burst: {len(prompts)} requests at once, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(lengths)} output tokens; one stream: 512-token prompt, 128 decoded; "
          f"medians of {args.repeats} alternated rounds; same tok: the burst's greedy output "
          f"tokens that OpenVINO's match at the same position")
    print(f"{'weights (ours / OV)':20}{'OV KV':>8}{'same tok':>9}{'burst out tok/s':>24}"
          f"{'decode tok/s':>24}{'prefill 512 tok/s':>20}")
    print(f"{'':37}{'ours':>8}{'OV':>8}{'ratio':>8}{'ours':>8}{'OV':>8}{'ratio':>8}"
          f"{'ours':>10}{'OV':>10}")
    for form, row in rows.items():
        a, b, kv = row["batchinfer"], row["openvino"], row["openvino_kv_cache"]
        print(f"{form + ' / ' + row['openvino_format']:20}"
              f"{kv.get('key', '?') + '/' + kv.get('value', '?'):>8}{row['same_tokens']:9.1%}"
              f"{a['burst_tok_s']:8.1f}{b['burst_tok_s']:8.1f}"
              f"{a['burst_tok_s'] / b['burst_tok_s']:7.2f}x"
              f"{a['decode_tok_s']:8.1f}{b['decode_tok_s']:8.1f}"
              f"{a['decode_tok_s'] / b['decode_tok_s']:7.2f}x"
              f"{a['prefill_tok_s']:10.1f}{b['prefill_tok_s']:10.1f}")
    print("1-minute load average before each form: " + ", ".join(
        f"{form} {row['load_before']:.2f}" for form, row in rows.items())
        + f", after: {os.getloadavg()[0]:.2f}")
    best = max(rows.values(), key=lambda r: r["openvino"]["burst_tok_s"])
    best_tok_s = best["openvino"]["burst_tok_s"]
    print(f"burst against OpenVINO's best format ({best['openvino_format']}, "
          f"{best_tok_s:.1f} tok/s): " + ", ".join(
              f"{form} {row['batchinfer']['burst_tok_s'] / best_tok_s:.2f}x"
              for form, row in rows.items()))
    summary = {
        "cpu": cpu_model(), "threads": args.threads, "args": vars(args),
        "openvino": theirs["openvino"], "openvino_genai": theirs["openvino_genai"],
        "openvino_pins": [OPENVINO_TORCH, *OPENVINO_PINS],
        "openvino_setup_s": setup_s,
        "burst": {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                  "output_tokens": sum(lengths)},
        "forms": rows,
    }
    (result_dir / "vs_openvino.json").write_text(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="llama.cpp,openvino",
                        help="which halves to run: llama.cpp, openvino or both")
    parser.add_argument("--llama-dir", default=str(default_cache_dir() / "llama.cpp"))
    parser.add_argument("--llama-version", default="0.3.36")
    parser.add_argument("--openvino-dir", default=str(default_cache_dir() / "openvino-genai"))
    parser.add_argument("--openvino-kv-cache", default="",
                        help="OpenVINO's KV_CACHE_PRECISION (u8, f32, ...); default: its CPU "
                        "plugin's choice")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--weights", default=None,
                        help="batchinfer --quantization forms (default: none,q4 against "
                        "llama.cpp, the last one served; none,q8,q4 against OpenVINO, whose "
                        "int8 meets our int8 or q8; a +a8 suffix, as q4+a8, adds "
                        "--prefill-activations int8, +kv16 --kv-cache-dtype float16)")
    parser.add_argument("--concurrency", default="1,4,32")
    parser.add_argument("--burst", type=int, default=32, help="requests of the offline burst")
    parser.add_argument("--input-len", default="24:400")
    parser.add_argument("--output-len", default="16:128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="results/vs_peers")
    args = parser.parse_args()
    peers = args.peers.split(",")
    if not peers or set(peers) - {"llama.cpp", "openvino"}:
        parser.error(f"--peers {args.peers!r}: expected llama.cpp, openvino or both")
    weights = args.weights.split(",") if args.weights else None
    try:
        forms = {engine_form(w)["quantization"] for w in weights or ()}
    except ValueError as exc:
        parser.error(str(exc))
    if "openvino" in peers and forms - set(OPENVINO_FORMS):
        parser.error(f"--weights {args.weights!r}: OpenVINO pairs only {list(OPENVINO_FORMS)}")
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    if "llama.cpp" in peers:
        llama_half(args, weights or ["none", "q4"], result_dir)
    if "openvino" in peers:
        openvino_half(args, weights or ["none", "q8", "q4"], result_dir)


def serve_ours(bench: BenchConfig, concurrency: int, form: str, threads: int,
               result_dir: Path) -> Any:
    knobs = engine_form(form)
    flags = ("--quantization", knobs["quantization"], "--prefill-activations",
             knobs["prefill_activations"], "--kv-cache-dtype", knobs["kv_cache_dtype"],
             "--dtype", "float32", "--num-threads", str(threads), "--max-num-seqs", "32")
    server = SweepServer(label=f"batchinfer-{form}", batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    log = result_dir / f"batchinfer-c{concurrency}.log"
    with running_server(server, sweep, log) as base_url:
        return bench_serve(dataclasses.replace(bench, base_url=base_url,
                                               result_name=f"batchinfer-c{concurrency}"))


if __name__ == "__main__":
    main()
