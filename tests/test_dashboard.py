"""`/dashboard` and `/dashboard/data` on a live server under load: the page needs nothing from
the network, its JSON fills with the engine's steps and latencies, the API key guards both (as
a header or `?api_key=`), and a headless Chromium renders charts with data points (a DOM query)
and saves a screenshot (skipped where Debian's `chromium` is not installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import run_server
from tests.tiny_models import make_tiny_llama

KEY = "dash-key"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_llama(tmp_path_factory.mktemp("dashboard"), max_position_embeddings=2048)
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_num_seqs=4,
                                      kv_cache_memory="16M", scheduling_policy="priority")
    with run_server(build_app(config, ServerConfig(api_key=KEY))) as base_url:
        yield base_url


def load(base_url: str, n: int = 12) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for i in range(n):
            extra = {"service_tier": "batch"} if i % 3 == 0 else {}
            r = client.post("/v1/completions", json={"model": "default", "prompt": f"hi {i}",
                                                     "max_tokens": 24, "ignore_eos": True,
                                                     **extra})
            assert r.status_code == 200


def test_data_fills_under_load_and_the_key_guards_it(server: str) -> None:
    assert httpx.get(f"{server}/dashboard").status_code == 401
    assert httpx.get(f"{server}/dashboard/data?api_key=wrong").status_code == 401
    # ?api_key= opens the dashboard only: every other route still wants the header.
    assert httpx.get(f"{server}/v1/models?api_key={KEY}").status_code == 401
    assert httpx.get(f"{server}/dashboard/data",
                     cookies={"batchinfer_dashboard_key": "wrong"}).status_code == 401
    with httpx.Client(follow_redirects=True) as browser:
        page = browser.get(f"{server}/dashboard?api_key={KEY}")
        assert page.url.query == b""  # redirected: the key left the address for a cookie
        assert browser.get(f"{server}/dashboard/data").status_code == 200
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Nothing from the network: no script, style or image from elsewhere.
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page.text)
    load(server)
    data = httpx.get(f"{server}/dashboard/data",
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    series = data["series"]
    assert len(series["t"]) >= 1 and all(t <= 0 for t in series["t"])
    assert max(v for v in series["batch_size"] if v is not None) >= 1
    assert sum(series["output_tok_s"]) >= 12 * 24
    assert data["latency"]["all"]["ttft_count"] == 12
    assert data["latency"]["all"]["ttft_p99_ms"] > 0 and data["latency"]["all"]["itl_p50_ms"] > 0
    assert data["latency"]["batch"]["ttft_count"] == 4
    assert data["latency"]["interactive"]["ttft_count"] == 8
    assert data["limits"]["max_num_seqs"] == 4
    assert data["limits"]["kv_admission_watermark"] == pytest.approx(0.95)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium package is not installed (make test installs it "
                    "where apt-get runs as root)")
def test_chromium_draws_charts_with_data(server: str, tmp_path: Path) -> None:
    loader = threading.Thread(target=load, args=(server, 16))
    loader.start()
    time.sleep(1.0)
    url = f"{server}/dashboard?api_key={KEY}"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    subprocess.run([*browser, "--window-size=1400,1100", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    loader.join()
    charts = dict(re.findall(r'data-chart="(\w+)" data-points="(\d+)"', dom))
    assert set(charts) == {"batch", "tokens", "queue", "kv", "toks", "preempt"}, dom[:2000]
    for name in ("batch", "tokens", "queue", "toks"):
        assert int(charts[name]) > 0, (name, charts)
    assert "TTFT p99 (1 min)" in dom and ">interactive<" in dom
    assert shot.stat().st_size > 10_000
