"""``rtrace serve``'s swimlane in a real browser (issue 41): a step's servers and workers drawn on one
canvas, a click on a slice opens its rollout, zoom and pan move the view, hostile names stay text,
and a step of 10,000 rollouts x 20 spans (tests/ui/fleet_run.py, cached under ``$RTRACE_UI_CACHE``)
with its first draw and its frames timed.

The server is the real command (``python -m rtrace serve``, its own process, stopped by pid); the
small run is fleet_run's generator at a small size with markup in a worker's name, a server's
address and a tool's name. Playwright drives Debian's chromium; no test passes with a console
error, an uncaught exception, a dialog or a request to anything but the server. What the canvas
shows is read back from its pixels. Timings go to ``artifacts/ui/swimlane-timings.json`` (never
asserted); screenshots to ``artifacts/ui/swimlane-*.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest

pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")
pytest.importorskip("starlette")
pytest.importorskip("duckdb")

from tests.servers import rtrace_serve  # noqa: E402
from tests.ui import fleet_run  # noqa: E402
from tests.ui.browser import ARTIFACTS, REPO, watched_page  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
STEP = fleet_run.STEP
HOSTILE_WORKER = "<img src=x onerror=alert('worker')>"
HOSTILE_SERVER = "<svg onload=alert(1)>"
TIMINGS: dict[str, object] = {}


def _record(name: str, value: object) -> None:
    TIMINGS[name] = value
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "swimlane-timings.json").write_text(json.dumps(TIMINGS, indent=1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A small step with hostile names (a dataset), and the 10,000-rollout step."""
    from rtrace.dataset.layout import open_store
    from rtrace.dataset.writer import DatasetWriter

    out = tmp_path_factory.mktemp("swimlane-ui")
    trajs, events = fleet_run.trajectories(30, seed=11, workers=2, slots=3, servers=2)
    fleet_run.rename_hostile(trajs, HOSTILE_WORKER, HOSTILE_SERVER)
    folder = out / "small"
    folder.mkdir()
    writer = DatasetWriter(open_store(str(folder)), "small")
    writer.write(trajs)
    writer.write_events(events)
    writer.close()
    t0 = time.perf_counter()
    big = fleet_run.ensure()
    _record("fleet_run_ready_s", round(time.perf_counter() - t0, 1))
    return {"small": str(folder), "trajs": trajs, "big": str(big)}


@pytest.fixture(scope="module")
def server(runs):
    with rtrace_serve([f"small={runs['small']}", f"fleet={runs['big']}"], ENV, 300) as served:
        yield served


@pytest.fixture
def page(browser, server):
    """A 1,400-pixel-wide page of the server: every console error, page error, dialog (an injected
    ``alert``) and outside request recorded: none may occur."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with watched_page(browser, (server["url"], "data:"), width=1400, timeout_ms=60_000) as pg:
        pg.base = server["url"]  # type: ignore[attr-defined]
        yield pg


def _until(page, expression: str, timeout_s: float = 120.0) -> None:
    """Poll ``expression`` from here: Playwright's wait_for_function compiles its predicate in the
    page, which the server's content security policy (no eval) refuses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"still not true after {timeout_s} s: {expression}"
        time.sleep(0.05)


def _open(page, path: str) -> float:
    """Open a timeline page; its first draw's time from the navigation's start (ms)."""
    page.goto(page.base + path)
    _until(page, "Boolean(document.getElementById('swimlane').dataset.firstDrawMs)")
    return float(page.evaluate("document.getElementById('swimlane').dataset.firstDrawMs"))


def _settled(page) -> None:
    """Wait until no window is being fetched and the last one is drawn."""
    page.wait_for_timeout(30)
    _until(page, "!document.getElementById('swimlane').swimlane.loading()")
    page.evaluate("new Promise((ok) => requestAnimationFrame(() => requestAnimationFrame(ok)))")


def _view(page) -> dict:
    return page.evaluate("document.getElementById('swimlane').swimlane.view()")


