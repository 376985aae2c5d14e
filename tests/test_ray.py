"""Scale-out on Ray, on one local cluster for the module (`ray.init(num_cpus=2)`): two Serve
replicas of a tiny model answer the `openai` client as `batchinfer serve` does (plain and
streamed, errors included), both serve, each replica's metrics reach Ray's export with its
label, a client that leaves stops its request; `run-batch --ray` writes what `run-batch` writes.
Slow: a replica killed under load is replaced while its requests end cleanly, prefix routing
keeps a prefix on one replica, a killed Ray Data actor's batch is retried, `serve --ray` as a
process.

Start-up on a busy machine (two cores running other work): every wait for Ray, Serve, a
deployment or a replica returns as soon as the thing is ready and gives up only after minutes,
and the deadlines Ray applies itself are raised (`SLOW_MACHINE_ENV`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from batchinfer.bench.scrape import parse_metrics  # noqa: E402
from batchinfer.cli.main import main  # noqa: E402
from batchinfer.core.config import EngineConfig  # noqa: E402
from batchinfer.integrations.ray_routing import prefix_key  # noqa: E402
from batchinfer.integrations.ray_serve import (  # noqa: E402
    REPLICA_DEPLOYMENT,
    RayServeConfig,
    build_application,
    parse_autoscale,
    replica_options,
)
from batchinfer.server.app import ServerConfig, build_app  # noqa: E402
from tests.test_server import free_port, run_server  # noqa: E402
from tests.test_server_cli import wait_healthy  # noqa: E402
from tests.tiny_models import make_tiny_llama  # noqa: E402

APP = "batchinfer-test"
READY_S = 120.0  # how long a start-up may take before a test gives up on it
# Ray's own start-up deadlines, raised: Serve's controller gives a proxy 5 s to report ready
# and kills it after three misses, then 10 s per health check; the driver waits 30 s for the
# GCS port; the raylet gives a new worker 60 s to register. Environment variables: a local
# cluster's processes inherit them from the driver that starts it (`serve --ray` included),
# and each reads them when it imports Ray.
SLOW_MACHINE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(READY_S),
                    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": str(READY_S / 2),
                    "RAY_gcs_server_port_wait_time_s": str(int(READY_S)),
                    "RAY_worker_register_timeout_seconds": str(int(READY_S))}
# Workers at normal priority, as `connect` starts them: at Ray's default nice 15 any other
# work on the machine starves them.
SLOW_MACHINE_SYSTEM = {"worker_niceness": 0}
# The engines a test compares (on Ray and local) answer alike only if they compute alike: one
# torch thread each, as the actors get from their half CPU. The kernels are picked by timing at
# start-up and the pick is kept per thread count, so engines of one thread count read the
# same pick; engines of others may time (on a busy machine, differently) into other kernels,
# whose rounding can part a long greedy answer from the reference on one token.
SAME_MATH = {"num_threads": 1}
SAME_MATH_FLAGS = ["--num-threads", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ray"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """One local Ray cluster and Serve instance for the module; metrics exported each second."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in SLOW_MACHINE_ENV.items():
            env.setenv(name, value)
        metrics_port, http_port = free_port(), free_port()
        start_ray(metrics_port)
        try:
            base_url = start_serve(http_port)
            yield {"base_url": base_url,
                   "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


def start_ray(metrics_port: int, attempts: int = 2) -> None:
    """`ray.init` for the module's cluster, tried again from scratch if a start-up step ran
    past one of Ray's internal deadlines."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port,
                     _system_config={"metrics_report_interval_ms": 1000, **SLOW_MACHINE_SYSTEM},
                     logging_level="WARNING")
            return
        except Exception:
            ray.shutdown()
            if attempt == attempts:
                raise


def start_serve(http_port: int) -> str:
    """Start Serve with its proxy on `http_port`; its base URL once the proxy answers.
    `serve.start` waits a fixed 60 s for the proxy: past that, the controller it started goes
    on starting the proxy, and a second call only connects to it."""
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    except TimeoutError:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    base_url = f"http://127.0.0.1:{http_port}"
    # Any answer: the proxy says 503 (no routes yet) until an application is deployed.
    wait_for(lambda: status_of(f"{base_url}/-/healthz") is not None, what="Ray Serve's proxy")
    return base_url


def status_of(url: str) -> int | None:
    """The status code `url` answers with; None while nothing answers there."""
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return None


@contextlib.contextmanager
def deployed(cluster: dict[str, str], model: Path, routing: str = "default",
             num_replicas: int = 2, max_num_seqs: int = 4, server: ServerConfig | None = None
             ) -> Iterator[EngineConfig]:
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_num_seqs=max_num_seqs,
                                      kv_cache_memory="16M", seed=0, **SAME_MATH)
    app = build_application(config, server or ServerConfig(), RayServeConfig(
        num_replicas=num_replicas, cpus_per_replica=0.5, routing=routing,
        metrics_interval_s=0.5, health_check_timeout_s=READY_S))
    serve.run(app, name=APP, route_prefix="/", blocking=False)  # returns once it is RUNNING
    try:
        # The proxy learns the new route from the controller a moment later.
        wait_for(lambda: status_of(f"{cluster['base_url']}/v1/models") == 200,
                 what="the application's route on the proxy")
        yield config
    finally:
        serve.delete(APP)


def ray_series(metrics_url: str, name: str) -> dict[str, float]:
    """replica -> value of Ray's exported `ray_<name>` (summed over the other labels)."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"ray_{name}" and "replica" in sample.labels:
                replica = sample.labels["replica"]
                out[replica] = out.get(replica, 0.0) + sample.value
    return out


def wait_for(condition, timeout_s: float = READY_S, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what} did not hold within {timeout_s:g} s")


# --- no cluster needed ---------------------------------------------------------------------

def test_replica_options_follow_the_engine_knobs() -> None:
    config = EngineConfig.from_kwargs(model="unused", device="cpu", max_num_seqs=16,
                                      num_threads=2)
    server = ServerConfig(max_num_queued_requests=100)
    fixed = replica_options(config, server, RayServeConfig(num_replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 116
    assert fixed["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0}
    assert fixed["health_check_timeout_s"] == 30.0
    scaled = replica_options(config, server, RayServeConfig(autoscale=parse_autoscale("1:4"),
                                                            cpus_per_replica=0.5))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 16}
    assert scaled["ray_actor_options"]["num_cpus"] == 0.5 and "num_replicas" not in scaled
    routed = replica_options(config, server, RayServeConfig(routing="prefix"))
    assert routed["request_router_config"].request_router_kwargs == {"imbalance": 16}


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_replicas": 0}, "num_replicas"), ({"autoscale": (3, 2)}, "autoscale"),
    ({"routing": "random"}, "routing"), ({"cpus_per_replica": 0}, "cpus_per_replica"),
    ({"target_ongoing_requests": -1}, "target_ongoing_requests"),
    ({"health_check_timeout_s": 0}, "health_check_timeout_s"),
])
def test_ray_serve_config_names_a_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RayServeConfig(**kwargs)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_autoscale("4")


@pytest.mark.parametrize("argv", [
    ["serve", "--num-replicas", "2"], ["serve", "--ray-routing", "prefix"],
    ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--lines-per-batch", "8"],
])
def test_ray_flags_without_ray_are_refused(argv: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "needs --ray" in capsys.readouterr().err


def test_prefix_key_reads_the_prompt_start() -> None:
    def chat(text: str) -> bytes:
        return json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": text}]}).encode()

    shared = "x" * 300
    assert prefix_key("/v1/chat/completions", chat(shared + "a"), 256) == \
        prefix_key("/v1/chat/completions", chat(shared + "b"), 256)
    assert prefix_key("/v1/chat/completions", chat("a" + shared), 256) != \
        prefix_key("/v1/chat/completions", chat("b" + shared), 256)
    completion = json.dumps({"prompt": "hello world"}).encode()
    assert prefix_key("/v1/completions", completion, 256) is not None
    assert prefix_key("/v1/completions", b"{not json", 256) is None
    assert prefix_key("/v1/embeddings", completion, 256) is None


def test_ray_metrics_export_is_read_as_the_sum_over_replicas() -> None:
    text = "\n".join([
        "# TYPE ray_batchinfer_num_requests_running gauge",
        'ray_batchinfer_num_requests_running{replica="a",WorkerId="1"} 3.0',
        'ray_batchinfer_num_requests_running{replica="b",WorkerId="2"} 4.0',
        "# TYPE ray_batchinfer_batch_size_sum gauge",
        'ray_batchinfer_batch_size_sum{replica="a"} 30.0',
        'ray_batchinfer_batch_size_sum{replica="b"} 10.0',
        "# TYPE ray_batchinfer_batch_size_count gauge",
        'ray_batchinfer_batch_size_count{replica="a"} 10.0',
        'ray_batchinfer_batch_size_count{replica="b"} 10.0',
    ]) + "\n"
    sample = parse_metrics(text)
    assert sample.gauges["running"] == 7.0
    assert sample.histograms["batch_size"] == (40.0, 20.0)


# --- on the cluster ------------------------------------------------------------------------

def test_two_replicas_answer_like_batchinfer_serve(cluster: dict[str, str], model: Path) -> None:
    base_url = cluster["base_url"]
    question = {"model": "default", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 12, "temperature": 0}
    with deployed(cluster, model) as config:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        on_ray = client.chat.completions.create(**question).choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(**question, stream=True)
                           if chunk.choices)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="default", prompt="x", max_tokens=-1)
        assert bad.value.body["param"] == "max_tokens"
        # The Batch API stays off behind Ray (a job would live in one replica): a clear 503.
        files = httpx.get(f"{base_url}/v1/files")
        assert files.status_code == 503 and "run-batch --ray" in files.json()["error"]["message"]
        # Both replicas serve (Ray's export carries each one's counter under its label).
        prompts = [f"prompt number {i}" for i in range(16)]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
                responses = await asyncio.gather(*[
                    http.post("/v1/completions", json={"model": "default", "prompt": p,
                                                       "max_tokens": 8, "ignore_eos": True})
                    for p in prompts])
            return [r.status_code for r in responses]

        assert asyncio.run(burst()) == [200] * 16
        served = wait_for(lambda: (s := ray_series(cluster["metrics_url"],
                                                   "batchinfer_request_success_total"))
                          and len(s) == 2 and sum(s.values()) >= 18 and s,
                          what="both replicas' request counters in Ray's export")
        assert all(n > 0 for n in served.values()), served
        sample = parse_metrics(httpx.get(cluster["metrics_url"]).text)
        assert sample.histograms["batch_size"][1] > 0  # steps, summed over the replicas

        # A client that leaves mid-stream: its replica stops the request (counted as abort).
        def aborted() -> float:
            text = httpx.get(cluster["metrics_url"]).text
            return sum(sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples
                       if sample.name == "ray_batchinfer_request_success_total"
                       and sample.labels.get("finished_reason") == "abort")

        aborts_before = aborted()
        body = {"model": "default", "prompt": "long", "max_tokens": 3500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        # Counted as an abort: it stopped when the client left, it did not run its 3,500 tokens.
        wait_for(lambda: aborted() >= aborts_before + 1, what="the abandoned request aborted")
        assert sum(ray_series(cluster["metrics_url"],
                              "batchinfer_num_requests_running").values()) == 0

    with run_server(build_app(config)) as local:
        reference = openai.OpenAI(base_url=f"{local}/v1", api_key="unused")
        direct = reference.chat.completions.create(**question).choices[0].message.content
    assert on_ray == direct == streamed and direct


def lines_file(path: Path, n: int, tokens: int = 1) -> Path:
    rows = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "default", "prompt": f"line {i}", "ignore_eos": True,
                                 "max_tokens": tokens + i % 6, "temperature": 0}})
            for i in range(n)]
    rows.insert(5, "{not json")
    rows.append(json.dumps({"custom_id": "chat", "method": "POST",
                            "url": "/v1/chat/completions",
                            "body": {"model": "default", "max_tokens": 4, "temperature": 0,
                                     "messages": [{"role": "user", "content": "hi"}]}}))
    path.write_text("\n".join(rows) + "\n")
    return path


