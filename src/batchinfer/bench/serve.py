"""`batchinfer bench serve` as a function: run, show a live progress bar, print, write files."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchinfer.bench.client import RequestResult
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import BenchResult, run_benchmark
from batchinfer.bench.plots import plot_latency_cdfs, plot_timeline
from batchinfer.bench.report import default_stem, print_summary, result_to_json, write_json

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop when it is installed (cheaper per chunk), else on asyncio's loop."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


async def run_with_progress(config: BenchConfig, console: Console) -> BenchResult:
    """`run_benchmark` with a live bar of finished requests (failures counted on it)."""
    progress = Progress(
        TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("failed: {task.fields[failed]}"), TimeElapsedColumn(),
        console=console, disable=not config.show_progress, transient=True,
    )
    task_id = progress.add_task(f"rate {config.request_rate:g}", total=config.num_prompts,
                                failed=0, start=False)
    num_failed = 0

    def on_start() -> None:
        progress.start()
        progress.start_task(task_id)

    def on_done(result: RequestResult) -> None:
        nonlocal num_failed
        num_failed += not result.success
        progress.update(task_id, advance=1, failed=num_failed)

    # Started when measuring starts, so a failed pre-check prints nothing but its one-line error.
    try:
        return await run_benchmark(config, on_done, on_start)
    finally:
        if progress.live.is_started:
            progress.stop()


def save_result(result: BenchResult, result_dir: Path, stem: str) -> dict[str, Path]:
    """Write `<stem>.json` and, unless disabled, `<stem>_latency_cdf.png` and
    `<stem>_timeline.png` into `result_dir`; return the paths by kind."""
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(result_to_json(result), result_dir / f"{stem}.json")}
    if result.config.plots:
        paths["latency_cdf"] = plot_latency_cdfs(result, result_dir / f"{stem}_latency_cdf.png")
        paths["timeline"] = plot_timeline(result, result_dir / f"{stem}_timeline.png")
    return paths


def bench_serve(config: BenchConfig, console: Console | None = None) -> BenchResult:
    """Run one benchmark, print its tables and write its files (if `config.result_dir`)."""
    console = console or Console()
    result = run_async(run_with_progress(config, console))
    print_summary(result, console)
    if config.result_dir is not None:
        stem = config.result_name or default_stem(config)
        for kind, path in save_result(result, Path(config.result_dir), stem).items():
            console.print(f"{kind}: {path}")
    return result