#: the canvas's image, read from a copy (a canvas made to be read: Chromium warns when the page's own
#: canvas is read back again and again)
_IMAGE = """() => { const c = document.getElementById('lanes'), copy = document.createElement('canvas');
    copy.width = c.width; copy.height = c.height;
    const g = copy.getContext('2d', {willReadFrequently: true}); g.drawImage(c, 0, 0);
    return {w: c.width, h: c.height, r: window.devicePixelRatio || 1, d: g.getImageData(0, 0, c.width, c.height).data}; }"""


def _pixels(page, x: float, y: float, w: int = 1, h: int = 1) -> list[list[int]]:
    """The canvas's RGBA at (x, y) (CSS pixels), w x h of them."""
    return page.evaluate(f"""([x, y, w, h]) => {{ const im = ({_IMAGE})(), out = [];
        for (let j = 0; j < h; j++) for (let i = 0; i < w; i++) {{
            const k = ((Math.round(y * im.r) + j) * im.w + Math.round(x * im.r) + i) * 4;
            out.push([im.d[k], im.d[k + 1], im.d[k + 2], im.d[k + 3]]); }}
        return out; }}""", [x, y, w, h])


def _inked(page) -> int:
    """How many pixels of the lanes' area are neither white nor the lanes' pale stripes."""
    return page.evaluate(f"""() => {{ const im = ({_IMAGE})(), d = im.d;
        const x0 = Math.round(210 * im.r), y0 = Math.round(36 * im.r);
        let n = 0;
        for (let y = y0; y < im.h; y += 2) for (let x = x0; x < im.w; x += 2) {{
            const i = (y * im.w + x) * 4;
            if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) n++;
        }}
        return n; }}""")


def _locate(page, trace_id: str, name: str | None = None) -> dict | None:
    return page.evaluate("([t, n]) => document.getElementById('swimlane').swimlane.locate(t, n === null ? undefined : n)",
                         [trace_id, name])


def _canvas_point(page, p: dict) -> tuple[float, float]:
    box = page.locator("#lanes").bounding_box()
    return box["x"] + p["x"], box["y"] + p["y"]


# ----------------------------------------------------------------------------- a small step
def test_the_swimlane_draws_and_a_click_opens_the_rollout(page, runs):
    """Every lane of a small step is open on first view: each rollout is drawn where the page says it
    is (its pixels are the rollout's colours, not the background); hovering shows what it is; a click
    opens that rollout's page."""
    ms = _open(page, f"/run/small/timeline/t{STEP}")
    _record("small_first_draw_ms", round(ms, 1))
    _settled(page)
    assert _inked(page) > 5000
    drawn = 0
    for t in runs["trajs"]:
        p = _locate(page, t.trace_id)
        if p is None:
            continue
        drawn += 1
        (rgba,) = _pixels(page, p["x"], p["y"] - 5)  # near the lane's top edge: the rollout's own bar or a call
        assert rgba[3] == 255 and rgba[:3] != [255, 255, 255] and rgba[:3] != [250, 250, 250], (t.trace_id, rgba)
    assert drawn == len(runs["trajs"])
    page.screenshot(path=str(ARTIFACTS / "swimlane-small.png"))
    target = max(runs["trajs"], key=lambda t: t.spans[-1].end_ns - t.spans[-1].start_ns)  # the longest reward
    x, y = _canvas_point(page, _locate(page, target.trace_id, "reward"))
    page.mouse.move(x, y)
    tip = page.locator("#swimtip")
    tip.wait_for(state="visible")
    text = tip.text_content()
    assert text.startswith("reward\n") and target.trace_id in text and "click: open the rollout" in text
    page.screenshot(path=str(ARTIFACTS / "swimlane-small-tooltip.png"))
    page.mouse.click(x, y)
    page.wait_for_url(f"**/run/small/rollout/{target.trace_id}")
    assert page.locator("#trace-id").text_content() == target.trace_id


