"""What a person sees on ``rtrace report``'s page, in a real browser (issue #22, items 5, 7, 10).

tests/ui/report_job.py traces a small GRPO job into two workers' JSONL files; ``rtrace
report --html`` (the real command) writes the page; Playwright drives Debian's chromium
through it from ``file://`` (no server, no network). Every value checked comes from the
job's script or from :class:`StepStats`; no test passes with a console error or an
uncaught exception on the page. Screenshots go to ``artifacts/ui/`` (or
``$RTRACE_UI_ARTIFACTS``), never to git.

Run with ``make test-ui`` (installs chromium and playwright when missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")

from rtrace.pipeline.metrics import StepStats  # noqa: E402
from rtrace.report.load import read_records  # noqa: E402
from tests.ui import report_job as job  # noqa: E402

from tests.ui.browser import ARTIFACTS, REPO, watched_page  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The job's files, trace ids and records, and the page ``rtrace report --html`` wrote from them."""
    out = tmp_path_factory.mktemp("report-ui")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "ui" / "report_job.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    page = out / "report.html"
    subprocess.run([sys.executable, "-m", "rtrace", "report", *ran["paths"], "--html", str(page)], env=env,
                   check=True, capture_output=True, timeout=120)
    ran["page"] = page
    ran["records"] = read_records(ran["paths"])[0]
    return ran


@pytest.fixture
def page(browser, report):
    """The page from file://, with every console error, page error, dialog and outside request
    recorded: none may occur."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with watched_page(browser, ("file:", "data:"), width=1500, height=1100, timeout_ms=20_000) as pg:
        pg.goto(report["page"].as_uri())
        pg.wait_for_selector("body[data-ready='1']")
        yield pg


def _go(page, fragment: str) -> None:
    page.evaluate("f => { location.hash = f; }", fragment)


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"report-{name}.png"), full_page=False)


def _tid(report, step, prompt, rollout) -> str:
    return report["trace_ids"][f"{step}-{prompt}-{rollout}"]


def _stats(report, validate, step) -> dict[str, float]:
    st = StepStats()
    for rec in report["records"]:
        if rec.traj.validate == validate and rec.traj.step == step:
            st.add(rec.traj)
    return {k.split("/", 1)[1]: v for k, v in st.values("x").items()}


def test_a_step_shows_the_step_metrics(page, report):
    """A click on step 2 in the run's table shows its metrics (each StepStats' value, exactly), its reward
    histogram, its zero-variance group by name, and its slowest trajectory as a link."""
    page.click("table.run tr[data-step='t2']")
    page.wait_for_function("document.getElementById('step-title').textContent === 'step 2'")
    shown = {c.get_attribute("data-metric"): (float(c.get_attribute("data-v")), c.text_content())
             for c in page.locator("#overview td[data-metric]").all()}
    expected = _stats(report, False, 2)
    assert {k: v for k, (v, _) in shown.items()} == expected
    assert shown["reward_mean"][1] == "0.6364" and shown["error_rate"][1] == "8.3%"
    assert shown["latency_ms_max"][1].endswith(" ms") and "e+" not in shown["latency_ms_max"][1]
    bars = page.locator("#overview [data-hist='reward'] rect title").all_text_contents()
    assert bars == ["0: 4", "1: 7"]  # 11 rewards: the crashed rollout has none
    assert page.locator("#zero-var a").all_text_contents() == ["s2-q0 · reward 1 × 4"]
    assert page.locator("#overview h3", has_text="zero-variance groups").text_content().startswith(
        "zero-variance groups: 1 of 3 ")  # zero_variance_groups_frac = 1/3
    slowest = page.locator("#overview a.tid").text_content()
    assert slowest == max((r.traj for r in report["records"] if r.traj.step == 2 and not r.traj.validate),
                          key=lambda t: t.duration_ms).trace_id
    _shot(page, "01-step-overview")
    # the run's plots: one y axis from zero, steps 1 2 3 only
    reward_plot = page.locator("#run svg[aria-label='reward mean']").first
    assert reward_plot.locator("text.a").all_text_contents() == ["0.00", "0.25", "0.50", "0.75", "1.00",
                                                                 "1", "2", "3", "step"]


def test_a_group_side_by_side(page, report):
    """Group s1-q0 shows its 4 rollouts as columns (reward, advantage, latency, finish reason, answer),
    and a word diff of the best and the worst final answers; A and B can be changed."""
    _go(page, "#step=t1&tab=groups")
    page.click("tr[data-group='s1-q0']")
    cols = page.locator("#group .col")
    assert cols.count() == 4
    assert [c.get_attribute("data-trace") for c in cols.all()] == [_tid(report, 1, 0, r) for r in range(4)]
    assert cols.locator("dd.reward").all_text_contents() == ["1", "1", "0", "1"]
    assert cols.locator("dd.advantage").all_text_contents() == [
        "0.5773", "0.5773", "-1.732", "0.5773"]  # job.advantages(1, 0), 4 significant digits
    assert cols.locator("pre.answer").all_text_contents() == [job.answer_text(1, 0, r) for r in range(4)]
    assert cols.locator("dd.finish").all_text_contents() == ["stop"] * 4
    slow = float(cols.nth(2).locator("dd.latency").text_content().replace(",", "").removesuffix(" ms"))
    assert slow >= 400  # the slow calculator call
    assert page.locator("#diff del").all_text_contents() == ["51."]  # A: rollout 0 (reward 1), B: rollout 2 (0)
    assert page.locator("#diff ins").all_text_contents() == ["54."]
    _shot(page, "02-group-side-by-side")
    cols.nth(1).locator("a[title='diff: B']").click()  # B: rollout 1, right as well: nothing differs
    page.wait_for_selector("#group .col.b[data-trace='%s']" % _tid(report, 1, 0, 1))
    assert page.locator("#group h3", has_text="word diff").count() == 1
    assert page.locator("#diff del, #diff ins").count() == 0


def test_the_failures_of_a_step(page, report):
    """Step 2's failures are its crashed and wrong rollouts, each with why; a click opens its conversation."""
    _go(page, "#step=t2&tab=failures")
    page.wait_for_selector("#failures")
    rows = page.locator("#failures tbody tr")
    expected = {(2, 1, 1), (2, 1, 3), (2, 2, 0), (2, 2, 2), (2, 2, 3)}  # job.PASS at step 2, and job.ERROR
    assert {r.get_attribute("data-trace") for r in rows.all()} == {_tid(report, *k) for k in expected}
    assert page.locator("#failures .chips .chip").all_text_contents() == [
        "all 5", "error 1", "incorrect 4", "reward ≤ 0 4", "no reward 1"]
    page.click("#failures .chip:text('error 1')")
    assert rows.count() == 1
    crashed = page.locator(f"#failures tr[data-trace='{_tid(report, *job.ERROR)}']")
    assert crashed.locator("td").last.text_content() == "TimeoutError: calculator did not answer within 30 s"
    crashed.click()
    drawer = page.locator("#drawer")
    drawer.wait_for(state="visible")
    assert drawer.locator("#trace-id").text_content() == _tid(report, *job.ERROR)
    roles = drawer.locator(".msg .role").all_text_contents()
    texts = drawer.locator(".msg pre").all_text_contents()
    assert roles[:2] == ["system", "user"] and texts[:2] == [job.SYSTEM, "What is 23 * 4?"]
    _shot(page, "03-failures-conversation")
    page.keyboard.press("Escape")
    drawer.wait_for(state="hidden")


