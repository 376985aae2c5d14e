"""batchinfer against llama.cpp on the same CPU, the same GGUF and the same threads.

    .venv/bin/python benchmarks/vs_peers.py                          # builds llama.cpp if needed
    .venv/bin/python benchmarks/vs_peers.py --weights none,q4 --concurrency 1,4,32

llama.cpp: its `llama-server`, `llama-bench` and `llama-batched-bench`, built from the source
that the `llama-cpp-python` sdist on PyPI vendors (`--llama-version`), with `GGML_NATIVE`, into
`--llama-dir` (default `$BATCHINFER_CACHE/llama.cpp`) the first time: about 15 minutes on 2
cores, once per machine.

One sequence: `llama-bench -p 512 -n 128` (prefill of 512 tokens, decode of 128, 3 runs) on the
embedded SmolLM2-135M GGUF (Q4_1) next to `LLM.generate` with each `--weights` form: time to the
first token of a 512-token prompt, and decode tokens per second after it (medians of 3, prefix
caching off).

Serving: `llama-server -np 32` and `batchinfer serve` (the last `--weights` form), each measured
by `batchinfer bench serve` with the same seed and workload (prompts `--input-len`, outputs
`--output-len`, `ignore_eos`) at each `--concurrency` (`--max-concurrency`, every request sent
at once): useful output tokens per second, TTFT p50 / p99.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from batchinfer import LLM
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, free_port, running_server, stop_process
from batchinfer.models.hardware import cpu_model
from batchinfer.models.loader import default_cache_dir
from batchinfer.models.registry import default_gguf_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantization import speed  # noqa: E402

LLAMA_TARGETS = ("llama-server", "llama-bench", "llama-batched-bench")


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


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """llama-bench's pp512 and tg128 tokens per second (mean of 3 runs)."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "512", "-n",
                          "128", "-t", str(threads), "-r", "3", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    figures = {}
    for test in json.loads(out):
        key = "pp512" if test["n_prompt"] else "tg128"
        figures[key] = float(test["avg_ts"])
    return figures


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-dir", default=str(default_cache_dir() / "llama.cpp"))
    parser.add_argument("--llama-version", default="0.3.36")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--weights", default="none,q4",
                        help="batchinfer --quantization forms; the last one is served")
    parser.add_argument("--concurrency", default="1,4,32")
    parser.add_argument("--input-len", default="24:400")
    parser.add_argument("--output-len", default="16:128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="results/vs_peers")
    args = parser.parse_args()
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = build_llama_cpp(Path(args.llama_dir), args.llama_version)
    gguf = default_gguf_path()
    weights = args.weights.split(",")

    one = {"llama.cpp": llama_bench(bin_dir, gguf, args.threads)}
    print(f"llama.cpp: {one['llama.cpp']}", flush=True)
    for form in weights:
        llm = LLM("default", dtype="float32", num_threads=args.threads, quantization=form,
                  enable_prefix_caching=False, kv_cache_memory="512M")
        ttft_s, decode = speed(llm, args.repeats)
        one[f"batchinfer {form}"] = {"pp512": 512 / ttft_s, "tg128": decode}
        print(f"batchinfer {form}: {one[f'batchinfer {form}']}", flush=True)
        del llm

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
    print(f"{'one sequence':24}{'prefill 512 tok/s':>20}{'decode tok/s':>14}{'vs llama.cpp':>14}")
    base = one["llama.cpp"]
    for name, figures in one.items():
        print(f"{name:24}{figures['pp512']:20.1f}{figures['tg128']:14.1f}"
              f"{figures['tg128'] / base['tg128']:13.2f}x")
    print(f"\n{'serving (' + served + ')':24}{'concurrency':>12}{'llama.cpp tok/s':>17}"
          f"{'batchinfer tok/s':>18}{'ratio':>8}{'TTFT p99 (s) l / b':>22}")
    for concurrency, ours in serving["batchinfer"].items():
        theirs = serving["llama.cpp"][concurrency]
        print(f"{'':24}{concurrency:12}{theirs['output_tok_s']:17.1f}"
              f"{ours['output_tok_s']:18.1f}{ours['output_tok_s'] / theirs['output_tok_s']:7.2f}x"
              f"{theirs['ttft_p99_ms'] / 1e3:11.2f} / {ours['ttft_p99_ms'] / 1e3:.2f}")
    summary = {"cpu": cpu_model(), "args": vars(args), "one_sequence": one, "serving": serving}
    (result_dir / "vs_peers.json").write_text(json.dumps(summary, indent=2))


def serve_ours(bench: BenchConfig, concurrency: int, form: str, threads: int,
               result_dir: Path) -> Any:
    flags = ("--quantization", form, "--dtype", "float32", "--num-threads", str(threads),
             "--max-num-seqs", "32")
    server = SweepServer(label=f"batchinfer-{form}", batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    log = result_dir / f"batchinfer-c{concurrency}.log"
    with running_server(server, sweep, log) as base_url:
        return bench_serve(dataclasses.replace(bench, base_url=base_url,
                                               result_name=f"batchinfer-c{concurrency}"))


if __name__ == "__main__":
    main()
