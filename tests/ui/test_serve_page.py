"""``rtrace serve`` in a real browser (issue #35): every view on the demo's run, on a job with
hostile text and per-token values, on a generated run of 1,000,000 trajectories, and a run
that appears and grows while the page is open.

The server is the real command (``python -m rtrace serve ...`` in a process of its own,
stopped by pid); the runs are real: ``rtrace demo --exporter parquet,jsonl`` (the tiny
policy on CPU), tests/serve_job.py (traced with rtrace's decorators), and
tests/ui/big_run.py (written in the dataset's schema with pyarrow, cached under
``$RTRACE_UI_CACHE`` or ``~/.cache/rtrace``: built once, about a minute). Playwright drives
Debian's chromium; no test passes with a console error, an uncaught exception, a dialog
(an injected ``alert``) or a request to anything but the server. Timings are measured and
written to ``artifacts/ui/serve-timings.json`` (docs/serve.md quotes them), never asserted;
what is asserted is behaviour: rows, orders, filters, counts, bounded page weight.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")
pytest.importorskip("starlette")
pytest.importorskip("duckdb")

from tests import serve_edges as edges  # noqa: E402
from tests import serve_job as job  # noqa: E402
from tests.servers import rtrace_serve  # noqa: E402
from tests.ui import big_run  # noqa: E402

from tests.ui.browser import ARTIFACTS, REPO, watched_page  # noqa: E402
ENV = {**os.environ, "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
TIMINGS: dict[str, object] = {}
#: a normal screen's width (issue #42: what a person sees at 1,400 px)
WIDTH = 1400


def _record(name: str, value: object) -> None:
    TIMINGS[name] = value
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "serve-timings.json").write_text(json.dumps(TIMINGS, indent=1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The demo's run, the job's run (and its JSONL), the 1,000,000-trajectory run, and the
    folder a run will be written to later (nothing there yet)."""
    out = tmp_path_factory.mktemp("serve-ui")
    demo = subprocess.run([sys.executable, "-m", "rtrace", "demo", "--exporter", "parquet,jsonl", "--out-dir",
                           str(out / "demo")], env=ENV, capture_output=True, text=True, timeout=900)
    assert demo.returncode == 0, demo.stderr[-3000:]
    (demo_ds,) = glob.glob(str(out / "demo" / "dataset" / "*"))
    ran = job.run(str(out / "job"))
    t0 = time.perf_counter()
    big = big_run.ensure()
    _record("big_run_ready_s", round(time.perf_counter() - t0, 1))
    return {"demo": demo_ds, "demo_jsonl": str(out / "demo" / "traces.jsonl"), "job": ran, "big": str(big),
            "live": str(out / "live"), "out": out, "edges": edges.write(str(out / "edges"))}


@pytest.fixture(scope="module")
def server(runs):
    """``rtrace serve`` over the six runs, on a free port; stopped (SIGTERM, then SIGKILL) at the end."""
    t0 = time.perf_counter()
    sources = [f"demo={runs['demo']}", f"job={runs['job']['dataset']}", f"jobcopy={runs['job']['jsonl']}",
               f"big={runs['big']}", f"live={runs['live']}/ds/job", f"edges={runs['edges']['jsonl']}"]
    with rtrace_serve(sources, ENV, 600) as served:
        _record("serve_start_s_with_1M_index", round(time.perf_counter() - t0, 1))
        yield served


@pytest.fixture
def page(browser, server):
    """A page of the server, with every console error, page error, dialog and outside request
    recorded: none may occur."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with watched_page(browser, (server["url"], "data:"), width=WIDTH) as pg:
        pg.base = server["url"]  # type: ignore[attr-defined]
        yield pg


def _go(page, path: str) -> float:
    """Open ``path``; returns the first render's time (navigation start to the load event), in ms."""
    page.goto(page.base + path)
    return page.evaluate("() => { const n = performance.getEntriesByType('navigation')[0]; "
                         "return n.loadEventEnd - n.startTime; }")


def _shot(page, name: str, full: bool = False) -> None:
    page.screenshot(path=str(ARTIFACTS / f"serve-{name}.png"), full_page=full)


