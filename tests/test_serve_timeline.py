"""``rtrace serve``'s swimlane (issue 41): a step's timeline page and its windows as JSON, run
in-process with httpx over a step of known times (tests/ui/fleet_run.py's generator, small:
two workers of three slots, two inference servers, two weight updates), written to a dataset by
the dataset's writer and to a JSONL file; hostile names (a tool's, a worker's, a server's) shown
as text. And the step table's staleness and waiting columns and their curves across steps."""

from __future__ import annotations

import asyncio
import html
import json
import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("duckdb")
httpx = pytest.importorskip("httpx")

from rtrace.dataset.layout import open_store  # noqa: E402
from rtrace.dataset.writer import DatasetWriter  # noqa: E402
from rtrace.pipeline.metrics import StepStats  # noqa: E402
from rtrace.report.timeline import MIN_WAIT_NS, category  # noqa: E402
from rtrace.serve import swimlane  # noqa: E402
from rtrace.serve.app import create_app  # noqa: E402
from rtrace.serve.sources import sources_from_paths  # noqa: E402
from tests.ui import fleet_run  # noqa: E402

MS = 1_000_000
STEP = fleet_run.STEP
HOSTILE_WORKER = "<b onmouseover=alert('w')>worker</b>"
HOSTILE_SERVER = "<svg onload=alert(1)>"


def _step(n: int = 24, seed: int = 7):
    """A step of ``n`` rollouts (two workers of three slots, two servers), the second worker named
    with markup, a server with markup in its address; and the run's weight updates."""
    trajs, events = fleet_run.trajectories(n, seed=seed, workers=2, slots=3, servers=2)
    return fleet_run.rename_hostile(trajs, HOSTILE_WORKER, HOSTILE_SERVER), events


def _write(folder, trajs, events, steps=None):
    folder.mkdir(parents=True, exist_ok=True)
    writer = DatasetWriter(open_store(str(folder)), folder.name)
    writer.write(trajs)
    writer.write_events(events)
    writer.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-timeline")
    trajs, events = _step()
    # two earlier steps, for the step table and the curves: one on policy, one a step stale and waiting more
    earlier = []
    for step, lag in ((STEP - 2, 0), (STEP - 1, 1)):
        more, _ = fleet_run.trajectories(6, seed=step, workers=1, slots=2, servers=1)
        for t in more:
            t.step, t.policy_version, t.trace_id = step, step - lag, f"{step:04x}" + t.trace_id[4:]
        earlier += more
    _write(out / "fleet", earlier + trajs, events)
    jsonl = out / "fleet.jsonl"
    with open(jsonl, "w") as f:
        for t in earlier + trajs:
            f.write(json.dumps(t.to_dict()) + "\n")
        for e in events:
            f.write(json.dumps(e.to_line()) + "\n")
    srcs = sources_from_paths([str(out / "fleet"), f"copy={jsonl}"])
    srcs.refresh()
    yield {"app": create_app(srcs), "trajs": trajs, "events": events, "earlier": earlier, "sources": srcs}
    srcs.close()


def fetch(app, *urls, headers=None):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as client:
            return [await client.get(url, headers=headers or {"accept": "text/html"}) for url in urls]
    return asyncio.run(go())


def get(app, url, **kw):
    return fetch(app, url, **kw)[0]


def window(app, query="", run="fleet"):
    r = get(app, f"/run/{run}/timeline/t{STEP}.json" + (f"?{query}" if query else ""),
            headers={"accept": "application/json", "accept-encoding": "gzip"})
    assert r.status_code == 200, r.text
    return r.json()