def test_a_prompt_across_steps(page, report):
    """Searching a prompt id shows that prompt at every step: its pass rate and its answers."""
    page.fill("#q", "arith-1")
    page.press("#q", "Enter")
    page.wait_for_selector("#prompt[data-prompt='arith-1']")
    rows = page.locator("#prompt tbody tr")
    assert [r.get_attribute("data-step") for r in rows.all()] == ["t1", "t2", "t3"]
    # job.PASS[(s, 1)]; at step 2 the crashed rollout has no result: 2 of 3
    assert rows.locator("td.rate").all_text_contents() == ["25% (1/4)", "66.7% (2/3)", "100% (4/4)"]
    answers = [a.text_content() for a in rows.nth(0).locator(".ans span").all()]
    assert answers == [job.answer_text(1, 1, r) for r in range(4)]
    assert page.locator("#prompt pre.task").text_content() == "What is 23 * 4?"
    _shot(page, "04-prompt-across-steps")
    rows.nth(2).locator(".ans a").first.click()  # an answer opens its trajectory
    page.locator("#drawer").wait_for(state="visible")
    assert page.locator("#trace-id").text_content() == _tid(report, 3, 1, 0)


def test_the_slowest_trajectory_is_a_click_and_a_search_away(page, report):
    """Step 1's latency ranking starts with the slow rollout, time split shown; its id, linked from the run's table,
    opens it, and so does the search box."""
    slow = _tid(report, *job.SLOW)
    assert page.locator("table.run tr[data-step='t1'] a.tid").text_content() == slow
    _go(page, "#step=t1&tab=latency")
    first = page.locator("#latency tbody tr").first
    assert first.get_attribute("data-trace") == slow
    assert "tool 4" in first.locator("td").nth(6).text_content()  # gen … · tool 4xx ms · other …
    _shot(page, "05-latency")
    page.click("table.run tr[data-step='t1'] a.tid")
    page.locator("#drawer").wait_for(state="visible")
    assert page.locator("#trace-id").text_content() == slow
    page.keyboard.press("Escape")
    page.fill("#q", slow[:10])  # a prefix is enough
    page.press("#q", "Enter")
    page.locator("#drawer").wait_for(state="visible")
    assert page.locator("#trace-id").text_content() == slow
    _shot(page, "06-trajectory")


def test_health_per_step(page, report):
    """Step 2's health: the token_continuity rate (1 of 12) and its finding linked to the trajectory;
    the validation step was written without health: unknown, not healthy."""
    _go(page, "#step=t2&tab=health")
    page.wait_for_selector("#health")
    cell = page.locator("#health tr[data-check='token_continuity'] td[data-metric]")
    assert float(cell.get_attribute("data-v")) == 1 / 12 and cell.text_content() == "8.3%"
    finding = page.locator("#health tbody tr.click")
    assert finding.count() == 1
    assert finding.get_attribute("data-trace") == _tid(report, 2, 1, 0)
    assert finding.locator("td").nth(1).text_content() == job.HEALTH[(2, 1, 0)][0]["detail"]
    _shot(page, "07-health")
    _go(page, "#step=v3&tab=health")
    page.wait_for_selector("#health p.unknown")
    assert "Unknown, not healthy." in page.locator("#health p.unknown").text_content()