def _sql_ms(page) -> float:
    text = page.locator("#timing").text_content()  # "2 queries, 15 ms in SQL"
    return float(text.split(",")[1].split("ms")[0].replace(",", "").strip())


def _total(page) -> int:
    text = page.locator("p.pager .count").first.text_content()  # "rollouts 1–50 of 1,001,250"
    return int(text.rsplit("of", 1)[1].replace(",", "").strip())


def _column(page, name: str) -> list[str]:
    return page.locator(f"table.rollouts tbody td[data-col='{name}']").all_text_contents()


#: what a person sees of an element: its box inside the window, and the element at its centre
#: point itself (or inside it): not covered, not clipped by a scrolling box, not off screen
SEEN = """e => {
    const r = e.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) return "no size";
    const x = r.left + r.width / 2, y = r.top + r.height / 2;
    if (r.left < 0 || r.top < 0 || r.right > window.innerWidth + 0.5 || r.bottom > window.innerHeight + 0.5)
        return `outside the window: ${Math.round(r.left)},${Math.round(r.top)} - ${Math.round(r.right)},${Math.round(r.bottom)}`;
    const at = document.elementFromPoint(x, y);
    return at && (at === e || e.contains(at)) ? "" : `covered by ${at ? at.tagName + "." + at.className : "nothing"}`;
}"""


#: an element's box inside the window (a tooltip: it lets the pointer through, so nothing is "at" it)
INSIDE = ("e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.left >= 0 && r.top >= 0 && "
          "r.right <= window.innerWidth && r.bottom <= window.innerHeight; }")


def _unseen(locator) -> list[str]:
    """The elements of ``locator`` a person cannot see where the page is now (nothing is
    scrolled for them), with why."""
    out = []
    for i, el in enumerate(locator.all()):
        why = el.evaluate(SEEN)
        if why:
            out.append(f"{i} {el.text_content()!r}: {why}")
    return out


def _overlaps(svg, selector: str) -> list[str]:
    """Texts of ``selector`` in one plot whose boxes overlap another's, or leave the plot."""
    return svg.evaluate("""(s, sel) => {
        const box = s.getBoundingClientRect(), out = [];
        const rs = [...s.querySelectorAll(sel)].map(t => [t.textContent, t.getBoundingClientRect()]);
        rs.forEach(([t, r], i) => {
            if (r.left < box.left - 0.5 || r.right > box.right + 0.5) out.push(t + " leaves the plot");
            rs.slice(i + 1).forEach(([u, q]) => {
                if (r.left < q.right && q.left < r.right && r.top < q.bottom && q.top < r.bottom) out.push(t + " / " + u);
            });
        });
        return out; }""", selector)


# ----------------------------------------------------------------------------- the demo's run
def test_demo_overview_curves_fit(page, runs):
    """The demo's run: its step table (3 training steps), curves whose y axes start at 0 and whose
    legends stay inside the plot and off the title; one curve per reward component."""
    _go(page, "/run/demo/overview")
    assert page.locator("section.split-training table.run tbody tr").count() == 3
    reward = page.locator("svg[aria-label='reward mean']").first
    ticks = reward.locator("text.a").all_text_contents()
    assert ticks[0] in ("0.0", "0.00", "0")
    for svg in page.locator("svg.plot").all():
        boxes = svg.evaluate("""s => {
            const r = s.getBoundingClientRect(), title = s.querySelector('text.t').getBoundingClientRect();
            return [...s.querySelectorAll('text.l, text.v')].map(t => { const b = t.getBoundingClientRect();
              return {right: b.right - r.right, overTitle: b.top < title.bottom - 1 && b.bottom > title.top + 1 &&
                      b.left < title.right && b.right > title.left}; }); }""")
        assert all(b["right"] <= 1 and not b["overTitle"] for b in boxes), svg.get_attribute("aria-label")
    _shot(page, "01-demo-overview", full=True)