def slices(d):
    """The window's slices as dicts, times back in ms from the step's start (within half a tick)."""
    S, q, t0 = d["slices"], d["tick_ms"], d["window"]["t0"]
    gen = {S["gen"][k]: (S["gen"][k + 1], S["gen"][k + 2]) for k in range(0, len(S["gen"]), 3)}
    out = []
    for i in range(len(S["t0"])):
        band, lane = d["window"]["lanes"][S["lane"][i]]
        ro = S["ro"][i]
        tok, srv = gen.get(i, (None, -1))
        out.append({"band": d["bands"][band]["name"], "kind": d["bands"][band]["kind"], "lane": lane,
                    "sub": S["sub"][i], "depth": S["depth"][i], "t0": t0 + S["t0"][i] * q, "t1": t0 + S["t1"][i] * q,
                    "cat": d["cats"][S["cat"][i]], "name": None if S["name"][i] < 0 else d["names"][S["name"][i]],
                    "n": S["n"][i], "trace_id": d["rollouts"]["trace_id"][ro] if ro >= 0 else None,
                    "tokens": tok, "server": d["names"][srv] if srv >= 0 else None})
    return out


def _ms(ns, origin):
    return (ns - origin) / MS


class TestTheWindow:
    def test_every_rollout_and_call_of_the_step_with_its_times(self, run):
        """The first window (a small step: every lane open) holds each rollout once on a lane of its worker,
        and each of its spans, as what it is, at its times (to the tick); each generation also on its
        server's lanes; the waits between calls; the bands named after the workers and servers."""
        d = window(run["app"], "min_px=0&px=4096")
        trajs = run["trajs"]
        origin = min(t.start_ns for t in trajs)
        assert d["origin_ns"] == origin and d["rollouts_total"] == len(trajs)
        tick = d["tick_ms"] / 2 + 1e-6
        got = slices(d)
        assert all(s["n"] == 1 for s in got)  # min_px=0: nothing merged
        rolls = [s for s in got if s["cat"] == "rollout"]
        assert sorted(s["trace_id"] for s in rolls) == sorted(t.trace_id for t in trajs)
        by_id = {t.trace_id: t for t in trajs}
        for s in rolls:
            t = by_id[s["trace_id"]]
            assert s["band"] == t.worker and s["kind"] == "worker" and s["depth"] == 0
            assert s["t0"] == pytest.approx(_ms(t.start_ns, origin), abs=tick)
            assert s["t1"] == pytest.approx(_ms(t.end_ns, origin), abs=tick)
        # the rollouts table: exact times (to the µs), coordinates, versions, staleness
        R = d["rollouts"]
        for k, tid in enumerate(R["trace_id"]):
            t = by_id[tid]
            assert (R["t0"][k], R["t1"][k]) == (round(_ms(t.start_ns, origin), 3), round(_ms(t.end_ns, origin), 3))
            assert (R["worker"][k], R["group"][k], R["rollout_n"][k]) == (t.worker, t.group_id, t.rollout_n)
            assert (R["policy_version"][k], R["policy_version_end"][k], R["crossed_update"][k], R["staleness"][k]) == (
                t.policy_version, t.policy_version_end, t.crossed_update, STEP - t.policy_version)
        # each span inside its rollout: what it is, its name, its times
        for t in trajs:
            calls = sorted((s["cat"], s["name"], round(s["t0"], 1), round(s["t1"], 1)) for s in got
                           if s["trace_id"] == t.trace_id and s["kind"] == "worker" and s["depth"] > 0
                           and s["cat"] != "wait")
            want = []
            for sp in t.spans[1:]:
                cat = category(sp.kind, sp.name)
                name = {"generation": "generation", "tool": f"tool {sp.name}", "reward": "reward"}.get(cat, sp.name)
                want.append((cat, name, round(_ms(sp.start_ns, origin), 1), round(_ms(sp.end_ns, origin), 1)))
            assert [c[:2] for c in calls] == [w[:2] for w in sorted(want)]
            for c, w in zip(calls, sorted(want)):
                assert c[2] == pytest.approx(w[2], abs=tick + 0.1) and c[3] == pytest.approx(w[3], abs=tick + 0.1)
            # the waits: the time in no call, where it is long enough to draw
            waits = sum(s["t1"] - s["t0"] for s in got if s["trace_id"] == t.trace_id and s["cat"] == "wait")
            busy, cur = 0.0, t.start_ns
            for sp in sorted(t.spans[1:], key=lambda x: x.start_ns):
                gap = sp.start_ns - cur
                busy += gap if gap >= MIN_WAIT_NS else 0
                cur = max(cur, sp.end_ns)
            gap = t.end_ns - cur
            busy += gap if gap >= MIN_WAIT_NS else 0
            assert waits == pytest.approx(busy / MS, abs=20 * tick)
        # generations on their servers' lanes, with their tokens, never two at once on a lane
        gens = [s for s in got if s["kind"] == "server"]
        spans = [sp for t in trajs for sp in t.spans if sp.kind == "generation"]
        assert len(gens) == len(spans)
        assert {s["band"] for s in gens} == {"10.0.0.1:8000", f"{HOSTILE_SERVER}:8000"}
        assert sorted(s["tokens"] for s in gens) == sorted(sp.attributes["gen_ai.usage.output_tokens"] for sp in spans)
        for key in {(s["band"], s["lane"]) for s in got if s["depth"] == 0}:
            row = sorted((s["t0"], s["t1"]) for s in got if (s["band"], s["lane"]) == key and s["depth"] == 0)
            assert all(a[1] <= b[0] + tick for a, b in zip(row, row[1:]))
        # the bands: servers first, then workers, each by name
        assert [(b["kind"], b["name"]) for b in d["bands"]] == [
            ("server", "10.0.0.1:8000"), ("server", f"{HOSTILE_SERVER}:8000"), ("worker", HOSTILE_WORKER),
            ("worker", "node-0:1000")]
        assert sum(b["count"] for b in d["bands"] if b["kind"] == "worker") == len(trajs)

    def test_weight_updates_where_they_were_marked(self, run):
        """Each weight update of the step at its time, with its version; the JSONL copy has them too."""
        trajs, events = run["trajs"], run["events"]
        origin = min(t.start_ns for t in trajs)
        for name in ("fleet", "copy"):
            d = window(run["app"], run=name)
            assert [(e["version"], e["t"], e["step"]) for e in d["events"]] == [
                (e.version, round(_ms(e.time_ns, origin), 3), e.step) for e in events]

    def test_a_window_holds_the_slices_that_overlap_it_and_only_its_lanes(self, run):
        d = window(run["app"], "min_px=0")
        every = slices(d)
        lanes = d["window"]["lanes"]
        t0, t1 = d["end_ms"] * 0.4, d["end_ms"] * 0.45
        w = window(run["app"], f"t0={t0}&t1={t1}&px=1000&lanes=3:0-1,2:1&min_px=0")
        assert w["window"]["lanes"] == [[3, 0], [3, 1], [2, 1]]
        got = slices(w)
        assert got and {(s["band"], s["lane"]) for s in got} <= {("node-0:1000", 0), ("node-0:1000", 1),
                                                                 (HOSTILE_WORKER, 1)}
        tick = w["tick_ms"]
        assert all(s["t1"] > t0 - tick and s["t0"] < t1 + tick for s in got)
        # exactly the rollouts of those lanes that overlap the window
        want = {s["trace_id"] for s in every if s["cat"] == "rollout" and s["t1"] > t0 and s["t0"] < t1
                and [d["bands"].index(next(b for b in d["bands"] if b["name"] == s["band"])), s["lane"]]
                in w["window"]["lanes"]}
        assert {s["trace_id"] for s in got if s["cat"] == "rollout"} == want
        assert len(lanes) > 3
        # short lanes get no calls; no lanes asked: the bands' profiles only
        flat = window(run["app"], f"t0={t0}&t1={t1}&px=1000&lanes=3:0-1,2:1&lane_px=4")
        assert {s["depth"] for s in slices(flat)} == {0} and flat["window"]["detail"] is False
        none = window(run["app"], "lanes=")
        assert none["slices"]["t0"] == [] and len(none["profiles"]["values"]) == len(none["bands"])
        # lanes that do not exist are left out; nonsense is ignored
        odd = window(run["app"], "lanes=9:0-3,2:99,x:1,2:0&t0=nan&px=-5")
        assert odd["window"]["lanes"] == [[2, 0]] and odd["window"]["px"] == 50

    def test_profiles_count_the_lanes_in_use(self, run):
        """A band's profile: the mean number of its rollouts (or generations) in flight in each bin."""
        d = window(run["app"], "px=300")
        trajs = run["trajs"]
        origin = min(t.start_ns for t in trajs)
        bins = d["profiles"]["bins"]
        w0, w1 = d["window"]["t0"], d["window"]["t1"]
        width = (w1 - w0) / bins
        b = next(i for i, band in enumerate(d["bands"]) if band["name"] == "node-0:1000")
        mine = [(_ms(t.start_ns, origin), _ms(t.end_ns, origin)) for t in trajs if t.worker == "node-0:1000"]
        for k in (bins // 4, bins // 2, 3 * bins // 4):
            lo, hi = w0 + k * width, w0 + (k + 1) * width
            mean = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in mine) / width
            assert d["profiles"]["values"][b][k] == pytest.approx(mean, abs=0.06)


