"""`batchinfer tune`: from a latency budget to a measured best serving configuration.

The order of work the users' first article gives: the latency budget first, then the batch
configuration, measured with warm-up at several loads while watching the real batch size.

Search: a coarse set of configurations (`COARSE`: continuous batching at a few `max_num_seqs` /
`max_num_batched_tokens`, the `interactive` preset, dynamic batching), then a hill climb from
the best one (each knob of its form doubled and halved, one at a time, while that improves the
score), until every neighbour is tried, `--max-configs` is reached or `--time-budget` would be
passed. Each configuration is a `batchinfer serve` process (`bench.sweep.running_server`).

Score of a configuration: the highest request rate (of `--rate`, ascending; or, with
`--find-max-rate`, fractions of the capacity the first configuration reaches in a burst) at
which every SLO percentile holds. A point (configuration, rate) is measured `--repeats` times
(2 at least); when two runs of a point disagree by more than `--margin` (relative, on any SLO
metric), it is measured once more, and the point is judged on the median of its runs, so no
configuration wins on one lucky run. Rates above the first failing one are not measured. Ties
go to the higher goodput (requests meeting every per-request SLO, per second) at that rate.

The result directory holds `runs.jsonl` (every run: rerunning skips those measured, so an
interrupted tune resumes), and what `tune_report` writes from the runs: `summary.json`,
`table.md`, `best-config.yaml` (for `batchinfer serve --config`), `goodput-vs-rate.png` and
`latency-vs-batch.png`.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shlex
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import BenchResult
from batchinfer.bench.metrics import latency_values_s
from batchinfer.bench.serve import run_async, run_with_progress
from batchinfer.bench.sweep import SERVE_COMMAND, SweepConfig, SweepServer, running_server
from batchinfer.bench.tune_report import print_table, write_outputs
from batchinfer.bench.workload import parse_length_spec

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2el)_p(\d+(?:\.\d+)?)$")
# The coarse grid: (label, knobs). Knobs are serve flags without dashes.
COARSE: tuple[dict[str, Any], ...] = (
    {"batching": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 2048},
    {"batching": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    {"batching": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 512},
    {"batching": "continuous", "max_num_seqs": 64, "preset": "interactive"},
    {"batching": "dynamic", "max_batch_size": 16, "max_batch_delay_ms": 10},
)
# Knobs the hill climb doubles and halves, per batching form, with their bounds.
CLIMB: dict[str, dict[str, tuple[float, float]]] = {
    "continuous": {"max_num_seqs": (1, 1024), "max_num_batched_tokens": (64, 65536)},
    "dynamic": {"max_batch_size": (1, 1024), "max_batch_delay_ms": (0.5, 1000)},
}
CAPACITY_FRACTIONS = (0.3, 0.5, 0.7, 0.85, 1.0)
RUNS_FILE = "runs.jsonl"


@dataclass(frozen=True)
class TuneConfig:
    """One `batchinfer tune`; `ValueError` names a bad flag."""

    slo: dict[str, float]  # e.g. {"ttft_p99": 2000, "tpot_p99": 150} (ms)
    result_dir: str
    input_len: str = "64:512"
    output_len: str = "32:256"
    rates: tuple[float, ...] = ()  # empty: find the rates from the capacity
    time_budget_s: float = 1200.0
    num_prompts: int = 40
    num_warmups: int = 4
    repeats: int = 2
    margin: float = 0.25
    max_configs: int | None = None
    seed: int = 0
    engine: dict[str, Any] = field(default_factory=dict)  # knobs every server gets (model...)
    server_cmd: tuple[str, ...] = SERVE_COMMAND

    @property
    def server_flags(self) -> tuple[str, ...]:
        return tuple(knob_flags(self.engine))

    def setup(self) -> str:
        """What a stored run depends on besides its configuration and rate: a run measured
        under another workload or model is not read back."""
        return json.dumps({"input": self.input_len, "output": self.output_len,
                           "num_prompts": self.num_prompts, "num_warmups": self.num_warmups,
                           "seed": self.seed, "engine": self.engine}, sort_keys=True)

    def __post_init__(self) -> None:
        if not self.slo:
            raise ValueError("--slo needs at least one KEY=MS, e.g. ttft_p99=2000")
        for key, value in self.slo.items():
            match = SLO_KEY.match(key)
            if not match or not 0 < float(match.group(2)) <= 100:
                raise ValueError(f"--slo {key!r}: expected METRIC_pN with METRIC one of "
                                 f"{', '.join(SLO_METRICS)} and 0 < N <= 100 (e.g. ttft_p99)")
            if not value > 0:
                raise ValueError(f"--slo {key}: the limit must be > 0 ms")
        parse_length_spec(self.input_len, "--workload input")
        parse_length_spec(self.output_len, "--workload output")
        if any(not r > 0 or math.isinf(r) for r in self.rates):
            raise ValueError("--rate values must be finite and > 0")
        if not self.time_budget_s > 0:
            raise ValueError("--time-budget must be > 0")
        if self.num_prompts < 1 or self.num_warmups < 0:
            raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
        if self.repeats < 2:
            raise ValueError("--repeats must be at least 2: a point is never judged on one run")
        if not 0 < self.margin < 1:
            raise ValueError("--margin must be in (0, 1)")
        if self.max_configs is not None and self.max_configs < 1:
            raise ValueError("--max-configs must be >= 1")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p99=2000,tpot_p99=150' -> {"ttft_p99": 2000.0, "tpot_p99": 150.0}."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: expected KEY=MS, e.g. ttft_p99=2000") from None
    return out


def parse_workload(text: str) -> tuple[str, str]:
    """'input=64:512,output=32:256' -> ("64:512", "32:256")."""
    parts = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    unknown = set(parts) - {"input", "output"}
    if unknown or not parts:
        raise ValueError(f"--workload {text!r}: expected input=MIN:MAX,output=MIN:MAX")
    return parts.get("input", "64:512"), parts.get("output", "32:256")


def parse_duration(text: str) -> float:
    """'90s', '20m', '1.5h' or plain seconds -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None:
        raise ValueError(f"--time-budget {text!r}: expected a duration such as 90s, 20m, 1h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def config_key(knobs: dict[str, Any]) -> str:
    return ",".join(f"{k}={knobs[k]:g}" if isinstance(knobs[k], float) else f"{k}={knobs[k]}"
                    for k in sorted(knobs))


def knob_flags(knobs: dict[str, Any]) -> list[str]:
    """`serve` flags saying what `knobs` (field name -> value) say."""
    flags: list[str] = []
    for name, value in knobs.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", f"{value:g}" if isinstance(value, float) else str(value)]
    return flags


@dataclass
class Point:
    """One (configuration, rate) and its runs."""

    rate: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, metric: str) -> float | None:
        values = [r[metric] for r in self.runs if r.get(metric) is not None]
        return statistics.median(values) if values else None

    def spread(self, metric: str) -> float:
        """(max - min) / median over the runs: how far they disagree."""
        values = [r[metric] for r in self.runs if r.get(metric) is not None]
        if len(values) < 2:
            return 0.0
        middle = statistics.median(values)
        return (max(values) - min(values)) / middle if middle > 0 else 0.0