def comparable(path: Path) -> list[tuple]:
    out = []
    # Split at "\n" only: answers keep characters such as U+2028 raw, which splitlines() cuts.
    for line in path.read_text().split("\n")[:-1]:
        row = json.loads(line)
        body = row["response"]["body"]
        if isinstance(body, dict) and "choices" in body:
            body = {"choices": body["choices"], "usage": body["usage"]}
        out.append((row["custom_id"], row["response"]["status_code"], json.dumps(body)))
    return out


@pytest.mark.slow
def test_run_batch_ray_writes_what_run_batch_writes(cluster: dict[str, str], model: Path,
                                                    tmp_path: Path) -> None:
    source = lines_file(tmp_path / "in.jsonl", 30)
    flags = ["-i", str(source), "--model", str(model), "--no-progress", "--max-num-seqs", "4",
             "--dtype", "float32", "--kv-cache-memory", "16M", *SAME_MATH_FLAGS]
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["run-batch", "-o", str(local), *flags]) == 0
    assert main(["run-batch", "--ray", "--num-replicas", "2", "--ray-cpus-per-replica", "0.5",
                 "--lines-per-batch", "7", "-o", str(on_ray), *flags]) == 0
    assert comparable(on_ray) == comparable(local)
    assert len(comparable(local)) == 32
    # Resuming: a rerun answers nothing again.
    before = on_ray.read_text()
    assert main(["run-batch", "--ray", "-o", str(on_ray), *flags]) == 0
    assert on_ray.read_text() == before


