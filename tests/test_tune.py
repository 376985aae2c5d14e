"""`batchinfer tune` on a tiny model with a tiny budget: it measures each point at least twice,
writes its table, plots and a config file that `serve --config` turns into the same engine
config; it resumes from its runs; an SLO nothing meets ends with a clear message and exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchinfer.bench.tune import (
    Point,
    TuneConfig,
    Tuner,
    parse_duration,
    parse_slo,
    parse_workload,
)
from batchinfer.cli.main import main
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tune"))


def tune_argv(model: Path, result_dir: Path, slo: str, max_configs: int) -> list[str]:
    return ["tune", "--slo", slo, "--workload", "input=8:16,output=4:8", "--rate", "3",
            "--num-prompts", "6", "--num-warmups", "1", "--max-configs", str(max_configs),
            "--time-budget", "5m", "--result-dir", str(result_dir), "--model", str(model),
            "--dtype", "float32", "--kv-cache-memory", "16M", "--no-enable-prefix-caching"]


@pytest.mark.slow  # a whole tune: servers started per configuration
def test_tune_writes_a_config_that_serve_reads_back(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    argv = tune_argv(model, out, "ttft_p99=60000,tpot_p99=60000", max_configs=2)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    configs = {r["config"] for r in runs}
    assert len(configs) == 2
    for config in configs:  # every point measured at least twice
        assert len([r for r in runs if r["config"] == config]) >= 2
    assert all(r["failed"] == 0 and r["ttft_p99"] is not None for r in runs)
    table = (out / "table.md").read_text()
    assert table.count("| ok |") == 2 and "±" in table
    summary = json.loads((out / "summary.json").read_text())
    best = summary["best"]
    assert best["rate"] == 3.0 and best["command"].startswith("batchinfer serve")
    assert (out / "goodput-vs-rate.png").stat().st_size > 0
    assert (out / "latency-vs-batch.png").stat().st_size > 0
    assert "batchinfer serve --config" in printed

    # The config file is what `serve --config` reads; it yields the winner's engine config.
    config_file = out / "best-config.yaml"
    knobs = yaml.safe_load(config_file.read_text())
    assert knobs["model"] == str(model) and knobs["enable-prefix-caching"] is False
    assert main(["serve", "--config", str(config_file), "--print-config"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    flags = [part for key, value in best["knobs"].items()
             for part in (f"--{key.replace('_', '-')}", str(value))]
    assert main(["serve", "--model", str(model), "--dtype", "float32", "--kv-cache-memory",
                 "16M", "--no-enable-prefix-caching", *flags, "--print-config"]) == 0
    assert from_file == json.loads(capsys.readouterr().out)

    # Rerun: every run is read back, none measured again, same winner; also under another
    # SLO percentile (each run keeps p50/p90/p95/p99 of every metric).
    size = (out / "runs.jsonl").stat().st_size
    assert main(argv) == 0
    assert (out / "runs.jsonl").stat().st_size == size
    assert json.loads((out / "summary.json").read_text())["best"] == best
    other_slo = [a if a != "ttft_p99=60000,tpot_p99=60000" else "ttft_p90=60000" for a in argv]
    assert main(other_slo) == 0
    assert (out / "runs.jsonl").stat().st_size == size
    # Another workload is another setup: its runs are measured, not read back.
    changed = [{"input=8:16,output=4:8": "input=8:12,output=4:6"}.get(a, a) for a in argv]
    changed[changed.index("--max-configs") + 1] = "1"
    assert main(changed) == 0
    assert (out / "runs.jsonl").stat().st_size > size


@pytest.mark.slow  # a whole tune: servers started per configuration
def test_an_slo_nothing_meets_exits_1_with_the_reason(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(tune_argv(model, tmp_path / "t", "ttft_p99=0.001", max_configs=1)) == 1
    printed = capsys.readouterr().out
    assert "no configuration met the SLO ttft_p99 <= 0.001 ms" in " ".join(printed.split())
    assert not (tmp_path / "t" / "best-config.yaml").exists()


def test_points_are_judged_on_medians_and_remeasured_when_runs_disagree(tmp_path: Path) -> None:
    tuner = Tuner(TuneConfig(slo={"ttft_p99": 100.0}, result_dir=str(tmp_path), margin=0.2))
    steady = Point(1.0, [{"ttft_p99": 90.0, "failed": 0}, {"ttft_p99": 95.0, "failed": 0}])
    assert tuner.judge(steady) == (True, "") and not tuner.disagree(steady)
    lucky = Point(2.0, [{"ttft_p99": 60.0, "failed": 0}, {"ttft_p99": 150.0, "failed": 0}])
    assert tuner.disagree(lucky)  # one lucky run does not decide: a third run is taken
    lucky.runs.append({"ttft_p99": 140.0, "failed": 0})
    ok, why = tuner.judge(lucky)
    assert not ok and "ttft_p99 140 ms > 100 ms" in why
    broken = Point(1.0, [{"ttft_p99": 10.0, "failed": 1}, {"ttft_p99": 10.0, "failed": 0}])
    assert tuner.judge(broken)[0] is False


@pytest.mark.parametrize(("call", "message"), [
    (lambda: parse_slo("ttft_p99"), "KEY=MS"),
    (lambda: TuneConfig(slo={"latency_p99": 1.0}, result_dir="x"), "METRIC_pN"),
    (lambda: TuneConfig(slo={"ttft_p99": 1.0}, result_dir="x", repeats=1), "at least 2"),
    (lambda: parse_duration("soon"), "90s, 20m, 1h"),
    (lambda: parse_workload("prompt=1:2"), "input=MIN:MAX"),
])
def test_bad_tune_input_names_the_flag(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
    assert parse_duration("20m") == 1200 and parse_duration("90s") == 90
    assert parse_slo("ttft_p99=2000,tpot_p99=150") == {"ttft_p99": 2000.0, "tpot_p99": 150.0}