def test_zoom_and_pan_change_the_view(page, runs):
    """The buttons, the keys, the wheel and a drag move the view as they say, and what is drawn follows
    (a window at the new scale fetched: the pixels change)."""
    _open(page, f"/run/small/timeline/t{STEP}")
    _settled(page)
    v0 = _view(page)
    before = _pixels(page, 210, 120, 600, 1)
    page.click("button[data-act=in]")
    _settled(page)
    v1 = _view(page)
    assert v1["t1"] - v1["t0"] == pytest.approx((v0["t1"] - v0["t0"]) / 1.5)
    assert (v1["t0"] + v1["t1"]) / 2 == pytest.approx((v0["t0"] + v0["t1"]) / 2)
    page.click("button[data-act=in]")
    _settled(page)
    assert _pixels(page, 210, 120, 600, 1) != before
    # a drag of 200 px to the left: the view moves later by 200 px of time
    v2 = _view(page)
    box = page.locator("#lanes").bounding_box()
    page.mouse.move(box["x"] + 700, box["y"] + 200)
    page.mouse.down()
    page.mouse.move(box["x"] + 600, box["y"] + 200, steps=4)
    page.mouse.move(box["x"] + 500, box["y"] + 200, steps=4)
    page.mouse.up()
    _settled(page)
    v3 = _view(page)
    per_px = (v2["t1"] - v2["t0"]) / (v2["W"] - 210)
    assert v3["t0"] - v2["t0"] == pytest.approx(200 * per_px, rel=0.02)
    assert v3["t1"] - v3["t0"] == pytest.approx(v2["t1"] - v2["t0"])
    # the wheel zooms around the pointer: the time under it stays under it
    x = box["x"] + 800
    t_at = v3["t0"] + (800 - 210) / (v3["W"] - 210) * (v3["t1"] - v3["t0"])
    page.mouse.move(x, box["y"] + 200)
    page.mouse.wheel(0, -300)
    _settled(page)
    v4 = _view(page)
    assert v4["t1"] - v4["t0"] < v3["t1"] - v3["t0"]
    assert v4["t0"] + (800 - 210) / (v4["W"] - 210) * (v4["t1"] - v4["t0"]) == pytest.approx(t_at, rel=1e-6)
    # keys on the focused canvas: → pans later, 0 shows the whole step again
    page.locator("#lanes").focus()
    page.keyboard.press("ArrowRight")
    v5 = _view(page)
    assert v5["t0"] == pytest.approx(v4["t0"] + 0.15 * (v4["t1"] - v4["t0"]))
    page.keyboard.press("0")
    _settled(page)
    assert _view(page)["t0"] == pytest.approx(v0["t0"]) and _view(page)["t1"] == pytest.approx(v0["t1"])
    # a band closes and opens on a click on its name
    top = page.evaluate("document.getElementById('swimlane').swimlane.bandTop(0)")
    page.mouse.click(box["x"] + 60, box["y"] + top + 8)
    assert 0 not in _view(page)["open"]
    page.click("button[data-act=open]")
    assert set(_view(page)["open"]) == set(range(4))


def test_hostile_names_are_text(page, runs):
    """A tool named <img onerror>, a worker named <img onerror>, a server named <svg onload>: the
    tooltip and the page's table show them as characters; no element is made from them and nothing
    runs (a dialog would fail the test)."""
    _open(page, f"/run/small/timeline/t{STEP}")
    _settled(page)
    mine = [t for t in runs["trajs"] if t.worker == HOSTILE_WORKER and
            any(s.name == fleet_run.HOSTILE_TOOL for s in t.spans)]
    assert mine
    found = None
    for t in mine:
        found = _locate(page, t.trace_id, "tool " + fleet_run.HOSTILE_TOOL)
        if found:
            break
    assert found, "no hostile tool call on screen"
    x, y = _canvas_point(page, found)
    page.mouse.move(x, y)
    tip = page.locator("#swimtip")
    tip.wait_for(state="visible")
    text = tip.text_content()
    assert text.startswith("tool " + fleet_run.HOSTILE_TOOL) and f"worker {HOSTILE_WORKER}" in text
    assert tip.locator("*").count() == 0
    page.locator("details.swimbands summary").click()
    cells = page.locator("table.bands td").all_text_contents()
    assert HOSTILE_WORKER in cells and f"{HOSTILE_SERVER}:8000" in cells
    assert page.locator("main img, main svg, #swimtip img").count() == 0
    page.screenshot(path=str(ARTIFACTS / "swimlane-hostile.png"))


