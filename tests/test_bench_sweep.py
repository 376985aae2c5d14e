"""`bench sweep`: configurations, server start/stop, comparison files (fake server as server)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.sweep import (
    SweepConfig,
    SweepServer,
    running_server,
    static_form_warnings,
    stop_process,
    sweep_servers,
)
from batchinfer.cli.main import main

FAKE_SERVER = str(Path(__file__).with_name("fake_openai_server.py"))


def test_configurations_vary_only_the_flags_that_apply() -> None:
    sweep = SweepConfig(bench=BenchConfig(), result_dir="x", model="tiny",
                        batching=("static", "dynamic", "continuous"),
                        max_batch_size=(8, 16), max_batch_delay_ms=(2.0,), max_num_seqs=(32,),
                        server_args=("--device", "cpu"))
    servers = sweep_servers(sweep)
    assert [s.label for s in servers] == [
        "static-seqs32-bs8", "static-seqs32-bs16", "dynamic-seqs32-bs8-delay2",
        "dynamic-seqs32-bs16-delay2", "continuous-seqs32"]
    assert servers[2].flags == ("--model", "tiny", "--max-num-seqs", "32", "--max-batch-size",
                                "8", "--max-batch-delay-ms", "2", "--device", "cpu")
    assert servers[4].batching == "continuous"


def test_static_form_warnings() -> None:
    bench = BenchConfig(num_prompts=20, num_warmups=8, max_concurrency=4)
    sweep = SweepConfig(bench=bench, result_dir="x", batching=("static", "continuous"),
                        max_batch_size=(8,))
    static, continuous = sweep_servers(sweep)
    warnings = static_form_warnings(sweep, static)
    assert len(warnings) == 2
    assert "never fills" in warnings[0] and "--num-prompts 20" in warnings[1]
    assert static_form_warnings(sweep, continuous) == []


def test_sweep_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="--batching"):
        SweepConfig(bench=BenchConfig(), result_dir="x", batching=("eager",))
    with pytest.raises(ValueError, match="--request-rate"):
        SweepConfig(bench=BenchConfig(), result_dir="x", request_rates=(0.0,))


def test_sweep_cli_against_fake_servers(tmp_path: Path) -> None:
    rc = main(["bench", "sweep", "--batching", "static,continuous", "--request-rate", "inf,40",
               "--server-cmd", f"{sys.executable} {FAKE_SERVER} --ttft-ms 5 --itl-ms 1",
               "--max-num-seqs", "16", "--num-prompts", "6", "--input-len", "8",
               "--output-len", "4", "--goodput", "ttft:1000", "--result-dir", str(tmp_path),
               "--no-plots", "--no-progress", "--server-start-timeout-s", "60"])
    assert rc == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    points = data["points"]
    assert [(p["label"], p["rate"]) for p in points] == [
        ("static-seqs16", "inf"), ("static-seqs16", "40"),
        ("continuous-seqs16", "inf"), ("continuous-seqs16", "40")]
    for point in points:
        assert point["completed"] == 6 and point["failed"] == 0
        assert point["goodput"] > 0 and point["p99_ttft_ms"] > 0
        assert (tmp_path / point["result_file"]).exists()
    assert data["sweep"]["request_rates"] == ["inf", "40"]
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    log = (tmp_path / "server-static-seqs16.log").read_text()
    assert "--batching static" in log and "--max-num-seqs 16" in log and "--port" in log


def test_server_that_dies_at_start_is_a_one_line_error(tmp_path: Path) -> None:
    sweep = SweepConfig(bench=BenchConfig(), result_dir=str(tmp_path),
                        server_cmd=(sys.executable, "-c", "print('no model here'); exit(3)"))
    with pytest.raises(ValueError, match="exited with code 3.*no model here"), \
            running_server(SweepServer("static", "static"), sweep, tmp_path / "s.log"):
        pass


def test_stop_kills_a_server_that_ignores_sigterm() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "print('ready', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout.readline() == b"ready\n"
    stop_process(process, timeout_s=0.3)
    assert process.returncode == -9
    process.stdout.close()


@pytest.mark.slow
def test_tiny_sweep_against_the_real_server(tmp_path: Path) -> None:
    # Batches of 2 divide both the 2 warm-ups and the 8 prompts: a static server runs only
    # full batches, and would hold a partial one until the request timeout.
    rc = main(["bench", "sweep", "--batching", "static,dynamic,continuous",
               "--max-batch-size", "2", "--request-rate", "4,inf", "--num-prompts", "8",
               "--input-len", "16", "--output-len", "8", "--num-warmups", "2",
               "--result-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert len(points) == 6 and all(p["completed"] == 8 for p in points)
    assert all(p["server_batch_size"] is not None for p in points)
    assert not math.isnan(points[0]["output_throughput"])
