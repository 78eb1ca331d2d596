"""What a person sees on trackio's traces page, in a real browser (issue #14).

A small traced job (tests/ui/traced_job.py) writes two training trajectories and one
validation trajectory to trackio in a temporary ``TRACKIO_DIR``; ``trackio show`` serves
them on 127.0.0.1 and a free port; Playwright drives Debian's chromium through the
page. Screenshots go to ``artifacts/ui/`` (or ``$RTRACE_UI_ARTIFACTS``), never to git.

Run with ``make test-ui`` (installs chromium and playwright when missing); the default
``pytest`` run does not collect tests/ui (``norecursedirs`` in pyproject.toml).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")

from tests.ui.traced_job import MODEL, SYSTEM, answer_text, tool_call_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROJECT = "rtrace-ui"
CHROMIUM = os.environ.get("RTRACE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("RTRACE_UI_ARTIFACTS") or REPO / "artifacts" / "ui")
READY_TIMEOUT_S = 60

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"trackio show exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"trackio show did not answer {url} within {READY_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """The traced job's trajectories served by ``trackio show``; yields (base url, trace ids)."""
    root = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "TRACKIO_DIR": str(root / "trackio"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    job = subprocess.run([sys.executable, str(REPO / "tests" / "ui" / "traced_job.py"), PROJECT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    trace_ids = json.loads(job.stdout.strip().splitlines()[-1])

    port = _free_port()
    # trackio 0.43's `show` has no flag against opening a browser: BROWSER=true makes Python's
    # webbrowser run `true URL` instead; GRADIO_SERVER_PORT is where it starts looking for a port.
    env.update(BROWSER="true", GRADIO_SERVER_PORT=str(port))
    trackio_cli = Path(sys.executable).with_name("trackio")
    log = root / "trackio-show.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(trackio_cli), "show", "--project", PROJECT, "--host", "127.0.0.1"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url + "/", proc, log)
        yield url, trace_ids
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (make test-ui installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, dashboard):
    url, _ = dashboard
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(f"{url}/traces?project={PROJECT}")
    page.wait_for_selector("tr.trace-row")
    yield page
    context.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _row(page, text: str):
    return page.locator("tr.trace-row", has_text=text)


def _open(page, question: str):
    _row(page, question).click()
    page.wait_for_selector(".trace-detail")
    return page.locator(".trace-detail")


def _panes(detail) -> tuple[str, str]:
    """The text of the INPUT and OUTPUT panes of the selected span."""
    panes = detail.locator(".operation-panel .io-grid pre")
    return panes.nth(0).text_content(), panes.nth(1).text_content()


def test_list_tells_validation_from_training(page):
    """The trace list's Status column marks the validation trajectory [val]; training ones not."""
    status = {q: _row(page, q).locator(".status-pill").text_content().strip()
              for q in ("What is 17 * 3?", "What is 12 + 30?", "Evaluate 6 * 7.")}
    _shot(page, "01-trace-list")
    assert status == {"What is 17 * 3?": "success", "What is 12 + 30?": "success", "Evaluate 6 * 7.": "[val] success"}
    page.fill(".search-wrap input", "[val]")  # the search box finds validation trajectories
    page.wait_for_function("document.querySelectorAll('tr.trace-row').length === 1")
    _shot(page, "02-search-val")
    assert page.locator("tr.trace-row").text_content().count("Evaluate 6 * 7.") == 1


def test_root_span_shows_task_and_reward(page, dashboard):
    """Opening a trace selects the root: the task in, the answer and the reward out; the header
    starts with the RL coordinates and has rtrace's trace id."""
    _, trace_ids = dashboard
    detail = _open(page, "What is 17 * 3?")
    assert detail.locator(".operation-panel h3").text_content() == "rollout"
    inp, out = _panes(detail)
    _shot(page, "03-root-span")
    assert json.loads(inp) == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 * 3?"}]
    assert json.loads(out) == {"answer": answer_text("51"), "reward": 1, "outcome": {"correct": True}}
    meta = [m.text_content() for m in detail.locator(".detail-meta span").all()][3:]  # after trackio's own three
    assert meta[:7] == ["step: 1", "sample_index: 0", "rollout_n: 0", "validate: false", "reward: 1",
                        "group_id: q0", "policy_version: 1"]
    assert f"trace_id: {trace_ids['What is 17 * 3?']}" in meta
    assert not any(m.startswith(("partial:", "error:", "dropped_spans:")) for m in meta)


def test_generation_span_shows_the_response_text(page):
    """A generation span shows the decoded response: the tool call it asked for, then the answer."""
    detail = _open(page, "What is 12 + 30?")
    spans = detail.locator(".execution-tree .span-row")
    names = [n.strip() for n in detail.locator(".execution-tree .span-name").all_text_contents()]
    assert names == ["rollout", MODEL, "calculator", MODEL]  # the model's and the tool's names
    spans.nth(1).locator(".span-select").click()
    inp, out = _panes(detail)
    _shot(page, "04-generation-tool-call")
    assert json.loads(inp)[-1] == {"role": "user", "content": "What is 12 + 30?"}
    first = json.loads(out)
    assert first["content"] == tool_call_text("12 + 30") and first["tool_calls"][0]["function"]["name"] == "calculator"
    spans.nth(3).locator(".span-select").click()
    inp, out = _panes(detail)
    _shot(page, "05-generation-answer")
    assert out == answer_text("42")
    assert json.loads(inp)[-1] == {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": "42"}