def test_demo_rollouts_sort_filter_search_columns(page, runs):
    """The demo's rollouts in one table: sorted by a click on a header, filtered by a click on a
    value, narrowed by a histogram bar, searched, and a column hidden with the chooser."""
    _go(page, "/run/demo/rollouts")
    total = _total(page)  # the training rollouts (the switch's default)
    assert total == sum(not json.loads(line).get("validate") for line in open(runs["demo_jsonl"]))
    _shot(page, "02-demo-rollouts")
    with page.expect_navigation():
        page.click("table.rollouts th[data-col='reward'] a")
    rewards = [float(x) for x in _column(page, "reward") if x != "–"]
    assert rewards == sorted(rewards, reverse=True)
    with page.expect_navigation():
        page.locator("table.rollouts td[data-col='verdict'] a", has_text="wrong").first.click()
    assert set(_column(page, "verdict")) == {"wrong"} and _total(page) < total
    wrong = _total(page)
    with page.expect_navigation():
        page.locator("#filters .chip[data-filter='verdict'] a.x").click()  # remove the filter
    assert _total(page) == total
    bar = page.locator("[data-hist='reward'] a.bar").first
    count = int(bar.locator("rect.b title").text_content().rsplit(":", 1)[1].replace(",", ""))
    with page.expect_navigation():
        bar.click()
    assert _total(page) == count
    page.goto(page.base + "/run/demo/rollouts")
    page.fill("form.search input[name=q]", "answer")
    with page.expect_navigation():
        page.press("form.search input[name=q]", "Enter")
    assert 0 < _total(page) <= total and "answer" in page.locator("#filters").text_content()
    page.goto(page.base + "/run/demo/rollouts")
    page.click("details.cols summary")
    _shot(page, "02b-demo-columns")
    assert _unseen(page.locator("details.cols label")) == []  # every choice is there to click
    with page.expect_navigation():
        page.uncheck("details.cols input[value='answer']")
    assert page.locator("table.rollouts th[data-col='answer']").count() == 0
    assert page.locator("table.rollouts th[data-col='reward']").count() == 1
    assert wrong < total


def test_demo_step_group_conversation_and_tokens(page, runs):
    """Step 2 of the demo: its groups side by side (today's report view), a rollout's conversation,
    and from there its full view: the tokens coloured by the sampler's log-probability, values on hover."""
    _go(page, "/run/demo/step/t2#tab=groups")
    page.wait_for_selector("body[data-ready='1']")
    page.locator("#groups tr[data-group]").first.click()
    cols = page.locator("#group .col")
    assert cols.count() == 4
    _shot(page, "03-demo-group")
    cols.first.locator("a.tid").last.click()
    page.locator("#drawer").wait_for(state="visible")
    assert page.locator("#drawer .msg .role").first.text_content() == "system"
    with page.expect_navigation():
        page.click("#full-view")
    page.wait_for_selector("section#rollout")
    assert page.locator("#colors a.chip.on").text_content() == "logprob"
    token = page.locator(".tokens .tk").first
    assert page.locator(".tlegend[data-color='logprob']").count() == 1
    token.hover()
    tip = page.locator("#tktip")  # a native title would make no element at all
    assert tip.is_visible() and tip.evaluate(INSIDE)
    lines = tip.text_content().split("\n")
    assert lines[0] == "token 0" and lines[1].startswith('"') and any(x.startswith("logprob ") for x in lines)
    _shot(page, "04-demo-tokens")


def test_demo_prompts_failures_and_health(page, runs):
    """A prompt across steps from the run-wide prompt list; the failures with why in words."""
    _go(page, "/run/demo/prompts")
    rows = page.locator("table.prompts tbody tr")
    assert rows.count() > 0
    recurring = [r for r in rows.all() if int(r.locator("td").nth(2).text_content()) > 1]
    assert recurring, "the demo draws prompts from a small pool: some recur"
    with page.expect_navigation():
        recurring[0].locator("td a").first.click()
    page.wait_for_selector("section#prompt")
    assert page.locator("table.prompt tbody tr").count() > 1
    _shot(page, "05-demo-prompt")
    _go(page, "/run/demo/failures")
    reasons = page.locator("table.failures td.why .reason").all_text_contents()
    assert reasons and all(r.strip() for r in reasons)
    assert any(r.startswith(("wrong answer", "truncated:", "error:", "reward")) for r in reasons)
    _shot(page, "06-demo-failures")