# ----------------------------------------------------------------------------- 10,000 rollouts
def test_a_step_of_10000_rollouts(page, runs):
    """10,000 rollouts x 20 spans on 16 workers and 4 servers: the first draw (the server lays the
    step out on its first request, then from its cache), a band opened, zoom and pan frames timed
    in the page (performance.now() around each draw); the view always drawn, none of it asserted
    as a time. What is asserted: the bands, the lanes, that a click on a rollout opens it."""
    cold = _open(page, f"/run/fleet/timeline/t{STEP}")
    warm = [_open(page, f"/run/fleet/timeline/t{STEP}") for _ in range(3)]
    _record("fleet_first_draw_ms", {"cold": round(cold, 1), "warm": [round(w, 1) for w in warm]})
    info = fleet_run.info()
    bands = page.evaluate("JSON.parse(document.getElementById('swimdata').textContent).bands")
    assert [b["kind"] for b in bands] == ["server"] * fleet_run.SERVERS + ["worker"] * fleet_run.WORKERS
    assert sum(b["count"] for b in bands if b["kind"] == "worker") == info["rollouts"]
    assert all(b["lanes"] == fleet_run.SLOTS for b in bands if b["kind"] == "worker")
    page.screenshot(path=str(ARTIFACTS / "swimlane-10k-bands.png"))
    # open the first worker's lanes: its rollouts with their calls
    box = page.locator("#lanes").bounding_box()
    top = page.evaluate(f"document.getElementById('swimlane').swimlane.bandTop({fleet_run.SERVERS})")
    t0 = time.perf_counter()
    page.mouse.click(box["x"] + 60, box["y"] + top + 8)
    _settled(page)
    opened_s = time.perf_counter() - t0
    page.locator("#lanes").scroll_into_view_if_needed()
    page.evaluate("document.getElementById('swimlane').swimlane.frames().length")
    shown = int(page.evaluate("document.getElementById('swimlane').dataset.drawn"))
    assert shown > 1000
    page.screenshot(path=str(ARTIFACTS / "swimlane-10k-open.png"))
    # zoom and pan: wheel notches and drags, each a frame drawn from what the page holds
    n0 = len(page.evaluate("document.getElementById('swimlane').swimlane.frames()"))
    cx, cy = box["x"] + 700, box["y"] + 300
    page.mouse.move(cx, cy)
    for _ in range(12):
        page.mouse.wheel(0, -120)
        page.wait_for_timeout(30)
    for _ in range(6):
        page.mouse.down()
        page.mouse.move(cx - 150, cy + 40, steps=6)
        page.mouse.up()
        page.mouse.move(cx, cy)
    for _ in range(12):
        page.mouse.wheel(0, 120)
        page.wait_for_timeout(30)
    _settled(page)
    frames = page.evaluate("document.getElementById('swimlane').swimlane.frames()")[n0:]
    _record("fleet_frames_ms", {"frames": len(frames), "median": round(statistics.median(frames), 2),
                                "p95": round(sorted(frames)[int(len(frames) * 0.95)], 2),
                                "max": round(max(frames), 2), "open_a_band_s": round(opened_s, 2),
                                "slices_drawn_last_frame": int(page.evaluate(
                                    "document.getElementById('swimlane').dataset.drawn"))})
    page.click("button[data-act=all]")
    _settled(page)
    page.screenshot(path=str(ARTIFACTS / "swimlane-10k-after.png"))
    # a click on a rollout of the open band opens it (lanes 4 px tall: the rollouts' own bars, no calls)
    page.select_option("#lanepx", "4")
    _settled(page)
    tid = page.evaluate("""() => { const s = document.getElementById('swimlane').swimlane;
        for (let i = 1; i <= 10000; i++) { const t = i.toString(16).padStart(32, '0');
          const p = s.locate(t); if (p && p.x > 400) return t; } return null; }""")
    assert tid is not None
    x, y = _canvas_point(page, _locate(page, tid))
    page.mouse.click(x, y)
    page.wait_for_url(f"**/run/fleet/rollout/{tid}")
    assert page.locator("#trace-id").text_content() == tid