class TestBounds:
    def test_narrow_slices_merge_and_a_window_is_bounded(self, tmp_path, monkeypatch):
        """3,000 rollouts one after another on one lane, 500 pixels wide: at most one slice per two
        pixels (the narrow ones merged, each saying how many it holds: all of them in all); the
        gzipped answer stays small; zoomed in, the same rollouts come one by one."""
        trajs, events = fleet_run.trajectories(3000, seed=3, workers=1, slots=1, servers=1)
        _write(tmp_path / "long", trajs, events)
        srcs = sources_from_paths([str(tmp_path / "long")])
        srcs.refresh()
        try:
            app = create_app(srcs)
            r = get(app, f"/run/long/timeline/t{STEP}.json?px=500&lanes=1:0&lane_px=4",
                    headers={"accept": "application/json", "accept-encoding": "gzip"})
            d = r.json()
            got = slices(d)
            assert len(got) <= 500 / 2 + 2
            assert sum(s["n"] for s in got) == 3000 and max(s["n"] for s in got) > 1
            merged = [s for s in got if s["n"] > 1]
            assert all(s["trace_id"] is None and s["cat"] == "rollout" for s in merged)
            assert int(r.headers["content-length"]) < 8_000
            # 200 rollouts with their calls, nothing merged asked: past MAX_SLICES (lowered here) narrow
            # slices merge coarser (min_px says how much), the answer gzipped
            order = sorted(trajs, key=lambda t: t.start_ns)
            end = _ms(order[199].end_ns, order[0].start_ns)
            query = f"/run/long/timeline/t{STEP}.json?t0=0&t1={end}&px=4096&lanes=1:0&lane_px=16&min_px=0"
            whole = json.loads(get(app, query).text)
            assert sum(whole["slices"]["n"]) == len(whole["slices"]["n"]) > 6000  # every call and wait
            monkeypatch.setattr(swimlane, "MAX_SLICES", 2000)
            r = get(app, query, headers={"accept": "application/json", "accept-encoding": "gzip"})
            big = r.json()
            assert len(big["slices"]["t0"]) <= 2000 and big["window"]["min_px"] >= 1
            assert sum(big["slices"]["n"]) == sum(whole["slices"]["n"])  # merged, none lost
            assert r.headers["content-encoding"] == "gzip" and int(r.headers["content-length"]) < 20_000
            first = sorted(trajs, key=lambda t: t.start_ns)[:3]
            origin = first[0].start_ns
            zoom = window(app, f"t0=0&t1={_ms(first[2].end_ns, origin)}&px=1000&lanes=1:0&lane_px=4", run="long")
            assert [s["trace_id"] for s in slices(zoom)] == [t.trace_id for t in first]
            # at most MAX_LANES lanes a window
            many = window(app, "lanes=0:0-999,1:0-999", run="long")
            assert len(many["window"]["lanes"]) <= swimlane.MAX_LANES
        finally:
            srcs.close()