# --- slow ----------------------------------------------------------------------------------

def replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if f"#{REPLICA_DEPLOYMENT}#" in a["name"] and f"::{APP}#" in a["name"]]


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_its_requests_end_cleanly(
        cluster: dict[str, str], model: Path) -> None:
    base_url = cluster["base_url"]

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, bool]:
        body = {"model": "default", "prompt": f"request {i}", "max_tokens": 1500,
                "ignore_eos": True, "stream": i % 2 == 0}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
        return r.status_code, text, body["stream"]

    def busy_replica() -> str | None:
        """The actor of a replica that Ray's export shows running a request."""
        running = ray_series(cluster["metrics_url"], "batchinfer_num_requests_running")
        return next((name for name in replica_actors() for replica, n in running.items()
                     if n > 0 and name.endswith(f"#{replica}")), None)

    async def load() -> list[tuple[int, str, bool]]:
        # Each answer waits behind three others of 1,500 tokens on its replica.
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            tasks = [asyncio.create_task(one(http, i)) for i in range(8)]
            victim = await asyncio.to_thread(wait_for, busy_replica,
                                             what="a replica running a request")
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
            return await asyncio.gather(*tasks)

    with deployed(cluster, model, max_num_seqs=1):
        results = asyncio.run(load())
        failed = 0
        for status, text, stream in results:
            if status == 200 and stream:
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                failed += '"replica_unavailable"' in text
            elif status == 200:
                assert json.loads(text)["usage"]["completion_tokens"] == 1500
            else:
                assert status == 503, (status, text)
                assert json.loads(text)["error"]["code"] == "replica_unavailable"
                failed += 1
        assert failed >= 1, "no request was on the killed replica"
        assert failed < 8
        wait_for(lambda: serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT]
                 .replica_states.get("RUNNING") == 2 and len(replica_actors()) == 2,
                 what="a replacement replica")
        after = httpx.post(f"{base_url}/v1/completions", timeout=60,
                           json={"model": "default", "prompt": "again", "max_tokens": 4})
        assert after.status_code == 200


