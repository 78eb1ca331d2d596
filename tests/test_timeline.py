"""The fleet in time (issue 41, docs/timeline.md): ``rtrace.mark_weight_update``, the rollouts'
worker, versions and waits, the step metrics of staleness and waiting, and ``rtrace timeline``'s
Chrome trace-event file, from its layout rules to a real job of two workers, two inference
servers behind two capture gateways, a collector and a trainer that marks weight updates."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rtrace
from rtrace.events import RunEvent
from rtrace.pipeline.metrics import StepStats, inflight_peak
from rtrace.report.timeline import MIN_WAIT_NS, Limits, Rollout, build, layout_rollout, pack_lanes
from rtrace.report.trace_json import token_rates, write_trace
from rtrace.summary import RolloutSummary, fleet_fields, summarize
from rtrace.trajectory import SpanRecord, Trajectory
from tests import trace_events
from tests.dataset_run import duckdb_time_unit_ns
from tests.doubles import MetricsSink

ROOT = Path(__file__).resolve().parents[1]
MS = 1_000_000


def _doc(tl) -> dict:
    import io

    buf = io.BytesIO()
    write_trace(tl, buf)
    return json.loads(buf.getvalue())


# ----------------------------------------------------------------------------- layout
class TestLanes:
    @pytest.mark.parametrize("intervals, lanes", [
        ([(0, 10), (10, 20), (20, 30)], 1),         # one after another: one lane (an end is no overlap)
        ([(0, 10), (5, 15), (6, 7), (12, 30)], 3),  # at most three at once
        ([(0, 100)] + [(i, i + 1) for i in range(0, 100, 2)], 2),
    ])
    def test_as_few_lanes_as_overlap_and_never_two_at_once(self, intervals, lanes):
        """One-lane items take exactly the most that overlap, and no lane holds two at once."""
        items = [Rollout(f"{i:032x}", 1, False, s, e) for i, (s, e) in enumerate(intervals)]
        used, left = pack_lanes(items, 512)
        assert (used, left) == (lanes, 0) and used == inflight_peak(intervals)
        by_lane: dict[int, list] = {}
        for r in items:
            by_lane.setdefault(r.lane, []).append((r.start_ns, r.end_ns))
        for spans in by_lane.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    def test_blocks_and_the_lane_limit(self):
        """A rollout of two rows takes two consecutive free lanes; past max_lanes, items are left out."""
        a, b, c = (Rollout(f"{i:032x}", 1, False, s, e) for i, (s, e) in enumerate([(0, 10), (1, 5), (2, 8)]))
        b.rows = 2
        assert pack_lanes([a, b, c], 3) == (3, 1)
        assert (a.lane, b.lane, c.lane) == (0, 1, None)


class TestRolloutLayout:
    def test_calls_nest_waits_fill_and_parallel_calls_get_a_row(self):
        """Spans nest as they ran; a tool call beside its sibling goes to row 1 (the rollout takes two
        lanes); the time in which no leaf span runs is drawn as waits, cut where a span with calls of
        its own ends (so they nest)."""
        r = Rollout("a" * 32, 1, False, 0, 100 * MS)
        spans = [  # (span_id, parent_id, name, kind, start, end, server, tokens, tool)
            ("r", None, "rollout", "rollout", 0, 100 * MS, None, None, None),
            ("a", "r", "agent_loop", "agent", 0, 70 * MS, None, None, None),
            ("g1", "a", "chat", "generation", 0, 20 * MS, "s:1", 7, None),
            ("t1", "a", "calc", "tool", 30 * MS, 50 * MS, None, None, "calculator"),
            ("t2", "a", "calc", "tool", 35 * MS, 60 * MS, None, None, "calculator"),
            ("p", "r", "parse", "chain", 75 * MS, 78 * MS, None, None, None),
            ("s", "r", "compute_score", "chain", 80 * MS, 90 * MS, None, None, None),
        ]
        layout_rollout(r, spans)
        got = {(c.name, c.cat, c.start_ns // MS, c.end_ns // MS, c.row) for c in r.children}
        assert got == {("agent_loop", "agent", 0, 70, 0), ("generation", "generation", 0, 20, 0),
                       ("tool calculator", "tool", 30, 50, 0), ("tool calculator", "tool", 35, 60, 1),
                       ("parse", "chain", 75, 78, 0), ("reward", "reward", 80, 90, 0),
                       ("wait", "wait", 20, 30, 0), ("wait", "wait", 60, 70, 0), ("wait", "wait", 70, 75, 0),
                       ("wait", "wait", 78, 80, 0), ("wait", "wait", 90, 100, 0)}
        assert r.rows == 2
        gen = next(c for c in r.children if c.cat == "generation")
        assert (gen.server, gen.tokens, gen.span_id) == ("s:1", 7, "g1")
        # the summary's wait_ms: the time in no generation and no tool call (their union: the
        # parallel tools count once); parsing and the reward count as waiting there
        assert fleet_fields([_rec(s) for s in spans], 0, 100 * MS)[0] == 100 - 20 - 30

    def test_a_child_that_outlives_its_parent_is_cut_to_it(self):
        r = Rollout("b" * 32, 1, False, 0, 50 * MS)
        layout_rollout(r, [("r", None, "rollout", "rollout", 0, 50 * MS, None, None, None),
                           ("a", "r", "agent", "agent", 0, 30 * MS, None, None, None),
                           ("g", "a", "gen", "generation", 10 * MS, 40 * MS, None, None, None)])
        gen = next(c for c in r.children if c.cat == "generation")
        assert (gen.start_ns, gen.end_ns, gen.row) == (10 * MS, 30 * MS, 0)

    def test_the_file_nests_and_counts(self):
        """A built timeline's file follows the format; counters and token rates add up."""
        rollouts = [Rollout(f"{i:032x}", 3, False, i * 10 * MS, (i * 10 + 35) * MS, worker=f"w{i % 2}",
                            policy_version=2, reward=1.0) for i in range(6)]
        spans = {r.trace_id: [("r", None, "rollout", "rollout", r.start_ns, r.end_ns, None, None, None),
                              ("g", "r", "chat", "generation", r.start_ns + MS, r.start_ns + 21 * MS, "s:1", 20,
                               None)] for r in rollouts[:4]}
        tl = build(rollouts, spans, [RunEvent("weight_update", 25 * MS, 3, 3, "trainer", {}, "e1")], "x", "run",
                   False, (3, 3), Limits())
        doc = _doc(tl)
        assert trace_events.problems(doc) == []
        rates = token_rates(tl.servers["s:1"], tl.origin_ns, 10 * MS)
        assert sum(rate for _, rate in rates) * 0.01 == pytest.approx(80)
        # the rollouts without spans (recorded as summaries only) are bare slices
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
        bare = {r.trace_id for r in rollouts[4:]}
        assert {e["args"]["trace_id"] for e in xs if e["cat"] == "rollout"} == {r.trace_id for r in rollouts}
        for e in xs:
            if e["cat"] == "rollout" and e["args"]["trace_id"] in bare:
                inside = [c for c in xs if (c["pid"], c["tid"]) == (e["pid"], e["tid"]) and c is not e
                          and e["ts"] <= c["ts"] < e["ts"] + e["dur"]]
                assert inside == []

    def test_past_the_limits_the_file_says_what_it_left_out(self):
        """max_detailed and max_lanes: the rest drawn bare or left out, counted, and said in the
        file (a note marker and otherData)."""
        rollouts = [Rollout(f"{i:032x}", 3, False, 0, 10 * MS, worker="w") for i in range(5)]
        spans = {r.trace_id: [("r", None, "rollout", "rollout", 0, 10 * MS, None, None, None),
                              ("g", "r", "chat", "generation", MS, 2 * MS, None, None, None)] for r in rollouts}
        tl = build(rollouts, spans, [], "x", None, False, (3, 3), Limits(max_detailed=2, max_lanes=4))
        doc = _doc(tl)
        assert trace_events.problems(doc) == []
        info = doc["otherData"]["rtrace"]
        assert info["left_out"] == {"rollouts_without_children": 3, "rollouts_past_max_lanes": 1}
        assert (info["rollouts"], info["rollouts_drawn"], info["rollouts_with_children"]) == (5, 4, 2)
        notes = [e["name"] for e in doc["traceEvents"] if e.get("cat") == "note"]
        assert len(notes) == 2 and notes == ["note: " + n for n in info["notes"]]
        # the counters still count all five
        flight = [e["args"]["rollouts in flight"] for e in doc["traceEvents"]
                  if e["ph"] == "C" and e["pid"] == 1 and e["name"] == "rollouts in flight"]
        assert max(flight) == 5