class TestThePage:
    def test_the_page_draws_from_its_embedded_window_and_escapes_every_name(self, run):
        """The page holds the controls, one canvas, the script, its first window (JSON that cannot end
        its element), and the bands and weight updates in words: every name from the traced program
        escaped (a worker's, a server's, a tool's)."""
        r = get(run["app"], f"/run/fleet/timeline/t{STEP}")
        assert r.status_code == 200
        page = r.text
        assert page.count("<canvas") == 1 and 'src="/static/swimlane.js"' in page
        for hostile in (HOSTILE_WORKER, HOSTILE_SERVER, fleet_run.HOSTILE_TOOL):
            assert hostile not in page
        assert html.escape(HOSTILE_WORKER) in page and html.escape(HOSTILE_SERVER + ":8000") in page
        scripts = re.findall(r"<script\b[^>]*>", page)
        assert all('src="/static/' in s or 'type="application/json"' in s for s in scripts)
        embedded = re.search(r'<script type="application/json" id="swimdata">(.*?)</script>', page, re.S).group(1)
        assert "<" not in embedded
        data = json.loads(embedded)
        assert data["bands"][2]["name"] == HOSTILE_WORKER and "tool " + fleet_run.HOSTILE_TOOL in data["names"]
        assert data["window"]["lanes"]  # a small step: every lane open on first view
        for v in (39, 40):
            assert f"v{v} at " in page
        assert get(run["app"], "/static/swimlane.js").status_code == 200

    def test_a_slice_opens_its_rollout(self, run):
        """Every slice that belongs to one rollout names it; its address is that rollout's page."""
        d = window(run["app"], "min_px=0")
        got = slices(d)
        ids = {s["trace_id"] for s in got if s["trace_id"]}
        assert ids == {t.trace_id for t in run["trajs"]}
        for tid in sorted(ids)[:4]:
            r = get(run["app"], d["rollout_base"] + tid)
            assert r.status_code == 200 and tid in r.text

    def test_the_step_page_links_to_its_timeline_and_unknown_steps_are_refused(self, run):
        assert f'href="/run/fleet/timeline/t{STEP}"' in get(run["app"], f"/run/fleet/step/t{STEP}").text
        for url in (f"/run/fleet/timeline/t{STEP + 5}", "/run/fleet/timeline/x1", "/run/fleet/timeline/t-",
                    "/run/nope/timeline/t1", f"/run/fleet/timeline/t{STEP + 5}.json"):
            assert get(run["app"], url).status_code == 404, url