@pytest.mark.slow
def test_full_queues_answer_429_like_one_server(cluster: dict[str, str], model: Path) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster["base_url"], timeout=600) as http:
            return await asyncio.gather(*[
                http.post("/v1/completions", json={"model": "default", "prompt": f"r{i}",
                                                   "max_tokens": 300, "ignore_eos": True})
                for i in range(12)])

    with deployed(cluster, model, num_replicas=1, max_num_seqs=1,
                  server=ServerConfig(max_num_queued_requests=2)):
        responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.json()["error"]["code"] in ("queue_full", "overloaded")
                           for r in refused)
    assert all(r.status_code in (200, 429) for r in responses)
    assert any(r.status_code == 200 for r in responses)


@pytest.mark.slow
def test_prefix_routing_keeps_a_prefix_on_one_replica(cluster: dict[str, str],
                                                      model: Path) -> None:
    shared = "You are a careful assistant. " * 12
    with deployed(cluster, model, routing="prefix"):
        before = ray_series(cluster["metrics_url"], "batchinfer_request_success_total")

        async def send(i: int) -> int:
            async with httpx.AsyncClient(timeout=READY_S) as http:
                r = await http.post(f"{cluster['base_url']}/v1/completions",
                                    json={"model": "default", "prompt": shared + f"q {i}",
                                          "max_tokens": 2})
                return r.status_code

        async def waves() -> list[int]:
            codes = []
            for wave in range(2):  # concurrent requests, within the router's imbalance (4)
                codes += await asyncio.gather(*[send(4 * wave + i) for i in range(3)])
            return codes

        assert asyncio.run(waves()) == [200] * 6

        def counts() -> dict[str, float]:
            now = ray_series(cluster["metrics_url"], "batchinfer_request_success_total")
            return {k: v - before.get(k, 0.0) for k, v in now.items() if v > before.get(k, 0)}

        wait_for(lambda: sum(counts().values()) == 6, what="6 requests counted")
        assert sorted(counts().values()) == [6.0], counts()
        hits = ray_series(cluster["metrics_url"], "batchinfer_prefix_cache_hits_total")
        assert sum(hits.values()) > 0


