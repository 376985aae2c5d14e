"""`batchinfer bench sweep`: the same workload against each batching configuration and rate.

For each configuration (batching form x engine flags) it starts a server as a subprocess,
`[python, -m, batchinfer.cli.main, serve, --host, 127.0.0.1, --port, P, --batching, FORM, ...]`,
waits for `GET /health` to answer 200, runs the workload at every request rate, and stops the
server by its PID (SIGTERM, then SIGKILL after a timeout). `server_cmd` replaces the first
four words, so the machinery runs against any server that takes those flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import BenchResult
from batchinfer.bench.plots import plot_sweep
from batchinfer.bench.report import write_json
from batchinfer.bench.serve import run_async, run_with_progress, save_result
from batchinfer.core.config import BATCHING_FORMS, EngineConfig
from batchinfer.core.validation import check_choice

SERVE_COMMAND = (sys.executable, "-m", "batchinfer.cli.main", "serve")


@dataclass(frozen=True)
class SweepServer:
    """One server a sweep starts: its label, batching form and the engine flags passed through
    (the server's own knobs are `server.app.ServerConfig`)."""

    label: str
    batching: str
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class SweepConfig:
    """A sweep: configurations from the product of the lists, each run at every rate with the
    `bench` workload. `--max-batch-size` is varied only for static and dynamic batching and
    `--max-batch-delay-ms` only for dynamic (the forms they apply to)."""

    bench: BenchConfig
    result_dir: str
    batching: tuple[str, ...] = ("static", "dynamic", "continuous")
    request_rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, math.inf)
    model: str | None = None
    max_num_seqs: tuple[int, ...] = ()
    max_batch_size: tuple[int, ...] = ()
    max_batch_delay_ms: tuple[float, ...] = ()
    server_args: tuple[str, ...] = ()
    server_cmd: tuple[str, ...] = SERVE_COMMAND
    server_start_timeout_s: float = 600.0
    server_stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for form in self.batching:
            check_choice("--batching", form, BATCHING_FORMS)
        if not self.batching or not self.request_rates:
            raise ValueError("--batching and --request-rate need at least one value each")
        if any(not r > 0 for r in self.request_rates):
            raise ValueError("--request-rate values must be > 0 (or inf)")
        if not self.server_cmd:
            raise ValueError("--server-cmd must not be empty")
        if self.server_start_timeout_s <= 0 or self.server_stop_timeout_s <= 0:
            raise ValueError("--server-start-timeout-s and --server-stop-timeout-s must be > 0")


def sweep_servers(sweep: SweepConfig) -> list[SweepServer]:
    """The servers of a sweep, one per configuration, in a stable order."""
    servers = []
    for form in sweep.batching:
        batch_sizes = sweep.max_batch_size if form != "continuous" else ()
        delays = sweep.max_batch_delay_ms if form == "dynamic" else ()
        for seqs in sweep.max_num_seqs or (None,):
            for size in batch_sizes or (None,):
                for delay in delays or (None,):
                    label, flags = form, []
                    if sweep.model is not None:
                        flags += ["--model", sweep.model]
                    for flag, value, tag in (("--max-num-seqs", seqs, "seqs"),
                                             ("--max-batch-size", size, "bs"),
                                             ("--max-batch-delay-ms", delay, "delay")):
                        if value is not None:
                            flags += [flag, f"{value:g}"]
                            label += f"-{tag}{value:g}"
                    servers.append(SweepServer(label, form, (*flags, *sweep.server_args)))
    return servers


def static_form_warnings(sweep: SweepConfig, server: SweepServer) -> list[str]:
    """Workloads a static-batching server cannot finish: it runs a batch only once a full one
    waits, so fewer requests in flight than a batch never start, and a partial last batch waits
    until the request timeout."""
    if server.batching != "static":
        return []
    flags = dict(zip(server.flags[::2], server.flags[1::2], strict=False))
    defaults = EngineConfig()
    size = min(int(flags.get("--max-batch-size", defaults.max_batch_size)),
               int(flags.get("--max-num-seqs", defaults.max_num_seqs)))
    bench, warnings = sweep.bench, []
    if bench.max_concurrency is not None and bench.max_concurrency < size:
        warnings.append(f"--max-concurrency {bench.max_concurrency} < batch size {size}: "
                        "a static batch never fills")
    for flag, count in (("--num-prompts", bench.num_prompts), ("--num-warmups", bench.num_warmups)):
        if count % size:
            warnings.append(f"{flag} {count} is not a multiple of the batch size {size}: "
                            "the last partial batch waits for --request-timeout-s")
    return warnings


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(
    server: SweepServer, sweep: SweepConfig, log_path: Path
) -> Iterator[str]:
    """Start `server`, yield its base URL once `/health` answers 200, stop it on exit."""
    port = free_port()
    command = [*sweep.server_cmd, "--host", "127.0.0.1", "--port", str(port),
               "--batching", server.batching, *server.flags]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, base_url, sweep.server_start_timeout_s, log_path)
        yield base_url
    finally:
        stop_process(process, sweep.server_stop_timeout_s)