class TestTheStepTable:
    def test_staleness_and_waiting_per_step_as_step_stats_has_them(self, run):
        """The overview's step table and curves: staleness mean / max and generation / tool / wait time per
        rollout of each step, equal to StepStats' over the same rollouts, from the dataset and the JSONL copy."""
        by_step: dict[int, StepStats] = {}
        for t in run["earlier"] + run["trajs"]:
            by_step.setdefault(t.step, StepStats()).add(t)
        keys = ("staleness_mean", "staleness_max", "generation_ms_mean", "tool_ms_mean", "wait_ms_mean")
        for name in ("fleet", "copy"):
            data = json.loads(get(run["app"], f"/run/{name}/overview.json").text)
            for row in data["steps"]:
                want = {k[2:]: v for k, v in by_step[row["step"]].values("x").items() if k[2:] in keys}
                assert set(want) == set(keys)
                assert {k: row["metrics"][k] for k in keys} == pytest.approx(want)
        assert [r["metrics"]["staleness_mean"] for r in data["steps"]][:2] == [0.0, 1.0]
        page = get(run["app"], "/run/fleet/overview").text
        assert "<th>stale</th>" in page and "<th>wait ms</th>" in page
        assert "staleness (step − policy version)" in page and "time per rollout (ms)" in page