# ----------------------------------------------------------------------------- untrusted text, tokens, compare
def test_hostile_text_is_text(page, runs):
    """An answer holding <script> and an onerror= attribute, a prompt with <b> and <script>, an error with
    <svg onload=>: shown as characters in the table, the rollout page and the step viewer; no element made
    from them, no script run (a dialog would fail the test)."""
    tid = runs["job"]["trace_ids"]["-".join(map(str, job.HOSTILE))]
    _go(page, "/run/job/rollouts?q=onerror")
    assert _total(page) == 1
    answer = page.locator("table.rollouts td[data-col='answer']").text_content()
    assert answer.endswith('</pre><script>alert("x")</script><img src=x onerror=alert(1)>')
    task = page.locator("table.rollouts td[data-col='task']").text_content()
    assert task == job.HOSTILE_TASK
    assert page.locator("main img, main b, main svg:not(.plot) script").count() == 0
    _shot(page, "07-hostile-table")
    _go(page, f"/run/job/rollout/{tid}")
    assert '<img src=x onerror=alert(1)>' in page.locator(".tokens").text_content()
    assert page.locator("main img").count() == 0
    crash = runs["job"]["trace_ids"]["-".join(map(str, job.CRASH))]
    _go(page, f"/run/job/rollout/{crash}")
    assert job.CRASH_ERROR in page.locator("#why").text_content() and page.locator("main svg").count() == 0
    _go(page, f"/run/job/step/t2#trace={tid}")
    page.locator("#drawer").wait_for(state="visible")
    texts = page.locator("#drawer .msg pre").all_text_contents()
    assert job.HOSTILE_TASK in texts and page.locator("#drawer img, #drawer b").count() == 0
    _shot(page, "08-hostile-drawer")


def test_mismatch_at_a_step_and_its_tokens(page, runs):
    """Step 2's rollouts by train-inference mismatch: the scripted one first; its tokens coloured by
    trainer - sampler logprob, the changed token the darkest, its values on hover; a legend."""
    tid = runs["job"]["trace_ids"]["-".join(map(str, job.MISMATCH))]
    _go(page, "/run/job/step/t2")
    first = page.locator("#mismatch tbody tr").first
    assert first.get_attribute("data-trace") == tid
    with page.expect_navigation():
        first.locator("a.tid").click()
    page.wait_for_selector("section#rollout")
    assert page.locator("#colors a.chip.on").text_content() == "mismatch"
    toks = page.locator(".tokens .tk")
    assert [t.get_attribute("class") for t in toks.all()] == ["tk d5", "tk d5", "tk d5", "tk d0", "tk d5"]
    assert "mismatch -2" in toks.nth(3).get_attribute("data-tip").split("\n")
    toks.nth(3).hover()
    _shot(page, "09-mismatch-tokens")
    with page.expect_navigation():
        page.click("#colors a[data-color='loss_mask']")
    assert page.locator(".tokens .tk").first.get_attribute("class") == "tk m0"


def test_two_runs_compared(page, runs):
    """The job's dataset and its JSONL copy: step metrics overlaid (a legend naming both runs), the
    prompts both have, and one prompt in both runs side by side."""
    _go(page, "/compare?a=job&b=jobcopy")
    legend = page.locator("svg[aria-label='reward mean'] text.l").all_text_contents()
    assert [x.split(" ", 1)[1] for x in legend] == ["job", "jobcopy"]
    rows = page.locator("table.compare tbody tr")
    assert sorted(r.get_attribute("data-prompt") for r in rows.all()) == ["q0", "q1", "q2"]
    _shot(page, "10-compare")
    with page.expect_navigation():
        rows.first.locator("a").click()
    page.wait_for_selector("section#prompt")
    assert page.locator("table.prompt thead th").count() == 7
    _shot(page, "11-compare-prompt")


