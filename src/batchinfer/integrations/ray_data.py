"""`batchinfer run-batch --ray`: an OpenAI batch file answered by a pool of engine actors on
Ray Data, written in input order in the same format as the single-machine `run-batch`.

The driver makes the same two passes as `run-batch` (count, duplicate custom_ids refused before
any work, endpoints seen; then the lines an earlier run did not answer, so resuming works the
same). The lines go to Ray Data (`from_items`, order preserved), `map_batches` hands batches of
`lines_per_batch` to an actor pool of `num_replicas` engines (`LineAnswerer`: the server app in
the actor, each line through its handlers, as `run-batch` does), and the driver appends each
answer to the output as it arrives, in input order. An actor that dies is restarted and its
batch retried (Ray Data's actor pools restart and retry without limit by default): answers are
written only once a whole batch is back, so a retried batch is never written twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from batchinfer.batch.executor import LineCounts, retrying, run_lines
from batchinfer.batch.lines import BatchLine, parse_line
from batchinfer.batch.offline import BatchRunResult, pending_texts, read_resume, survey
from batchinfer.core.config import EngineConfig
from batchinfer.integrations.ray_cluster import actor_cpus, actor_engine_config, connect
from batchinfer.server.client import AppClient
from batchinfer.server.offline import run_batch_file


class LineAnswerer:
    """One engine actor of the pool: the server app (generator and/or encoder) in this
    process. `__call__` is a coroutine, so Ray Data hands an actor its next batches while the
    current one finishes (an async actor runs them at once); one window of `max_in_flight`
    lines, shared by all of them, keeps the engine full across batch boundaries instead of
    draining it at the end of each batch."""

    def __init__(self, engine_config: EngineConfig | None, embedding_model: str | None,
                 served_model_name: str | None, max_in_flight: int) -> None:
        from batchinfer.server.app import ServerConfig, build_app

        self.max_in_flight = max_in_flight
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batchinfer-actor-loop",
                         daemon=True).start()
        config = ServerConfig(
            served_model_name=served_model_name, embedding_model=embedding_model,
            max_num_queued_requests=max(1024, 2 * max_in_flight), max_request_bytes=1 << 30,
            load_before_serving=True)
        self.app = build_app(engine_config, config)
        self.lifespan = self.app.router.lifespan_context(self.app)
        future: Future[Any] = asyncio.run_coroutine_threadsafe(self._open(), self.loop)
        future.result()

    async def _open(self) -> None:
        await self.lifespan.__aenter__()
        self.client = AppClient(self.app)
        self.window = asyncio.Semaphore(self.max_in_flight)  # lines in the engine, all batches

    async def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        lines = [parse_line(int(index), str(text))
                 for index, text in zip(batch["index"], batch["text"], strict=True)]
        # The app lives on this actor's own loop thread; Ray Data awaits on its loop.
        answers = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._answer(lines), self.loop))
        return {"index": [line.index for line in lines],
                "output": [json.dumps(answer, ensure_ascii=False) for answer in answers]}

    async def _answer(self, lines: list[BatchLine]) -> list[dict[str, Any]]:
        handler = retrying(self.client, asyncio.Event())

        async def windowed(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
            async with self.window:
                return await handler(url, body)

        answers: list[dict[str, Any]] = []
        await run_lines(lines, windowed, lambda _, result: answers.append(result), len(lines))
        return answers


def run_batch_ray(input_path: Path, output_path: Path, engine_config: EngineConfig,
                  embedding_model: str | None = None, max_in_flight: int = 256,
                  progress: bool = True, served_model_name: str | None = None,
                  num_replicas: int = 1, cpus_per_replica: float | None = None,
                  address: str | None = None, lines_per_batch: int | None = None
                  ) -> BatchRunResult:
    """Answer every line of `input_path` into `output_path` (resuming it) on a pool of
    `num_replicas` engine actors; see the module docstring."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    lines_per_batch = lines_per_batch or max_in_flight
    if lines_per_batch < 1:
        raise ValueError(f"lines_per_batch must be at least 1, got {lines_per_batch}")
    found = survey(input_path)
    resume = read_resume(output_path)
    needs_generator, needs_encoder = found.needs_generator, found.needs_encoder
    if found.num_lines - resume.num_done <= 0 or not (needs_generator or needs_encoder):
        # No model to load (nothing left, or only lines that cannot run): no cluster needed.
        return asyncio.run(run_batch_file(input_path, output_path, engine_config,
                                          embedding_model, max_in_flight, progress,
                                          served_model_name))
    started = connect(address)
    import ray

    try:
        return _run(input_path, output_path, found.num_lines, resume.num_done,
                    engine_config if needs_generator else None,
                    (embedding_model or "default") if needs_encoder else None,
                    served_model_name, max_in_flight, progress, num_replicas,
                    actor_cpus(engine_config, cpus_per_replica), lines_per_batch)
    finally:
        if started:
            ray.shutdown()


def _run(input_path: Path, output_path: Path, num_lines: int, num_done: int,
         engine_config: EngineConfig | None, embedding_model: str | None,
         served_model_name: str | None, max_in_flight: int, progress: bool,
         num_replicas: int, cpus: float, lines_per_batch: int) -> BatchRunResult:
    import ray.data
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    start_s = time.perf_counter()
    resume = read_resume(output_path)
    items = [{"index": index, "text": text} for index, text in pending_texts(input_path, resume)]
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # the run's own bar (lines, tok/s) is the progress
    if not progress:
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    if engine_config is not None:
        engine_config = actor_engine_config(engine_config, cpus)
    dataset = ray.data.from_items(
        items, override_num_blocks=max(1, -(-len(items) // lines_per_batch))
    ).map_batches(
        LineAnswerer, batch_size=lines_per_batch, batch_format="numpy",
        fn_constructor_kwargs={"engine_config": engine_config,
                               "embedding_model": embedding_model,
                               "served_model_name": served_model_name,
                               "max_in_flight": max_in_flight},
        concurrency=num_replicas, num_cpus=cpus)
    counts = LineCounts()
    bar = tqdm(total=len(items), unit="req", disable=not progress, dynamic_ncols=True)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            for row in dataset.iter_rows():
                out.write(row["output"] + "\n")
                out.flush()
                counts.add(json.loads(row["output"]))
                bar.update(1)
    finally:
        bar.close()
    # The actors load while the first lines are sent: the time here includes their loads.
    return BatchRunResult(num_lines, num_done, counts, time.perf_counter() - start_s)
