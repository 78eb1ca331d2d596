"""``rtrace serve`` as real servers: the command in a process of its own, and the viewer a
collector serves (``serve_port``) over what it writes, reached over the network with httpx."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import rtrace  # noqa: E402
from rtrace.config import ConfigError  # noqa: E402
from tests import serve_job as job  # noqa: E402
from tests.servers import free_port  # noqa: E402

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _until(fn, timeout_s=60.0):
    """fn()'s first truthy value, polled (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = fn()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.2)


def test_the_command_serves_until_sigterm(tmp_path):
    """rtrace serve PATH: prints its address, answers over the network (the runs, a page's JSON,
    a foreign Host refused), and stops on SIGTERM with exit code 0."""
    out = job.run(str(tmp_path), steps=1, jsonl=False)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    env.pop("RTRACE_COLLECTOR_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "rtrace", "serve", out["dataset"], "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    try:
        base = f"http://127.0.0.1:{port}"
        runs = _until(lambda: httpx.get(f"{base}/index.json", timeout=5).json()["runs"])
        assert [(r["name"], r["trajectories"]) for r in runs] == [("job", 12)]
        assert httpx.get(f"{base}/run/job/rollouts.json", timeout=10).json()["total"] == 12
        assert httpx.get(f"{base}/run/job/overview", headers={"Host": "evil.example"}, timeout=10).status_code == 403
        assert any(line.startswith(f"rtrace serve: http://127.0.0.1:{port}/") for line in lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def worker(tmp_path):
    """This process as a rollout worker of the collector given (configured from collector.env)."""
    def configure(collector):
        rtrace.configure(exporter="collector", collector_endpoint=collector.endpoint,
                         collector_token=collector.env.get("RTRACE_COLLECTOR_TOKEN"), export_interval_s=0.05)
    yield configure
    rtrace.shutdown()


def _trace(step, n=4):
    for i in range(n):
        with rtrace.rollout_context(step=step, sample_index=i, rollout_n=0):
            rtrace.record_reward(float(i % 2), correct=bool(i % 2))
    assert rtrace.flush(30)


def test_a_collector_serves_what_it_writes_and_stops_it(tmp_path, worker):
    """start_collector(serve_port=0) with the parquet sink: the viewer shows each step the
    collector writes (without a reload of the server), and stops with the collector."""
    c = rtrace.start_collector(exporter="parquet", parquet_path=str(tmp_path / "ds"), experiment="live",
                               settle_s=0.1, serve_port=0)
    try:
        url = c.viewer.url
        assert url.startswith("http://127.0.0.1:")
        worker(c)
        _trace(1)
        assert c.flush(30)
        total = _until(lambda: httpx.get(f"{url}run/live/rollouts.json", timeout=5).json().get("total") == 4)
        assert total
        _trace(2)
        assert c.flush(30)
        steps = _until(lambda: [s["step"] for s in httpx.get(f"{url}run/live/overview.json", timeout=5).json()
                                .get("steps", [])] == [1, 2])
        assert steps
    finally:
        c.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}index.json", timeout=2)


def test_beyond_loopback_the_viewer_wants_the_collectors_token(tmp_path, worker):
    """Bound to 0.0.0.0, the collector makes a token; its viewer refuses requests without it."""
    c = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), host="0.0.0.0",
                               settle_s=0.1, serve_port=0)
    try:
        url = f"http://127.0.0.1:{c.viewer.port}"
        assert httpx.get(f"{url}/index.json", timeout=5).status_code == 401
        auth = {"Authorization": f"Bearer {c.token}"}
        assert httpx.get(f"{url}/index.json", headers=auth, timeout=5).status_code == 200
        worker(c)
        _trace(1, 3)
        assert c.flush(30)
        name = httpx.get(f"{url}/index.json", headers=auth, timeout=5).json()["runs"][0]["name"]
        assert _until(lambda: httpx.get(f"{url}/run/{name}/rollouts.json", headers=auth, timeout=5).json()
                      .get("total") == 3)
    finally:
        c.stop()


def test_serve_port_without_a_sink_it_can_read_is_refused(tmp_path):
    port = free_port()
    with pytest.raises(ConfigError, match="add the parquet"):
        rtrace.start_collector(exporter="console", port=port, serve_port=0)
    c = rtrace.start_collector(exporter="console", port=port)  # the first one released its port
    c.stop()