# ----------------------------------------------------------------------------- 1,000,000 trajectories
def test_a_million_rollouts(page, runs):
    """The generated run: the table's first render, a sort and filters over every step (their time
    in SQL on the server), a histogram bar, and the page's weight, which does not grow with the run."""
    render = _go(page, "/run/big/rollouts")
    assert _total(page) == 1_000_000  # the training rollouts: 1,250 more are validation's
    assert page.locator("table.rollouts tbody tr").count() == 50
    weight = page.evaluate("() => performance.getEntriesByType('resource').concat(performance.getEntriesByType("
                           "'navigation')).reduce((s, e) => s + (e.transferSize || e.encodedBodySize || 0), 0)")
    html_bytes = page.evaluate("() => performance.getEntriesByType('navigation')[0].encodedBodySize")
    assert html_bytes < 300_000  # 50 rows and fixed-size histograms, whatever the run's size
    first_sql = _sql_ms(page)
    _shot(page, "12-big-rollouts")
    with page.expect_navigation():
        page.click("table.rollouts th[data-col='reward'] a")
    rewards = [float(x) for x in _column(page, "reward")]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] == pytest.approx(1.2)
    sort_ms = _sql_ms(page)
    _go(page, "/run/big/rollouts?verdict=wrong")
    assert set(_column(page, "verdict")) == {"wrong"}
    filter_ms = _sql_ms(page)
    _go(page, "/run/big/rollouts?step__ge=900&outcome.reward/format=0.5&_sort=latency&_desc=1")
    steps = [int(x.replace(",", "")) for x in _column(page, "step")]
    assert all(s >= 900 for s in steps)
    combined_ms = _sql_ms(page)
    bar = page.locator("[data-hist='latency'] a.bar").nth(3)
    count = int(bar.locator("rect.b title").text_content().rsplit(":", 1)[1].replace(",", ""))
    with page.expect_navigation():
        bar.click()
    assert _total(page) == count
    _go(page, "/run/big/rollouts?q=Question+1999%3A")
    search_ms = _sql_ms(page)
    assert _total(page) > 0 and all("Question 1999:" in t for t in _column(page, "task"))
    _record("big_rollouts", {"first_render_ms": round(render), "first_page_sql_ms": first_sql, "sort_sql_ms": sort_ms,
                             "filter_sql_ms": filter_ms, "filter_and_sort_sql_ms": combined_ms,
                             "text_search_sql_ms": search_ms, "html_bytes": html_bytes, "page_bytes": weight})


def test_a_million_rollouts_other_views(page, runs):
    """The generated run's overview (1,000 steps: the table a page at a time, curves averaged in
    buckets), a step with its groups and mismatch list, a prompt across steps, the failures, and a
    rollout's tokens."""
    render = _go(page, "/run/big/overview")
    assert page.locator("section.split-training table.run tbody tr").count() == 50
    train = page.locator("section.split-training")
    assert train.locator("svg[aria-label='reward mean'] text", has_text="mean of 5 steps per point").count() == 1
    assert train.locator("svg[aria-label='reward/accuracy (mean)']").count() == 1
    overview_bytes = page.evaluate("() => performance.getEntriesByType('navigation')[0].encodedBodySize")
    assert overview_bytes < 400_000
    _shot(page, "13-big-overview")
    step_render = _go(page, "/run/big/step/t950#tab=groups")
    page.wait_for_selector("body[data-ready='1']")
    assert page.locator("#groups tr[data-group]").count() == 125
    assert page.locator("#mismatch tbody tr").count() == 20
    _shot(page, "14-big-step")
    prompt_render = _go(page, "/run/big/prompt?key=gsm8k-17")
    assert page.locator("table.prompt tbody tr").count() > 10
    failures_render = _go(page, "/run/big/failures?check=retokenization")
    assert page.locator("table.failures tbody tr").count() == 50
    # the newest step has token texts: its findings show the text at the first different token
    assert page.locator("table.failures .retok .tk.at").count() >= 1
    _shot(page, "15-big-failures")
    _go(page, "/run/big/step/t1000")
    tid = page.locator("#mismatch a.tid").first.get_attribute("title")
    rollout_render = _go(page, f"/run/big/rollout/{tid}?color=mismatch")
    assert page.locator(".tokens .tk").count() > 5
    _shot(page, "16-big-tokens")
    _record("big_other_views", {"overview_render_ms": round(render), "overview_bytes": overview_bytes,
                                "step_render_ms": round(step_render), "prompt_render_ms": round(prompt_render),
                                "failures_render_ms": round(failures_render), "rollout_render_ms": round(rollout_render)})


