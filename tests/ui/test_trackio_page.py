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
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")

from tests.ui.traced_job import MODEL, SYSTEM, answer_text, tool_call_text  # noqa: E402

from tests.ui.browser import ARTIFACTS, REPO  # noqa: E402
PROJECT = "rtrace-ui"
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
    """The traced job's trajectories served by ``trackio show``; yields (base url, the job's
    rollouts: trace id, coordinates, question, verdict, advantage)."""
    root = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "TRACKIO_DIR": str(root / "trackio"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    job = subprocess.run([sys.executable, str(REPO / "tests" / "ui" / "traced_job.py"), PROJECT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    rollouts = json.loads(job.stdout.strip().splitlines()[-1])

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
        yield url, rollouts
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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


def _rows(page) -> list[str]:
    return [r.text_content() for r in page.locator("tr.trace-row").all()]


def _search(page, text: str, expected_rows: int) -> None:
    page.fill(".search-wrap input", text)
    page.wait_for_function(f"document.querySelectorAll('tr.trace-row').length === {expected_rows}")


def _one(rollouts, **where) -> dict:
    (found,) = [r for r in rollouts if all(r[k] == v for k, v in where.items())]
    return found


def _open(page, trace_id: str):
    """Find one trajectory by rtrace's trace id (the search box matches it) and open it."""
    _search(page, trace_id, 1)
    page.locator("tr.trace-row").first.click()
    page.wait_for_selector(".trace-detail")
    return page.locator(".trace-detail")


def _panes(detail) -> tuple[str, str]:
    """The text of the INPUT and OUTPUT panes of the selected span."""
    panes = detail.locator(".operation-panel .io-grid pre")
    return panes.nth(0).text_content(), panes.nth(1).text_content()


def _verdict(r: dict) -> str:
    text = f"{'✓ correct' if r['correct'] else '✗ wrong'} reward={1.0 if r['correct'] else 0.0!r}"
    return f"[val] {text}" if r["validate"] else text


def test_list_shows_verdicts_answers_and_validation(page, dashboard):
    """The trace list's Status column gives each rollout's verdict and reward ([val] marks the
    validation one), and each row previews what the model answered: its tool call when it
    called a tool first, its final answer when it answered at once."""
    _, rollouts = dashboard
    assert len(page.locator("tr.trace-row").all()) == len(rollouts)
    _shot(page, "01-trace-list")
    pills = sorted(p.text_content().strip() for p in page.locator("tr.trace-row .status-pill").all())
    assert pills == sorted(_verdict(r) for r in rollouts)
    previews = [p.text_content() for p in page.locator("tr.trace-row .preview").all()]
    assert "(no assistant response)" not in previews
    direct = _one(rollouts, mode="direct")
    assert sum(p == direct["answer"] for p in previews) == 1  # answered at once: the answer
    assert sum(p == 'calculator(expression="17 * 3")' for p in previews) == 2  # a tool-call turn: its call
    _search(page, "[val]", 1)  # the search box finds the validation trajectory
    _shot(page, "02-search-val")
    assert "Evaluate 6 * 7." in _rows(page)[0]


def test_search_finds_the_wrong_rollouts_of_a_step(page, dashboard):
    """With step 1 picked in the step filter, searching "wrong" lists that step's wrong rollouts
    only; "reward=0.0" finds every wrong one."""
    _, rollouts = dashboard
    page.locator(".filter-wrap select").nth(0).select_option("1")  # the Step filter
    page.wait_for_function("document.querySelectorAll('tr.trace-row').length === 4")
    _search(page, "wrong", 1)
    _shot(page, "06-step-1-wrong")
    wrong = _one(rollouts, step=1, correct=False)
    assert wrong["question"] in _rows(page)[0] and "wrong reward=0.0" in _rows(page)[0]
    page.locator(".filter-wrap select").nth(0).select_option("all")
    _search(page, "reward=0.0", sum(not r["correct"] for r in rollouts))


def test_root_span_shows_task_reward_and_advantage(page, dashboard):
    """Opening a trace selects the root: the task in, the answer, the reward and the advantage
    out; the header starts with rtrace's trace id and the RL coordinates, and shows the
    advantage the trainer annotated."""
    _, rollouts = dashboard
    r = _one(rollouts, step=1, sample_index=0, rollout_n=0)
    detail = _open(page, r["trace_id"])
    assert detail.locator(".operation-panel h3").text_content() == "rollout"
    inp, out = _panes(detail)
    _shot(page, "03-root-span")
    assert json.loads(inp) == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 * 3?"}]
    assert json.loads(out) == {"answer": answer_text("51"), "reward": 1, "outcome": {"correct": True},
                               "annotations": {"advantage": 1}}
    meta = [m.text_content() for m in detail.locator(".detail-meta span").all()][3:]  # after trackio's own three
    assert meta[:7] == [f"trace_id: {r['trace_id']}", "step: 1", "sample_index: 0", "rollout_n: 0", "reward: 1",
                        "group_id: q0", "policy_version: 1"]
    assert "advantage: 1" in meta and "outcome.correct: true" in meta
    assert not any(m.startswith(("validate:", "partial:", "error:", "dropped_spans:")) for m in meta)


def test_generation_span_shows_the_response_text(page, dashboard):
    """A generation span shows the decoded response: the tool call it asked for, then the answer."""
    _, rollouts = dashboard
    detail = _open(page, _one(rollouts, step=1, sample_index=1, rollout_n=0)["trace_id"])
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


def test_step_rollouts_table_on_the_media_page(page, dashboard):
    """The Media & Tables page holds each step's rollouts table: one row per kept trajectory of
    the step, a GRPO group's rollouts side by side, with reward, advantage, verdict and trace id."""
    url, rollouts = dashboard
    page.goto(f"{url}/media?project={PROJECT}")
    page.wait_for_selector(".table-section")
    _shot(page, "07-step-tables")
    tables = {}
    for section in page.locator(".table-section").all():
        key = section.locator(".media-label").text_content().strip()
        headers = [h.text_content().strip() for h in section.locator("thead th").all()]
        rows = [[c.text_content().strip() for c in row.locator("td").all()] for row in section.locator("tbody tr").all()]
        rows = [dict(zip(headers, cells)) for cells in rows]
        tables.setdefault(key, []).append(rows)
    assert sorted(tables) == ["eval/rollouts", "rollout/rollouts"]
    train = sorted(tables["rollout/rollouts"], key=lambda rows: rows[0]["step"])
    for step, rows in zip((1, 2), train):
        expected = sorted((r for r in rollouts if r["step"] == step and not r["validate"]),
                          key=lambda r: (r["sample_index"], r["rollout_n"]))
        assert [row["trace_id"] for row in rows] == [r["trace_id"] for r in expected]  # by group, then rollout
        assert [row["outcome"] for row in rows] == ["correct" if r["correct"] else "wrong" for r in expected]
        assert [float(row["advantage"]) for row in rows] == [r["advantage"] for r in expected]
        assert [float(row["reward"]) for row in rows] == [float(r["correct"]) for r in expected]