@dataclass
class Candidate:
    knobs: dict[str, Any]
    points: dict[float, Point] = field(default_factory=dict)
    score: float = 0.0  # highest passing rate
    goodput: float = 0.0  # at that rate
    failure: str | None = None  # why the first failing rate failed (or the server did)

    @property
    def key(self) -> str:
        return config_key(self.knobs)


class Tuner:
    def __init__(self, config: TuneConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.dir = Path(config.result_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runs_path = self.dir / RUNS_FILE
        self.done = self._load_runs()
        self.started_s = time.monotonic()
        self.candidates: dict[str, Candidate] = {}
        self.rates: tuple[float, ...] = tuple(sorted(set(config.rates)))
        self.out_of_time = False
        self.startup_s = 30.0  # a server's start, until one is measured
        self.fresh = False  # the server just started: the next run warms it up first
        self.url: str | None = None  # the current configuration's server, once started

    # --- measuring ------------------------------------------------------------------------

    def _load_runs(self) -> dict[tuple[str, float, int], dict[str, Any]]:
        """The runs an earlier tune of the same setup measured (others are ignored)."""
        done: dict[tuple[str, float, int], dict[str, Any]] = {}
        setup = self.config.setup()
        if self.runs_path.exists():
            for line in self.runs_path.read_text().splitlines():
                try:
                    run = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if run.get("setup") == setup:
                    done[(run["config"], float(run["rate"]), int(run["repeat"]))] = run
        return done

    def remaining_s(self) -> float:
        return self.config.time_budget_s - (time.monotonic() - self.started_s)

    def _bench(self, base_url: str, rate: float, repeat: int) -> BenchConfig:
        c = self.config
        goodput = {k.split("_")[0]: v for k, v in c.slo.items()
                   if k.split("_")[0] in ("ttft", "tpot", "e2el")}
        return BenchConfig(base_url=base_url, endpoint="completions", num_prompts=c.num_prompts,
                           input_len=c.input_len, output_len=c.output_len, request_rate=rate,
                           num_warmups=c.num_warmups if self.fresh else 0,
                           seed=c.seed + repeat, goodput_slos_ms=goodput, plots=False,
                           show_progress=False,
                           request_timeout_s=max(10.0, min(600.0, self.remaining_s())))

    def _expected_s(self, rate: float) -> float:
        """A run's likely length: its arrivals plus a margin for the tail."""
        return (self.config.num_prompts / rate if not math.isinf(rate) else 10.0) * 1.3 + 5.0

    def measure(self, candidate: Candidate, base_url: Callable[[], str], rate: float,
                repeat: int) -> dict[str, Any] | None:
        """One run (or the stored one); None when the budget would not cover it."""
        stored = self.done.get((candidate.key, rate, repeat))
        if stored is not None:
            return stored
        startup_s = self.startup_s if self.url is None else 0.0
        if self._expected_s(rate) + startup_s > self.remaining_s():
            self.out_of_time = True
            return None
        url = base_url()
        result = run_async(run_with_progress(self._bench(url, rate, repeat), self.console))
        self.fresh = False
        run = self._summarize(candidate, rate, repeat, result)
        with open(self.runs_path, "a") as out:
            out.write(json.dumps(run) + "\n")
        self.done[(candidate.key, rate, repeat)] = run
        return run

    def _summarize(self, candidate: Candidate, rate: float, repeat: int,
                   result: BenchResult) -> dict[str, Any]:
        import numpy as np

        m = result.metrics
        run: dict[str, Any] = {"config": candidate.key, "knobs": candidate.knobs,
                               "rate": rate if math.isfinite(rate) else "inf",
                               "repeat": repeat, "completed": m.completed, "failed": m.failed,
                               "request_throughput": m.request_throughput,
                               "output_throughput": m.output_throughput,
                               "goodput": m.goodput, "duration_s": m.duration_s}
        run["setup"] = self.config.setup()
        values = latency_values_s(result.results)
        # Every metric at the usual percentiles (a rerun with another SLO reads them back),
        # and the SLO's own percentiles.
        wanted = {f"{m}_p{p}": (m, float(p)) for m in SLO_METRICS for p in (50, 90, 95, 99)}
        for key in self.config.slo:
            metric, percentile = SLO_KEY.match(key).groups()  # type: ignore[union-attr]
            wanted[key] = (metric, float(percentile))
        for key, (metric, percentile) in wanted.items():
            samples = values[metric]
            run[key] = float(np.percentile(samples, percentile)) * 1000 if samples else None
        server = result.server.mean if result.server is not None else {}
        run["batch_size"] = server.get("batch_size")
        run["running"] = server.get("running")
        return run

    def judge(self, point: Point) -> tuple[bool, str]:
        """Whether the SLO holds on the point's medians (failed requests fail it), and why
        not."""
        if any(r["failed"] for r in point.runs):
            return False, f"{sum(r['failed'] for r in point.runs)} failed request(s)"
        for key, limit in self.config.slo.items():
            value = point.median(key)
            if value is None or value > limit:
                shown = "n/a" if value is None else f"{value:.0f}"
                return False, f"{key} {shown} ms > {limit:g} ms at {point.rate:g} req/s"
        return True, ""

    def disagree(self, point: Point) -> bool:
        return any(point.spread(key) > self.config.margin for key in self.config.slo)

    def evaluate(self, knobs: dict[str, Any]) -> Candidate:
        """Measure the configuration's rates, lowest first, until one fails (or the budget
        ends). Its server starts at the first run not already in `runs.jsonl`."""
        candidate = Candidate(dict(knobs))
        self.candidates[candidate.key] = candidate
        flags = (*self.config.server_flags, *knob_flags(
            {k: v for k, v in knobs.items() if k != "batching"}))
        server = SweepServer(label=candidate.key, batching=knobs["batching"], flags=flags)
        sweep = SweepConfig(bench=self._bench("http://127.0.0.1:1", 1.0, 0),
                            result_dir=str(self.dir), batching=(knobs["batching"],),
                            server_cmd=self.config.server_cmd, server_start_timeout_s=600)
        self.console.print(f"[bold]configuration[/bold] {candidate.key}")
        log = self.dir / f"server-{len(self.candidates)}.log"
        with contextlib.ExitStack() as stack:
            def base_url() -> str:
                if self.url is None:
                    begun = time.monotonic()
                    self.url = stack.enter_context(running_server(server, sweep, log))
                    self.startup_s = time.monotonic() - begun
                    self.fresh = True
                return self.url

            self.url = None

            try:
                if not self.rates:
                    self.rates = self._find_rates(candidate, base_url)
                for rate in self.rates:
                    point = candidate.points.setdefault(rate, Point(rate))
                    if not self._measure_point(candidate, point, base_url):
                        break
                    ok, why = self.judge(point)
                    self._report(candidate, point, ok)
                    if not ok:
                        candidate.failure = why
                        break
                    candidate.score = rate
                    candidate.goodput = point.median("goodput") or 0.0
            except ValueError as exc:  # the server did not start with these knobs
                candidate.failure = f"server: {exc}"
                self.console.print(f"  [red]{candidate.failure}[/red]")
        if self.out_of_time and candidate.failure is None:
            candidate.failure = "the time budget ended"
        return candidate

    def _measure_point(self, candidate: Candidate, point: Point,
                       base_url: Callable[[], str]) -> bool:
        repeats = self.config.repeats
        for repeat in range(repeats + 1):
            if repeat == repeats and not self.disagree(point):
                break  # the runs agree: no extra run
            run = self.measure(candidate, base_url, point.rate, repeat)
            if run is None:
                return False
            point.runs.append(run)
        return True

    def _find_rates(self, candidate: Candidate, base_url: Callable[[], str]
                    ) -> tuple[float, ...]:
        """Rates as fractions of the capacity a burst reaches on the first configuration."""
        burst = self.measure(candidate, base_url, math.inf, 0)
        if burst is None or not burst["request_throughput"]:
            raise ValueError("the capacity burst did not finish within the time budget")
        capacity = burst["request_throughput"]
        self.console.print(f"  capacity (burst): {capacity:.2f} req/s")
        return tuple(round(capacity * f, 3) for f in CAPACITY_FRACTIONS)

    def _report(self, candidate: Candidate, point: Point, ok: bool) -> None:
        cells = ", ".join(
            f"{k} {point.median(k):.0f}±{100 * point.spread(k):.0f}%"
            if point.median(k) is not None else f"{k} n/a" for k in self.config.slo)
        mark = "[green]ok[/green]" if ok else "[red]over[/red]"
        self.console.print(f"  {point.rate:g} req/s: {cells} ({len(point.runs)} runs) {mark}")

    # --- searching ------------------------------------------------------------------------

    def neighbours(self, knobs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for name, (low, high) in CLIMB.get(knobs["batching"], {}).items():
            value = knobs.get(name)
            if value is None:
                continue
            for factor in (2.0, 0.5):
                new = value * factor
                new = int(new) if isinstance(value, int) else new
                if low <= new <= high and new != value:
                    yield {**knobs, name: new}

    def can_go_on(self) -> bool:
        if self.out_of_time or self.remaining_s() <= 0:
            return False
        limit = self.config.max_configs
        return limit is None or len(self.candidates) < limit

    def run(self) -> Candidate | None:
        for knobs in COARSE:
            if not self.can_go_on():
                break
            self.evaluate(knobs)
        best = self.best()
        while best is not None and self.can_go_on():
            improved = False
            for knobs in self.neighbours(best.knobs):
                if config_key(knobs) in self.candidates:
                    continue
                if not self.can_go_on():
                    break
                candidate = self.evaluate(knobs)
                if self._better(candidate, best):
                    best, improved = candidate, True
                    break
            if not improved:
                break
        return self.best()

    @staticmethod
    def _better(a: Candidate, b: Candidate) -> bool:
        return (a.score, a.goodput) > (b.score, b.goodput)

    def best(self) -> Candidate | None:
        passing = [c for c in self.candidates.values() if c.score > 0]
        if not passing:
            return None
        return max(passing, key=lambda c: (c.score, c.goodput))


# --- output -------------------------------------------------------------------------------

def serve_command(config: TuneConfig, knobs: dict[str, Any]) -> str:
    return shlex.join(["batchinfer", "serve", *config.server_flags, *knob_flags(knobs)])


def tune(config: TuneConfig, console: Console | None = None) -> int:
    """Run the search and write its outputs; 0 when a configuration meets the SLO, else 1."""
    console = console or Console()
    tuner = Tuner(config, console)
    best = tuner.run()
    paths = write_outputs(tuner, best, None if best is None else serve_command(config,
                                                                              best.knobs))
    print_table(console, tuner, best)
    for kind, path in paths.items():
        console.print(f"{kind}: {path}")
    if tuner.out_of_time:
        console.print("[yellow]stopped at the time budget[/yellow]")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in config.slo.items())
    if best is None:
        failed = [c for c in tuner.candidates.values() if c.failure]
        if not failed and tuner.out_of_time:
            console.print(f"[red]the time budget ended before any configuration was measured "
                          f"against the SLO {slo}: raise --time-budget or lower "
                          f"--num-prompts[/red]")
            return 1
        reason = f" (e.g. {failed[0].key}: {failed[0].failure})" if failed else ""
        console.print(f"[red]no configuration met the SLO {slo} at any rate tried{reason}: "
                      f"relax the SLO, lower --rate or shorten the workload[/red]")
        return 1
    if tuner.rates and best.score >= max(tuner.rates):
        console.print("[yellow]the best configuration held the SLO at the highest rate tried: "
                      "higher rates may hold too (raise --rate)[/yellow]")
    console.print(f"[bold]best:[/bold] {best.key}: {best.score:g} req/s within the SLO")
    console.print(f"  {serve_command(config, best.knobs)}")
    if "config" in paths:
        console.print(f"  batchinfer serve --config {paths['config']}")
    return 0