# ----------------------------------------------------------------------------- live
def test_a_run_appears_and_a_new_step_shows_while_it_writes(page, runs):
    """A run that does not exist yet: its page says so; a process then writes it a step at a time
    and the open page (no reload) shows each new step; the time from a step's files in place to
    its row on the page is recorded."""
    _go(page, "/run/live/overview")
    assert "nothing to show yet" in page.locator("main").text_content()
    writer = subprocess.Popen([sys.executable, str(REPO / "tests" / "serve_job.py"), runs["live"], "3", "6"], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, float] = {}
    written: dict[int, float] = {}
    try:
        def follow() -> None:
            for line in writer.stdout:  # type: ignore[union-attr]
                item = json.loads(line)
                written[item["step"]] = item["written"]

        threading.Thread(target=follow, daemon=True).start()
        for step in (1, 2, 3):
            page.wait_for_selector(f"table.run tr[data-step='t{step}']", timeout=120_000)
            seen[step] = time.time()
        _shot(page, "17-live")
        assert writer.wait(120) == 0, writer.stderr.read()
    finally:
        if writer.poll() is None:
            writer.kill()
    assert page.evaluate("document.body.dataset.version") != "0"
    _record("live_new_step_s", {s: round(seen[s] - written[s], 2) for s in (2, 3) if s in written})


# ----------------------------------------------------------------------------- first contact (issue #42)
def test_the_column_chooser_is_usable_at_1400_and_800(page, runs):
    """The chooser's panel opens over the page, inside the window, every choice visible and
    clickable (its label the element at its own centre) at 1,400 and at 797 px."""
    for width in (WIDTH, 797):
        page.set_viewport_size({"width": width, "height": 1000})
        _go(page, "/run/big/rollouts")
        page.click("details.cols summary")
        assert _unseen(page.locator("details.cols label")) == [], width
        assert _unseen(page.locator("details.cols button")) == [], width
        _shot(page, f"18-columns-{width}")
        with page.expect_navigation():
            page.locator("details.cols label", has_text="tool calls").click()
        assert page.locator("table.rollouts th[data-col='tools']").count() == 1


def test_the_key_columns_are_in_view_and_stay_when_the_table_scrolls(page, runs):
    """At 1,400 px the rollout, step, group, n, verdict, reward, tokens out, truncated and
    advantage headers are on screen; scrolled sideways to its last column, the table keeps the
    first six in place; no two headers are named alike."""
    _go(page, "/run/big/rollouts")
    heads = page.locator("table.rollouts thead th")
    names = heads.all_text_contents()
    assert len(names) == len(set(names))
    first = ["rollout", "step", "group", "n", "verdict", "reward", "tokens out", "truncated", "advantage"]
    assert [n.strip(" ▲▼") for n in names[:9]] == first
    assert [f"{names[i]}: {why}" for i in range(9) if (why := heads.nth(i).evaluate(SEEN))] == []
    _shot(page, "19-big-table-1400")
    box = page.locator("#table-scroll")
    assert box.evaluate("b => b.scrollWidth > b.clientWidth")  # the rest scrolls, inside its box
    box.evaluate("b => { b.scrollLeft = b.scrollWidth; }")
    page.wait_for_timeout(100)
    row = page.locator("table.rollouts tbody tr").first
    pinned = row.locator("td.pin")
    assert pinned.count() == 6
    assert [why for why in (c.evaluate(SEEN) for c in pinned.all()) if why] == []
    assert heads.last.evaluate(SEEN) == ""  # the last column is reachable
    _shot(page, "20-big-table-scrolled")


def test_training_by_default_with_a_switch_to_validation(page, runs):
    """The table opens on the training rollouts; the switch shows the validation ones, each
    marked; the histograms follow."""
    _go(page, "/run/edges/rollouts")
    n_train = len([t for t in runs["edges"]["trajectories"].values() if not t.validate])
    assert _total(page) == n_train and page.locator("tr.row-val").count() == 0
    switch = page.locator("#split")
    assert _unseen(switch.locator("a.chip")) == []
    assert switch.locator("a.chip.on").get_attribute("data-split") == "train"
    with page.expect_navigation():
        switch.locator("a[data-split='val']").click()
    assert _total(page) == edges.VALIDATION
    rows = page.locator("table.rollouts tbody tr")
    assert rows.count() == edges.VALIDATION == page.locator("tr.row-val").count()
    assert _unseen(rows.locator("td[data-col='step'] .vbadge")) == []
    reward = page.locator("[data-hist='reward'] rect.b title").all_text_contents()
    assert sum(int(t.rsplit(":", 1)[1].replace(",", "")) for t in reward) == edges.VALIDATION
    _shot(page, "21-edges-validation")