@pytest.mark.slow
def test_a_killed_ray_data_actor_has_its_batch_retried(cluster: dict[str, str], model: Path,
                                                       tmp_path: Path) -> None:
    from batchinfer.integrations.ray_data import run_batch_ray

    # Enough lines that the run outlasts the kill by a margin (decode steps of this tiny model
    # take a fraction of a millisecond natively: 40 lines could finish before it).
    source = lines_file(tmp_path / "in.jsonl", 120, tokens=150)
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_num_seqs=2,
                                      kv_cache_memory="16M", seed=0, **SAME_MATH)
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(local), "--model", str(model),
                 "--no-progress", "--max-num-seqs", "2", "--dtype", "float32",
                 "--kv-cache-memory", "16M", *SAME_MATH_FLAGS]) == 0
    from ray._private import state

    def workers() -> list[int]:
        return [a["Pid"] for a in state.actors().values()
                if "MapWorker" in a.get("ActorClassName", "") and a["State"] == "ALIVE"
                and a.get("Pid")]

    import threading

    killed: list[bool] = []  # whether the run was still going when the actor was killed
    finished = threading.Event()

    def kill_one() -> None:
        # Once answers come back, the actors have loaded and each holds a batch.
        wait_for(lambda: on_ray.exists() and on_ray.stat().st_size > 0,
                 what="the first answers")
        pids = wait_for(workers, what="a Ray Data actor")
        os.kill(pids[0], signal.SIGKILL)
        killed.append(not finished.is_set())

    killer = threading.Thread(target=kill_one)
    killer.start()
    run_batch_ray(source, on_ray, config, max_in_flight=4, progress=False, num_replicas=2,
                  cpus_per_replica=0.5, lines_per_batch=5)
    finished.set()
    killer.join()
    assert killed == [True], "the actor was killed after the run ended"
    assert comparable(on_ray) == comparable(local)


@pytest.mark.slow
def test_serve_ray_as_a_process(tmp_path: Path, model: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **SLOW_MACHINE_ENV}
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--ray", "--num-replicas",
               "1", "--ray-cpus-per-replica", "1", "--model", str(model), "--port", str(port),
               "--dtype", "float32", "--kv-cache-memory", "16M", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(base_url, proc, timeout_s=180)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="default", prompt="hi", max_tokens=3)
        assert answer.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