def _rec(row) -> SpanRecord:
    attrs = {"server.address": row[6]} if row[6] else {}
    return SpanRecord(row[0], row[1], row[2], row[3], row[4], row[5], attributes=attrs)


# ----------------------------------------------------------------------------- weight updates
class TestWeightUpdates:
    def test_marked_updates_reach_jsonl_and_the_dataset_and_version_the_rollouts(self, tmp_path):
        """mark_weight_update's events are JSONL lines of their own (which readers of trajectories
        skip) and the dataset's events view; a rollout that ran across one is marked crossed, and
        ends on its version."""
        pytest.importorskip("duckdb")
        from rtrace.exporters.jsonl import read_events, read_jsonl
        from rtrace.report.load import read_records

        jsonl = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl,parquet", jsonl_path=str(jsonl), parquet_path=str(tmp_path / "ds"),
                         experiment="r", export_interval_s=0.02, health_checks="none", worker_name="w-1")
        try:
            rtrace.mark_weight_update(4, step=4, source="test")
            with rtrace.rollout_context(step=5, sample_index=0, policy_version=4):
                time.sleep(0.01)
                before = time.time_ns()
                rtrace.mark_weight_update(5, step=5)
                after = time.time_ns()
                time.sleep(0.01)
            with rtrace.rollout_context(step=5, sample_index=1, policy_version=5):
                pass
            assert rtrace.flush(30)
        finally:
            rtrace.shutdown()
        events = read_events(jsonl)
        assert [(e.version, e.step, e.worker, e.attributes) for e in events] == [
            (4, 4, "w-1", {"source": "test"}), (5, 5, "w-1", {})]
        assert before <= events[1].time_ns <= after
        trajs = {t.sample_index: t for t in read_jsonl(jsonl)}
        records, _ = read_records([jsonl])
        assert len(records) == 2  # the event lines are not trajectories
        assert [(t.worker, t.policy_version_end, t.crossed_update) for t in (trajs[0], trajs[1])] == [
            ("w-1", 5, True), ("w-1", 5, False)]
        run = rtrace.open_run(tmp_path / "ds" / "r")
        # DuckDB 1.x reads UTC nanosecond timestamps to the microsecond (docs/dataset.md, "Times")
        us = duckdb_time_unit_ns()
        assert run.sql("SELECT version, step, worker, epoch_ns(time), attributes_str FROM events").fetchall() == [
            (4, 4, "w-1", events[0].time_ns // us * us, {"source": "test"}),
            (5, 5, "w-1", events[1].time_ns // us * us, {})]
        assert run.sql("SELECT sample_index, worker, policy_version_end, crossed_update FROM trajectories "
                       "ORDER BY 1").fetchall() == [(0, "w-1", 5, True), (1, "w-1", 5, False)]
        # the events files have docs/dataset-schema.json's columns (at shutdown a writer merges its own into one)
        import pyarrow.parquet as pq

        from rtrace.dataset import schema

        documented = json.loads((ROOT / "docs" / "dataset-schema.json").read_text())["tables"]["events"]
        (f,) = (tmp_path / "ds" / "r" / "events").glob("*.parquet")
        got = pq.read_schema(f)
        assert [(c.name, schema.type_text(c.type)) for c in got] == [(c["name"], c["type"]) for c in documented]
        assert got.metadata[b"rtrace.table"] == b"events"

    def test_it_never_raises(self, tmp_path):
        """A version that is no int is dropped and counted; tracing off costs nothing and does nothing."""
        rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=0.02)
        try:
            rtrace.mark_weight_update("seven")
            rtrace.mark_weight_update(object(), step=[1])
            rtrace.mark_weight_update(7.0, step=7)  # a whole float is an int
            assert rtrace.flush(30)
            stats = rtrace.stats()
            assert (stats.get("weight_updates_invalid"), stats.get("weight_updates")) == (2, 1)
        finally:
            rtrace.shutdown()
        rtrace.configure(exporter="none")
        rtrace.mark_weight_update(1)

    def test_a_bad_environment_does_not_raise_into_the_trainer(self, monkeypatch):
        """Configured from a bad environment on first use (the ConfigError a decorated call raises
        once): the trainer's mark_weight_update is counted as failed, never raised."""
        from rtrace.testing import reset

        reset()
        monkeypatch.setenv("RTRACE_EXPORTER", "no-such-sink")
        rtrace.mark_weight_update(3, step=3)
        assert rtrace.stats().get("weight_updates_failed") == 1
        reset()

    @pytest.mark.integration
    def test_every_collector_gets_each_update_and_readers_keep_one(self, tmp_path):
        """Collector mode with two collectors writing one dataset: a weight update, which belongs to no
        rollout, goes to both (each versions its own rollouts); the events view has it once."""
        pytest.importorskip("grpc")
        ds = tmp_path / "ds"
        cols = [rtrace.start_collector(exporter="parquet", parquet_path=str(ds), experiment="job", settle_s=0.2,
                                       health_checks="none") for _ in range(2)]
        try:
            env = {**os.environ, **cols[0].env, "PYTHONPATH": str(ROOT),
                   "RTRACE_COLLECTOR_ENDPOINT": ",".join(c.endpoint for c in cols)}
            code = ("import rtrace\n"
                    "rtrace.mark_weight_update(9, step=8)\n"
                    "for i in range(8):\n"
                    "    with rtrace.rollout_context(step=9, sample_index=i, policy_version=8):\n"
                    "        pass\n"
                    "assert rtrace.flush(30)\n")
            subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
            for c in cols:
                assert c.flush(30)
        finally:
            for c in cols:
                c.stop()
        run = rtrace.open_run(ds / "job")
        assert len(list((ds / "job" / "events").glob("*.parquet"))) == 2  # one per collector
        assert run.sql("SELECT version, step FROM events").fetchall() == [(9, 8)]
        rows = run.sql("SELECT policy_version_end, crossed_update FROM trajectories").fetchall()
        assert len(rows) == 8 and set(rows) == {(9, False)}
        # both collectors owned rollouts (the placement spread them), and each versioned its own
        assert len({f.name.split("-")[0] for f in (ds / "job" / "trajectories").rglob("*.parquet")}) == 2


# ----------------------------------------------------------------------------- step metrics
def _traj(tid: str, step: int, version: int, start_ms: int, calls: list, reward: float = 1.0,
          crossed: bool | None = None) -> Trajectory:
    """A trajectory of known times: ``calls`` are (kind, start ms, end ms, server)."""
    spans = [SpanRecord("r" * 16, None, "rollout", "rollout", start_ms * MS, max(c[2] for c in calls) * MS)]
    for n, (kind, s, e, server) in enumerate(calls):
        attrs = {"server.address": server} if server else {}
        spans.append(SpanRecord(f"{n:016x}", "r" * 16, kind, kind, s * MS, e * MS, attributes=attrs))
    return Trajectory(tid, "rollout", spans, step=step, policy_version=version, reward=reward,
                      crossed_update=crossed)


class TestStepMetrics:
    def test_staleness_waiting_and_the_fleet_from_a_known_schedule(self):
        """Three rollouts of step 10 with known times, versions, servers and rewards: every fleet
        metric equals the value worked out by hand."""
        trajs = [
            # on policy; gen 0-20 (A), tool 20-30, gen 40-50 (A): waits 30-40 = 10 ms
            _traj("a" * 32, 10, 10, 0, [("generation", 0, 20, "A"), ("tool", 20, 30, None),
                                        ("generation", 40, 50, "A")], reward=1.0, crossed=False),
            # one step stale; gen 5-45 (B, the straggler), two tools side by side 45-55 and 50-60: no wait
            _traj("b" * 32, 10, 9, 5, [("generation", 5, 45, "B"), ("tool", 45, 55, None),
                                       ("tool", 50, 60, None)], reward=0.0, crossed=True),
            # three steps stale; gen 30-70 (B); its root starts at 25: waits 25-30 = 5 ms
            _traj("c" * 32, 10, 7, 25, [("generation", 30, 70, "B")], reward=1.0, crossed=False),
        ]
        trajs[2].spans[0].start_ns = 25 * MS
        stats = StepStats()
        for t in trajs:
            stats.add(summarize(t))
        v = stats.values("rollout")
        assert {k[len("rollout/"):]: x for k, x in v.items() if k[len("rollout/"):] in _FLEET} == pytest.approx({
            "staleness_mean": (0 + 1 + 3) / 3, "staleness_max": 3.0,
            "staleness/0_frac": 1 / 3, "staleness/1_frac": 1 / 3, "staleness/2_frac": 0.0,
            "staleness/3_frac": 1 / 3, "staleness/4plus_frac": 0.0,
            "staleness/0_pass_rate": 1.0, "staleness/1_pass_rate": 0.0, "staleness/3_pass_rate": 1.0,
            "crossed_update_rate": 1 / 3,
            "generation_ms_mean": (30 + 40 + 40) / 3, "tool_ms_mean": (10 + 20 + 0) / 3,
            "wait_ms_mean": (10 + 0 + 5) / 3,
            "inflight_peak": 3.0,  # all three between 25 and 50
            "servers": 2.0, "slowest_server_share": 80 / 110,
        })

    def test_the_metrics_of_several_workers_merge_exactly(self):
        one, a, b = StepStats(), StepStats(), StepStats()
        items = [RolloutSummary(f"{i:032x}", step=4, policy_version=4 - i % 3, reward=float(i % 2),
                                start_ns=i * MS, end_ns=(i + 30) * MS, wait_ms=i, server_ms={f"s{i % 2}": 1.0 + i})
                 for i in range(10)]
        for i, s in enumerate(items):
            one.add(s)
            (a if i % 2 else b).add(s)
        a.merge(b)
        assert a.values("rollout") == pytest.approx(one.values("rollout"))


_FLEET = {"staleness_mean", "staleness_max", "staleness/0_frac", "staleness/1_frac", "staleness/2_frac",
          "staleness/3_frac", "staleness/4plus_frac", "staleness/0_pass_rate", "staleness/1_pass_rate",
          "staleness/2_pass_rate", "staleness/3_pass_rate", "staleness/4plus_pass_rate", "crossed_update_rate",
          "generation_ms_mean", "tool_ms_mean", "wait_ms_mean", "inflight_peak", "servers", "slowest_server_share"}


# ----------------------------------------------------------------------------- a real job
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two workers (processes), two inference servers (fake vLLMs, one slow) each behind an `rtrace
    gateway` process, a collector (this process, parquet and JSONL), a trainer process marking a weight
    update in each step while rollouts run. Returns what the test needs to check the timeline."""
    pytest.importorskip("grpc")
    pytest.importorskip("duckdb")
    from rtrace.testing import reset
    from tests.fake_vllm import FakeVLLM
    from tests.servers import free_port, stop_server, wait_http

    reset()
    tmp = tmp_path_factory.mktemp("timeline_job")
    fast, slow = FakeVLLM().start(), FakeVLLM().start()
    fast.delay_s, slow.delay_s = 0.03, 0.15  # the second server straggles
    metrics = MetricsSink()
    collector = rtrace.start_collector(exporter="parquet,jsonl", parquet_path=str(tmp / "ds"),
                                       jsonl_path=str(tmp / "job.jsonl"), experiment="job", settle_s=1.0,
                                       health_checks="none", sinks=[metrics])
    base = {**os.environ, **collector.env, "PYTHONPATH": str(ROOT), "RTRACE_GATEWAY_SECRET": "s" * 32,
            "HF_HUB_OFFLINE": "1"}
    base.pop("RTRACE_WORKER_NAME", None)
    procs: list[subprocess.Popen] = []
    gateways = []
    try:
        for up in (fast, slow):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "rtrace", "gateway", "--upstream", up.url, "--port",
                                           str(port), "--env-file", str(tmp / f"gw{port}.env")], env=base, cwd=tmp,
                                          stdout=subprocess.DEVNULL, start_new_session=True))
            wait_http(f"http://127.0.0.1:{port}/rtrace/health", 60, procs[-1])
            gateways.append(f"http://127.0.0.1:{port}")
        run = [sys.executable, "-m", "tests.timeline_job"]
        workers = [subprocess.Popen(run + ["worker", str(w), str(tmp), *gateways],
                                    env={**base, **({"RTRACE_WORKER_NAME": "worker-0"} if w == 0 else {})}, cwd=ROOT)
                   for w in (0, 1)]
        trainer = subprocess.Popen(run + ["trainer", str(tmp)], env={**base, "RTRACE_WORKER_NAME": "trainer"},
                                   cwd=ROOT)
        for p in workers + [trainer]:
            assert p.wait(180) == 0
        for p in procs:  # the gateways write what they hold (their generation spans) on SIGTERM
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(60)
        assert collector.flush(60)
    finally:
        for p in procs:
            stop_server(p)
        collector.stop()
        fast.stop()
        slow.stop()
    updates = [json.loads((tmp / f"update{s}.json").read_text()) for s in (1, 2)]
    out = tmp / "timeline.json"
    from rtrace.cli import main

    assert main(["timeline", str(tmp / "ds" / "job"), "--steps", "1:2", "-o", str(out)]) == 0
    return {"tmp": tmp, "doc": json.loads(out.read_text()), "run": rtrace.open_run(tmp / "ds" / "job"),
            "updates": updates, "workers": workers, "servers": [urlsplit(u.url) for u in (fast, slow)],
            "metrics": metrics.metrics}


def urlsplit(url):
    from urllib.parse import urlsplit as split

    return split(url)


def _named(doc) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def _us(doc, ns: int) -> int:
    """A time on the file's clock: whole microseconds from its origin, floored."""
    return (ns - doc["otherData"]["rtrace"]["origin_unix_ns"]) // 1000


@pytest.mark.integration
class TestJob:
    def test_the_file_follows_the_format(self, job):
        assert trace_events.problems(job["doc"]) == []

    def test_servers_and_workers_are_named(self, job):
        """A process per inference server (the gateway's upstream, host:port) and per worker (its
        RTRACE_WORKER_NAME, else host:pid), and the fleet."""
        names = sorted(_named(job["doc"]).values())
        servers = [f"server {u.hostname}:{u.port}" for u in job["servers"]]
        workers = ["worker worker-0", f"worker {socket.gethostname()}:{job['workers'][1].pid}"]
        assert names == sorted(["fleet"] + servers + workers)
        rows = job["run"].sql("SELECT DISTINCT worker FROM trajectories ORDER BY 1").fetchall()
        assert sorted(r[0] for r in rows) == sorted(w[len("worker "):] for w in workers)

    def test_slices_equal_the_spans_times_and_nesting(self, job):
        """Every rollout is a slice on its worker's process with its trace id; every span of it a slice
        with the span's start and end (on the file's clock: whole microseconds, floored), on its lane,
        inside its parent's slice; each generation again on its server's process."""
        doc, run = job["doc"], job["run"]
        names = _named(doc)
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        rollout_ev = {e["args"]["trace_id"]: e for e in xs if e["cat"] == "rollout"}
        trajs = run.sql("SELECT trace_id, worker, epoch_ns(start_time), epoch_ns(end_time) FROM trajectories "
                        "WHERE step BETWEEN 1 AND 2").fetchall()
        assert len(trajs) == 12 and set(rollout_ev) == {t[0] for t in trajs}
        by_thread = trace_events.slices(doc)
        for trace_id, worker, start, end in trajs:
            ev = rollout_ev[trace_id]
            assert names[ev["pid"]] == f"worker {worker}"
            assert (ev["ts"], ev["ts"] + ev["dur"]) == (_us(doc, start), _us(doc, end))
            spans = run.sql("SELECT span_id, parent_span_id, kind, name, epoch_ns(start_time), epoch_ns(end_time), "
                            "attributes_str['server.address'], attributes_int['server.port'] FROM spans "
                            "WHERE trace_id = ?", [trace_id]).fetchall()
            assert sorted(s[2] for s in spans) == ["generation", "generation", "reward", "rollout", "tool"]
            # (no call of this job runs beside another: all on the rollout's own lane)
            mine = [c for c in by_thread[(ev["pid"], ev["tid"])] if c["cat"] != "rollout"
                    and _us(doc, start) <= c["ts"] and c["ts"] + c["dur"] <= _us(doc, end)]
            for sid, parent, kind, name, s, e, address, port in spans:
                if parent is None:
                    continue
                (slice_,) = [c for c in mine if c["cat"] == kind and (c["ts"], c["ts"] + c["dur"]) == (
                    _us(doc, s), _us(doc, e))]
                # the calls are the root's children: inside the rollout's slice, on its lane
                assert parent in {p[0] for p in spans if p[1] is None}
                if kind == "generation":
                    (on_server,) = [c for c in xs if names[c["pid"]] == f"server {address}:{port}"
                                    and c["args"]["trace_id"] == trace_id and c["ts"] == _us(doc, s)]
                    assert on_server["ts"] + on_server["dur"] == _us(doc, e)
            # the rest of the rollout's time is its waits: no model call, tool or reward computation
            calls = sorted((s, e) for _, p, k, _, s, e, _, _ in spans if k in ("generation", "tool", "reward"))
            waits = sum(c["dur"] for c in mine if c["cat"] == "wait") * 1000  # (each floored: within 1 us)
            gaps = sum(max(0, b[0] - a[1]) for a, b in zip([(start, start)] + calls, calls + [(end, end)]))
            assert -10_000 <= gaps - waits <= 10 * MIN_WAIT_NS  # pieces under 0.1 ms are not drawn

    def test_lanes_never_overlap(self, job):
        """On a worker's lane, rollouts never overlap, and every slice nests (checked for every thread
        in test_the_file_follows_the_format); two workers' lanes are different processes."""
        doc = job["doc"]
        for (pid, tid), evs in trace_events.slices(doc).items():
            rollouts = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["cat"] == "rollout")
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(rollouts, rollouts[1:])), (pid, tid)
        lanes = doc["otherData"]["rtrace"]["workers"]
        assert sum(w["lanes"] for w in lanes.values()) >= 4  # concurrent rollouts took several lanes

    def test_weight_update_markers_where_they_were_marked(self, job):
        """A marker per mark_weight_update, at the time of the call, with its version and step; the
        rollouts that ran across it are flagged and end on its version."""
        doc, run = job["doc"], job["run"]
        marks = [e for e in doc["traceEvents"] if e["ph"] == "i" and e.get("cat") == "weight_update"]
        assert [(m["args"]["version"], m["args"]["step"], m["args"]["worker"], m["s"]) for m in marks] == [
            (1, 1, "trainer", "g"), (2, 2, "trainer", "g")]
        for m, u in zip(marks, job["updates"]):
            assert _us(doc, u["before"]) <= m["ts"] <= _us(doc, u["after"])
        times = [t for (t,) in run.sql("SELECT epoch_ns(time) FROM events ORDER BY time").fetchall()]
        rows = run.sql("SELECT step, sample_index, epoch_ns(start_time), epoch_ns(end_time), policy_version_end, "
                       "crossed_update FROM trajectories").fetchall()
        for step, index, start, end, version_end, crossed in rows:
            assert crossed == any(start < t <= end for t in times)
            assert version_end == max((v for v, t in enumerate(times, 1) if t <= end), default=None)
        assert sum(1 for r in rows if not r[5]) == 2  # step 2's last rollouts began after its update

    def test_counters_equal_a_count_from_the_spans(self, job):
        """Rollouts in flight (the fleet's and each worker's) and generations in flight (each server's)
        at every change equal the number of intervals open then; the tokens per second add up to each
        server's output tokens."""
        doc, run = job["doc"], job["run"]
        names = _named(doc)
        counters: dict[tuple[int, str], list] = {}
        for e in doc["traceEvents"]:
            if e["ph"] == "C":
                counters.setdefault((e["pid"], e["name"]), []).append(e)
        rollouts = run.sql("SELECT worker, epoch_ns(start_time), epoch_ns(end_time) FROM trajectories").fetchall()
        gens = run.sql("SELECT attributes_str['server.address'] || ':' || attributes_int['server.port'], "
                       "epoch_ns(start_time), epoch_ns(end_time), output_tokens FROM spans "
                       "WHERE kind = 'generation'").fetchall()
        assert len(gens) == 24

        def open_at(intervals, t):  # on the file's clock
            return sum(1 for s, e in intervals if _us(doc, s) <= t < _us(doc, e))

        checked = 0
        for (pid, name), evs in counters.items():
            process = names[pid]
            if name == "rollouts in flight":
                spans = [(s, e) for w, s, e in rollouts if process in ("fleet", f"worker {w}")]
            elif name == "generations in flight":
                spans = [(s, e) for srv, s, e, _ in gens if process == f"server {srv}"]
            elif name == "output tokens/s":
                total = sum(t for srv, _, _, t in gens if process == f"server {srv}")
                bucket = doc["otherData"]["rtrace"]["tokens_per_s_bucket_ms"] / 1000
                assert sum(e["args"]["tokens/s"] for e in evs) * bucket == pytest.approx(total) and total > 0
                continue
            else:
                assert name == "policy version"
                continue
            for e in evs:
                assert e["args"][name] == open_at(spans, e["ts"])
                checked += 1
        assert checked > 50

    def test_the_step_metrics_of_the_job(self, job):
        """The collector's step metrics of staleness, waiting, in-flight peak and the slowest server's
        share equal those worked out from the rows and spans."""
        run = job["run"]
        got = {m.step: m.values for m in job["metrics"] if not m.validate}
        for step in (1, 2):
            v = got[step]
            rows = run.sql("SELECT trace_id, policy_version, reward, epoch_ns(start_time), epoch_ns(end_time) "
                           "FROM trajectories WHERE step = ?", [step]).fetchall()
            stale = [step - r[1] for r in rows]
            assert v["rollout/staleness_mean"] == pytest.approx(sum(stale) / len(stale))
            assert v["rollout/staleness_max"] == max(stale)
            assert v["rollout/inflight_peak"] == inflight_peak([(r[3], r[4]) for r in rows])
            waits, per_server = [], {}
            for trace_id, _, _, start, end in rows:
                calls = run.sql("SELECT kind, epoch_ns(start_time), epoch_ns(end_time), "
                                "attributes_str['server.address'] || ':' || attributes_int['server.port'] "
                                "FROM spans WHERE trace_id = ? AND kind IN ('generation', 'tool') ORDER BY 2",
                                [trace_id]).fetchall()
                busy = sum(e - s for _, s, e, _ in calls)  # one after another in this job
                waits.append((end - start - busy) / 1e6)
                for kind, s, e, server in calls:
                    if kind == "generation":
                        per_server[server] = per_server.get(server, 0) + (e - s) / 1e6
            assert v["rollout/wait_ms_mean"] == pytest.approx(sum(waits) / len(waits))
            assert v["rollout/servers"] == 2
            assert v["rollout/slowest_server_share"] == pytest.approx(max(per_server.values()) /
                                                                      sum(per_server.values()))
        assert got[2]["rollout/staleness/2_frac"] == pytest.approx(2 / 6)  # rollout 2 of each worker

    def test_the_jsonl_gives_the_same_timeline(self, job):
        """`rtrace timeline` on the collector's JSONL: the same rollouts, lanes and slices."""
        from rtrace.cli import main

        out = job["tmp"] / "from_jsonl.json"
        assert main(["timeline", str(job["tmp"] / "job.jsonl"), "--steps", "1:2", "-o", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert trace_events.problems(doc) == []

        def shape(d):
            names = _named(d)
            return sorted((names[e["pid"]], e["tid"], e["name"], round(e["ts"]), round(e["dur"]))
                          for e in d["traceEvents"] if e["ph"] == "X")

        assert shape(doc) == shape(job["doc"])

    def test_the_query_layer_serves_an_open_run(self, job):
        """rtrace serve's way in: load_timeline over an open Run (left open) gives the rollouts the file
        draws, with their lanes and calls."""
        from rtrace.report.timeline import load_timeline

        tl = load_timeline(job["run"], (1, 2))
        doc = job["doc"]
        drawn = {e["args"]["trace_id"]: e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "rollout"}
        assert {r.trace_id for r in tl.rollouts} == set(drawn)
        for r in tl.rollouts:
            assert 1 + r.lane == drawn[r.trace_id]["tid"]
            assert sorted(c.cat for c in r.children if c.cat != "wait") == ["generation", "generation", "reward",
                                                                           "tool"]
        assert job["run"].sql("SELECT count(*) FROM events").fetchall() == [(2,)]  # still open
