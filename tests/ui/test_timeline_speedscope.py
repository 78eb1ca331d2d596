"""A real consumer opens `rtrace timeline`'s file (docs/timeline.md): speedscope, the npm package's
own web app (``make test-ui`` installs it under ``$RTRACE_UI_CACHE/speedscope``; it imports Chrome
trace-event JSON offline), in Chromium driven by Playwright. The file imports without an error or
a warning of speedscope's importer (a slice ended out of order, one left open), every lane of every
worker and server is a thread to pick, and a worker's lane shows a rollout with its calls nested.
Screenshots go to ``artifacts/ui`` (``$RTRACE_UI_ARTIFACTS``)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.ui.browser import ARTIFACTS, REPO


def _speedscope() -> Path:
    root = Path(os.environ.get("RTRACE_UI_CACHE") or Path.home() / ".cache" / "rtrace")
    app = root / "speedscope" / "node_modules" / "speedscope" / "dist" / "release"
    if not (app / "index.html").exists():
        pytest.skip(f"no speedscope app at {app} (make test-ui installs it)")
    return app


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """speedscope's app and a step's timeline (two workers, two servers, a weight update) on one
    local HTTP server: ``(base URL, the file's name, the parsed file)``."""
    app = _speedscope()
    folder = tmp_path_factory.mktemp("speedscope")
    shutil.copytree(app, folder / "app")
    jsonl = folder / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RTRACE_EXPORTER": "jsonl"}
    for worker in ("rollout-worker-a", "rollout-worker-b"):
        subprocess.run([sys.executable, "-m", "tests.ui.timeline_job", str(jsonl), worker], env=env, cwd=REPO,
                       check=True, timeout=120)
    from rtrace.cli import main

    assert main(["timeline", str(jsonl), "--step", "1", "-o", str(folder / "step1.json")]) == 0

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", "step1.json", json.loads((folder / "step1.json").read_text())
    server.shutdown()


def test_speedscope_imports_the_file_and_shows_the_lanes(browser, served):
    base, name, doc = served
    info = doc["otherData"]["rtrace"]
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert set(info["workers"]) == {"rollout-worker-a", "rollout-worker-b"}
    assert set(info["servers"]) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert max(w["lanes"] for w in info["workers"].values()) >= 2  # parallel rollouts, parallel tools
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    logs: list[tuple[str, str]] = []
    page.on("console", lambda m: logs.append((m.type, m.text)))
    page.on("pageerror", lambda e: logs.append(("pageerror", str(e))))
    try:
        page.goto(f"{base}/app/index.html#profileURL={base}/{name}")
        page.wait_for_selector(f"text=(1/{len(threads)})", timeout=30_000)
        # every thread with a slice is a profile to pick, named by its process and lane
        profiles = {t for t in page.locator("span").all_text_contents() if "(pid " in t and "/" not in t}
        for worker in info["workers"]:
            assert any(p.startswith(f"worker {worker} (pid ") and ", lane 1 (tid 1)" in p for p in profiles)
        for server in info["servers"]:
            assert any(p.startswith(f"server {server} (pid ") for p in profiles)
        assert len(profiles) == len(threads)
        for _ in range(len(threads)):  # to the first worker's first lane
            if "worker rollout-worker-a" in page.inner_text("body") and "lane 1 (tid 1)" in page.inner_text("body"):
                break
            page.keyboard.press("n")
        title = page.inner_text("body")
        assert "worker rollout-worker-a" in title and "lane 1 (tid 1)" in title
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "timeline-speedscope.png"))
    finally:
        page.close()
    assert [m for m in logs if m[0] in ("error", "pageerror")] == []
    assert "Importing as Trace Event Format profile" in [m[1] for m in logs]
    bad = [m for m in logs if "Tried to end" in m[1] or "still open" in m[1] or "stack was empty" in m[1]]
    assert bad == []