def test_histograms_keep_their_shape_and_their_labels_apart(page, runs):
    """One 185,200-token answer and one 10-minute rollout are each an overflow bar, not the
    scale; on every histogram (the edges run, the 1,000,000 run) the counts over the bars and
    the axis labels never overlap or leave the plot, and the axis reads round numbers."""
    for run in ("edges", "big", "demo"):
        _go(page, f"/run/{run}/rollouts")
        for svg in page.locator(".hists svg.plot").all():
            name = svg.get_attribute("aria-label")
            assert _overlaps(svg, "text.v") == [], (run, name)
            assert _overlaps(svg, "text.a[y='158']") == [], (run, name)
            axis = svg.locator("text.a[y='158']").all_text_contents()
            if (svg.locator("rect.b title").first.text_content() or "").startswith("["):  # bins: round edges
                assert all(re.fullmatch(r"[<>] ?-?[\d,.]+|-?[\d,]+(\.\d{1,3})?", t) for t in axis), (run, name, axis)
        _shot(page, f"22-{run}-histograms")
    _go(page, "/run/edges/rollouts")
    length = page.locator("[data-hist='length']")
    titles = length.locator("rect.b title").all_text_contents()
    assert titles[-1] == "> 80 (up to 185,200): 1"
    assert max(int(t.rsplit(":", 1)[1]) for t in titles[:-1]) < 20  # 47 answers spread over the bins
    with page.expect_navigation():
        length.locator("a.bar").last.click()
    assert _total(page) == 1 and page.locator("#filters .chip").first.text_content().startswith("tokens out > 80")


def test_the_newest_step_is_on_top_of_the_overview(page, runs):
    _go(page, "/run/big/overview")
    first = page.locator("section.split-training table.run tbody tr").first
    assert first.get_attribute("data-step") == "t1000"
    assert first.locator("td").first.evaluate(SEEN) == ""


def test_a_token_tooltip_shows_at_once_with_its_text_and_id(page, runs):
    """On the 1,000,000 run (ids kept): hovering a token shows its position, id, text and
    every array's value at once, inside the window; the next token's replaces it."""
    _go(page, "/run/big/step/t1000")
    tid = page.locator("#mismatch a.tid").first.get_attribute("title")
    _go(page, f"/run/big/rollout/{tid}?color=mismatch")
    tokens = page.locator(".tokens .tk")
    for i in (1, tokens.count() - 1):  # one at the start of a line, one at its end
        tokens.nth(i).hover()
        tip = page.locator("#tktip")
        assert tip.is_visible() and tip.evaluate(INSIDE)
        lines = tip.text_content().split("\n")
        assert re.fullmatch(rf"token {i} · id \d+", lines[0]) and lines[1].startswith('"')
        assert {x.split(" ")[0] for x in lines[2:]} >= {"logprob", "old_logprob", "mismatch"}
    _shot(page, "23-big-token-tooltip")


def test_a_right_to_left_override_is_shown_not_obeyed(page, runs):
    """A tool result stored as RLO + "gnp.exe": the table, the rollout page and the step
    viewer's conversation show it as ⟨U+202E⟩gnp.exe; no text on the page holds the control."""
    tid = runs["edges"]["trajectories"][edges.key(*edges.BIDI_AT)].trace_id
    controls = "[\u202a-\u202e\u2066-\u2069]"
    for path in ("/run/edges/rollouts?q=file", f"/run/edges/rollout/{tid}", f"/run/edges/step/t3#trace={tid}"):
        _go(page, path)
        if "#trace=" in path:
            page.locator("#drawer").wait_for(state="visible")
        text = page.evaluate("document.body.innerText")
        assert "⟨U+202E⟩gnp.exe" in text and not re.search(controls, text), path
    _shot(page, "24-edges-bidi")