def _wait_healthy(
    process: subprocess.Popen[bytes], base_url: str, timeout_s: float, log_path: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ValueError(f"server exited with code {process.returncode} before it was "
                                 f"healthy: {_last_line(log_path)} (log: {log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            time.sleep(0.25)
    raise ValueError(f"server not healthy after {timeout_s:g} s (log: {log_path})")


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the process by its PID; SIGKILL it if it is still alive after `timeout_s`."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def run_sweep(sweep: SweepConfig, console: Console | None = None) -> list[dict[str, Any]]:
    """Run every configuration at every rate; write per-run files, `sweep.json` and
    `sweep.png` into `result_dir`, print the comparison table, and return its rows."""
    console = console or Console()
    out_dir = Path(sweep.result_dir)
    points: list[dict[str, Any]] = []
    for server in sweep_servers(sweep):
        console.print(f"[bold]sweep[/bold]: starting server {server.label}")
        for warning in static_form_warnings(sweep, server):
            console.print(f"[yellow]warning[/yellow] ({server.label}): {warning}")
        with running_server(server, sweep, out_dir / f"server-{server.label}.log") as base_url:
            for rate in sweep.request_rates:
                config = dataclasses.replace(sweep.bench, base_url=base_url, request_rate=rate,
                                             result_dir=None)
                result = run_async(run_with_progress(config, console))
                stem = f"{server.label}-rate{_rate_text(rate)}"
                files = save_result(result, out_dir, stem)
                points.append(sweep_point(server, rate, result, files["json"].name))
    write_json({"sweep": _sweep_json(sweep), "points": points}, out_dir / "sweep.json")
    plot_sweep(points, out_dir / "sweep.png")
    console.print(comparison_table(points))
    console.print(f"sweep: {out_dir / 'sweep.json'}, {out_dir / 'sweep.png'}")
    return points


def _rate_text(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def sweep_point(
    server: SweepServer, rate: float, result: BenchResult, file_name: str
) -> dict[str, Any]:
    """One row of the comparison: the headline numbers of one run."""
    m = result.metrics
    server_mean = result.server.mean if result.server is not None else {}
    return {
        "label": server.label, "batching": server.batching, "flags": list(server.flags),
        "rate": _rate_text(rate), "completed": m.completed, "failed": m.failed,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "goodput": m.goodput,
        "p50_ttft_ms": m.ttft.p50_ms if m.ttft else None,
        "p99_ttft_ms": m.ttft.p99_ms if m.ttft else None,
        "p99_tpot_ms": m.tpot.p99_ms if m.tpot else None,
        "p99_e2el_ms": m.e2el.p99_ms if m.e2el else None,
        "client_in_flight": m.mean_concurrent_requests,
        "server_batch_size": server_mean.get("batch_size"),
        "server_running": server_mean.get("running"),
        "server_waiting": server_mean.get("waiting"),
        "result_file": file_name,
    }


def _sweep_json(sweep: SweepConfig) -> dict[str, Any]:
    data = {f.name: getattr(sweep, f.name) for f in dataclasses.fields(sweep) if f.name != "bench"}
    data["request_rates"] = [_rate_text(r) for r in sweep.request_rates]
    data["bench"] = sweep.bench.to_json()
    return data


def comparison_table(points: Sequence[dict[str, Any]]) -> Table:
    columns = (("label", "config", "{}"), ("rate", "rate", "{}"),
               ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "tok/s", "{:.1f}"),
               ("goodput", "goodput", "{:.2f}"), ("p50_ttft_ms", "p50 TTFT", "{:.1f}"),
               ("p99_ttft_ms", "p99 TTFT", "{:.1f}"), ("p99_tpot_ms", "p99 TPOT", "{:.1f}"),
               ("client_in_flight", "client in flight", "{:.1f}"),
               ("server_batch_size", "seqs/step", "{:.1f}"),
               ("server_waiting", "waiting", "{:.1f}"), ("failed", "failed", "{}"))
    table = Table(title="Sweep: batching forms compared (latencies in ms)")
    for _, title, _ in columns:
        table.add_column(title, justify="right")
    for point in points:
        table.add_row(*["-" if point.get(key) is None else fmt.format(point[key])
                        for key, _, fmt in columns])
    return table
