"""Every rollout counted, only the sample recorded in full (issue 40, item 1).

A rollout sampled out when it starts is recorded as a summary only (a Tally of Marks on the
hot path, its summary made in the worker); one the end-of-trajectory selection drops is
summarized from its converted spans; one kept is summarized from its Trajectory. These tests
run the same traced agent (tests/summary_agent.py) through the real decorators, pipeline and
sinks in each of those ways and compare what comes out: the step metrics (equal to recording
everything), each rollout's summary field by field, the collector's counts, the dataset's rows.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import threading
from collections import Counter

import pytest

import rtrace
import rtrace.testing
from rtrace import _setup
from rtrace.pipeline.metrics import StepStats, step_metrics
from rtrace.summary import RolloutSummary, summarize
from tests import summary_agent as agent

SPAWN = mp.get_context("spawn")

#: step metrics that measure time: equal only in distribution between two runs
TIMING = ("latency_ms_", "time_generation_frac", "time_tool_frac", "time_other_frac", "generation_ms_mean",
          "tool_ms_mean", "wait_ms_mean", "inflight_peak", "slowest_server_share")
#: the summary fields that describe the rollout (not how or when it was recorded)
FIELDS = ("name", "step", "sample_index", "rollout_n", "validate", "experiment", "group_id", "policy_version",
          "extra", "reward", "outcome", "annotations", "status", "error", "partial", "turns", "tool_calls",
          "tokens_in", "tokens_out", "finish_reasons", "finish_reason", "health", "dropped_spans")


class Probe(rtrace.Sink):
    """A sink that keeps what it gets: trajectories, rollout summaries, step metrics."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self.trajectories: list = []
        self.summaries: list[RolloutSummary] = []
        self.metrics: list = []

    def export(self, trajectories):
        with self._lock:
            self.trajectories.extend(trajectories)

    def export_summaries(self, summaries):
        with self._lock:
            self.summaries.extend(summaries)

    def export_step_metrics(self, metrics):
        with self._lock:
            self.metrics.extend(metrics)


def key(item) -> tuple:
    return (bool(item.validate), item.step, item.sample_index, item.rollout_n)


def traced_run(probe: Probe | None = None, steps: int = 2, prompts: int = 7, n: int = 2, **settings) -> Probe:
    """The agent's rollouts through the configured pipeline, flushed; rtrace is shut down after."""
    probe = probe or Probe()
    rtrace.testing.reset()  # this run's counters only
    settings.setdefault("await_annotations", "advantage")
    settings.setdefault("annotation_timeout_s", 30)
    rtrace.configure(sinks=[probe], export_interval_s=0.02, **settings)
    try:
        agent.run(rtrace, steps, prompts, n)
        assert rtrace.flush(30)
        probe.stats = rtrace.stats()  # type: ignore[attr-defined]
        probe.tracker = _setup._pipeline.metrics  # type: ignore[attr-defined]
    finally:
        rtrace.shutdown()
    return probe


def by_step(metrics) -> dict:
    out = {(m.validate, m.step): m.values for m in metrics}
    assert len(out) == len(metrics), "a step's metrics were written twice"
    return out


def assert_same_metrics(got: dict, expected: dict, timing: bool) -> None:
    """Equal step by step and key by key: counts exactly, means to float precision; the
    timing keys too when ``timing``."""
    assert got.keys() == expected.keys()
    for step in expected:
        a, b = got[step], expected[step]
        keys = {k for k in a.keys() | b.keys() if timing or not any(t in k for t in TIMING)}
        assert {k for k in a if k in keys} == {k for k in b if k in keys}, step
        for k in sorted(keys):
            if k.endswith("/trajectories"):
                assert a[k] == b[k], (step, k)
            else:
                assert math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-12), (step, k, a[k], b[k])


# ----------------------------------------------------------------------------- step metrics
class TestStepMetrics:
    def test_a_capped_run_has_the_metrics_of_recording_everything(self):
        """max_traces_per_step=2 (summaries on) and no cap: every step metric that does not
        measure time is equal, and every rollout is counted (RTRACE_SUMMARIES=0 counts the 2
        kept only: the test can fail)."""
        everything = traced_run()
        capped = traced_run(max_traces_per_step=2)
        assert len(everything.trajectories) == 28 and not everything.summaries
        assert len(capped.trajectories) == 4 and len(capped.summaries) == 24
        assert_same_metrics(by_step(capped.metrics), by_step(everything.metrics), timing=False)
        assert {v["rollout/trajectories"] for v in by_step(capped.metrics).values()} == {14.0}
        sample_only = traced_run(max_traces_per_step=2, summaries=False)
        assert {v["rollout/trajectories"] for v in by_step(sample_only.metrics).values()} == {2.0}

    def test_the_pipelines_metrics_are_those_of_every_rollouts_summary(self):
        """In a capped run, the pipeline's StepMetrics (every key, latency included) equal the
        StepStats of the kept trajectories' summaries plus the summaries the sink received,
        each rollout counted exactly once."""
        probe = traced_run(max_traces_per_step=2, max_val_traces_per_step=1)
        kept = [summarize(t, t.priority) for t in probe.trajectories]
        every = kept + probe.summaries
        assert len({s.trace_id for s in every}) == len(every) == 28
        assert sorted(key(s) for s in every) == sorted((False, st, p, r) for st in range(2) for p in range(7)
                                                       for r in range(2))
        stats: dict = {}
        for s in every:
            stats.setdefault((s.validate, s.step), StepStats()).add(s)
        tracker = probe.tracker
        expected = {k: step_metrics(*k, v, checks=tracker.checks, whole_groups=tracker.whole_groups).values
                    for k, v in stats.items()}
        assert_same_metrics(by_step(probe.metrics), expected, timing=True)

    def test_odd_group_sizes_are_seen_under_a_cap(self):
        """Group sizes are whole when every rollout is counted, capped or not: a group of 1 among
        groups of 2 is a `coordinates` finding in both runs (it was only without a cap)."""

        @rtrace.traced_rollout
        def loop(i):
            return i

        def run(**settings):
            probe = Probe()
            rtrace.configure(sinks=[probe], export_interval_s=0.02, **settings)
            for p in range(4):
                for r in range(1 if p == 3 else 2):
                    with rtrace.rollout_context(step=0, sample_index=p, rollout_n=r):
                        loop(p)
                        rtrace.record_reward(1.0)
            assert rtrace.flush(30)
            rtrace.shutdown()
            (metrics,) = probe.metrics
            return metrics.values

        everything, capped = run(), run(max_traces_per_step=2)
        assert everything["rollout/health/coordinates_rate"] == capped["rollout/health/coordinates_rate"] == 1 / 7


# ----------------------------------------------------------------------------- one rollout, three ways
def summaries_three_ways(**settings) -> dict[str, dict]:
    """The agent's rollouts kept (no cap), dropped by the end-of-trajectory selection (cap 0,
    prompt sampling: every trajectory recorded, none kept) and recorded as summaries only (cap
    0): each rollout's summary, by coordinates."""
    kept = traced_run(**settings)
    dropped = traced_run(max_traces_per_step=0, sample_prompts=True, **settings)
    tallied = traced_run(max_traces_per_step=0, **settings)
    assert not dropped.trajectories and not tallied.trajectories and not kept.summaries
    # recorded in full and then dropped, or never recorded
    assert dropped.stats["trajectories_started"] == 28 and dropped.stats["trajectories_sampled_out"] == 28
    assert tallied.stats.get("trajectories_started", 0) == 0 and tallied.stats["trajectories_sampled_out"] == 28
    out = {"kept": {key(t): summarize(t) for t in kept.trajectories},
           "dropped": {key(s): s for s in dropped.summaries}, "tallied": {key(s): s for s in tallied.summaries}}
    for name, found in out.items():
        assert len(found) == 28, name
    return out


def fields(summary: RolloutSummary) -> dict:
    return {**{f: getattr(summary, f) for f in FIELDS}, "verdict": summary.verdict(), "truncated": summary.truncated}


class TestOneRolloutThreeWays:
    def test_the_summary_is_the_same_kept_dropped_or_tallied(self):
        """Field by field (turns, tool calls, tokens, finish reasons, status and error, reward,
        outcome, annotations, health, ...), for every kind of rollout of the agent."""
        ways = summaries_three_ways()
        kept = ways["kept"]
        for k, summary in kept.items():
            expected = fields(summary)
            assert fields(ways["dropped"][k]) == expected, k
            assert fields(ways["tallied"][k]) == expected, k
        assert not any(s.recorded for s in ways["tallied"].values())
        assert not any(s.recorded for s in ways["dropped"].values())
        # what the agent's kinds of rollout are: the comparison covers each
        by_kind = {agent.KINDS[k[2] % len(agent.KINDS)]: s for k, s in kept.items() if k[3] == 1}
        assert by_kind["nested"].turns == 2 and by_kind["nested"].tool_calls == 1
        assert by_kind["nested"].tokens_in == 4 + 7 and by_kind["nested"].tokens_out == 3 + 2
        assert by_kind["tool_raises"].status == "ok" and by_kind["tool_raises"].tool_calls == 1
        assert by_kind["truncated"].finish_reason == "length" and by_kind["truncated"].verdict() == "truncated"
        assert by_kind["truncated"].finish_reasons == {"stop": 1, "length": 1}
        assert by_kind["truncated"].tokens_out == 3 + 6
        raised = by_kind["root_raises"]
        assert raised.status == "error" and raised.error.startswith("RuntimeError: rollout 3/1 failed (key ")
        assert agent.SECRET not in raised.error  # redacted, recorded or not
        assert by_kind["annotated"].reward == 0.5 and by_kind["annotated"].annotations == {"advantage": 1.25}
        assert by_kind["nested"].outcome == {"correct": False}
        codes = {kind: sorted({f["check"] for f in s.health}) for kind, s in by_kind.items()}
        assert codes["empty_tool"] == codes["empty_response"] == ["generation"]
        assert codes["truncated"] == ["generation"]  # its last turn stopped at length
        assert {f["detail"] for f in by_kind["empty_tool"].health} == {"tool calculator: empty result"}


# ----------------------------------------------------------------------------- bounds
class TestBounds:
    def test_a_tally_keeps_what_a_recorded_trajectory_keeps(self):
        """max_spans_per_trajectory=4: a rollout of 6 tool calls keeps its root and 3 calls
        recorded or tallied; the tally holds 3 marks, the other 3 counted in dropped_spans."""

        @rtrace.traced_tool
        def tool(i):
            return i

        held = []

        def run(cap):
            probe = Probe()
            rtrace.testing.reset()
            rtrace.configure(sinks=[probe], export_interval_s=0.02, max_spans_per_trajectory=4,
                             max_traces_per_step=cap)
            with rtrace.rollout_context(step=0, sample_index=0, rollout_n=0):
                for i in range(6):
                    tool(i)
                tally = rtrace.instrumentation._state.FRAME.get().tally
                if tally is not None:
                    held.append(len(tally.marks))
            assert rtrace.flush(30)
            rtrace.shutdown()
            return probe

        kept, tallied = run(None), run(0)
        (traj,) = kept.trajectories
        (summary,) = tallied.summaries
        assert held == [3] and len(traj.spans) == 4
        assert fields(summary) == fields(summarize(traj))
        assert summary.dropped_spans == 3 and summary.tool_calls == 3

    def test_the_queue_of_tallies_is_bounded_and_counted(self):
        """max_queue_size=5 and 8 rollouts recorded as summaries only before the worker runs: 5
        counted, 3 dropped and counted (summaries_dropped_queue), in no metric."""

        @rtrace.traced_tool
        def tool(i):
            return i

        probe = Probe()
        rtrace.configure(sinks=[probe], export_interval_s=60, max_queue_size=5, max_traces_per_step=0)
        assert rtrace.flush(30)  # the worker is back waiting for its next round
        with _setup._pipeline._cond:  # ... and stays there (the hot path's notify re-enters this RLock)
            for i in range(8):
                with rtrace.rollout_context(step=0, sample_index=i, rollout_n=0):
                    tool(i)
        assert rtrace.flush(30)
        stats = rtrace.stats()
        assert stats["summaries_dropped_queue"] == 3 and stats["rollouts_summarized"] == 5
        assert len(probe.summaries) == 5
        (metrics,) = probe.metrics
        assert metrics.values["rollout/trajectories"] == 5


# ----------------------------------------------------------------------------- the dataset
def dataset_rows(path) -> tuple[list[dict], set[str]]:
    """The run's trajectories rows, and the trace ids the spans table holds."""
    run = rtrace.open_run(path)
    cur = run.sql("SELECT trace_id, step, sample_index, rollout_n, recorded, kept, priority, num_spans, status, "
                  "num_turns, in_sample FROM trajectories")
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur.fetchall()]
    spans = {r[0] for r in run.sql("SELECT DISTINCT trace_id FROM spans").fetchall()}
    return rows, spans


class TestDataset:
    @pytest.mark.parametrize("tail", [False, True], ids=["cap_only", "tail_keeping"])
    def test_a_row_per_rollout_recorded_only_for_the_kept(self, tmp_path, tail):
        """A capped run with summaries: one row per rollout; `recorded` true exactly for the kept
        ones, which alone have spans; `priority` set when the run chooses its sample by rank at
        the end (tail keeping), NULL when it decided as rollouts started (a cap alone)."""
        settings = {"keep_errors": 1} if tail else {}
        probe = traced_run(exporter="parquet", parquet_path=str(tmp_path), experiment="run-1", max_traces_per_step=2,
                           **settings)
        rows, spans = dataset_rows(tmp_path / "run-1")
        assert len(rows) == len({r["trace_id"] for r in rows}) == 28
        assert sorted((r["step"], r["sample_index"], r["rollout_n"]) for r in rows) == sorted(
            (s, p, r) for s in range(2) for p in range(7) for r in range(2))
        kept = {t.trace_id for t in probe.trajectories}
        assert len(kept) == (2 + 1) * 2 if tail else 2 * 2
        assert {r["trace_id"] for r in rows if r["recorded"]} == kept == spans
        assert all(bool(r["kept"]) == r["recorded"] for r in rows)
        assert all(r["num_spans"] == 0 for r in rows if not r["recorded"])
        assert all(r["in_sample"] for r in rows)  # every row counted by the step metrics
        if tail:
            assert all(r["priority"] is not None for r in rows)
        else:
            assert all(r["priority"] is None for r in rows)
        # the rows' counts are the summaries' (turns, status) for the summarized ones too
        by_id = {s.trace_id: s for s in probe.summaries}
        for r in rows:
            if not r["recorded"]:
                assert (r["num_turns"], r["status"]) == (by_id[r["trace_id"]].turns, by_id[r["trace_id"]].status)


# ----------------------------------------------------------------------------- collector mode
def collector_run(tmp_path, rate: float, prompts: int = 7, env: dict | None = None,
                  **settings) -> tuple[Probe, dict, dict]:
    """A collector in this process (the probe and a dataset as sinks) and one spawned worker
    configured by ``collector.env`` (and ``env``) and RTRACE_PRE_SAMPLE_RATE=``rate``, running
    the agent: (probe, the collector's stats, the worker's stats)."""
    rtrace.testing.reset()
    probe = Probe()
    path = tmp_path / f"rate-{rate}-{len(list(tmp_path.iterdir()))}"
    c = rtrace.start_collector(sinks=[probe], exporter="parquet", parquet_path=str(path), experiment="run",
                               settle_s=0.2, await_annotations="advantage", annotation_timeout_s=60, **settings)
    try:
        out = SPAWN.Queue()
        worker_env = {**c.env, "RTRACE_PRE_SAMPLE_RATE": repr(rate), **(env or {})}
        proc = SPAWN.Process(target=agent.worker, args=(worker_env, 2, prompts, 2, out))
        proc.start()
        ok, worker_stats = out.get(timeout=120)
        proc.join(60)
        assert ok and proc.exitcode == 0
        assert c.flush(60)
        stats = c.stats()
    finally:
        c.stop()
    probe.path = path / "run"  # type: ignore[attr-defined]
    return probe, stats, worker_stats


@pytest.mark.integration
class TestCollector:
    def test_the_metrics_do_not_depend_on_the_pre_sample_rate(self, tmp_path):
        """A worker recording 30% of its rollouts in full (the rest as summaries) and one recording
        all: the collector's step metrics are equal (all but timing exactly), it counted every
        rollout once, and its dataset has a row per rollout, each with its priority."""
        full, full_stats, full_worker = collector_run(tmp_path, 1.0, max_traces_per_step=2)
        part, part_stats, part_worker = collector_run(tmp_path, 0.3, max_traces_per_step=2)
        assert full_worker.get("rollouts_summarized", 0) == 0
        assert full_stats.get("collector_summaries_received", 0) == 0
        summarized = part_worker["rollouts_summarized"]
        promoted = part_worker.get("summaries_promoted", 0)  # (failed ones sent in full after all)
        assert summarized + promoted == part_worker["trajectories_sampled_out"] and 0 < summarized < 28
        assert part_stats["collector_summaries_received"] == summarized
        for probe in (full, part):
            assert Counter(t.step for t in probe.trajectories) == {0: 2, 1: 2}
            every = [summarize(t) for t in probe.trajectories] + probe.summaries
            assert sorted(key(s) for s in every) == sorted((False, st, p, r) for st in range(2) for p in range(7)
                                                           for r in range(2))
            rows, spans = dataset_rows(probe.path)
            assert len(rows) == 28 and all(r["priority"] is not None for r in rows)
            assert {r["trace_id"] for r in rows if r["recorded"]} == spans == {t.trace_id for t in probe.trajectories}
        assert {v["rollout/trajectories"] for v in by_step(part.metrics).values()} == {14.0}
        assert_same_metrics(by_step(part.metrics), by_step(full.metrics), timing=False)
        # each rollout's summary is the same whether its worker recorded it in full or not
        full_of = {key(s): s for s in [summarize(t) for t in full.trajectories] + full.summaries}
        part_of = {key(s): s for s in [summarize(t) for t in part.trajectories] + part.summaries}
        for k, s in part_of.items():
            assert fields(s) == fields(full_of[k]), k


# ----------------------------------------------------------------------------- promotion
def tree(traj) -> list[tuple]:
    """A trajectory's spans as the collector wrote them: name, kind, parent's name, status, error,
    attributes (not the job id: each run its own), captured input and output, token ids (not ids,
    times or exception events)."""
    names = {s.span_id: s.name for s in traj.spans}
    return [(s.name, s.kind, names.get(s.parent_id), s.status, s.error,
             {k: v for k, v in s.attributes.items() if k != "rtrace.job_id"}, s.input, s.output, s.prompt_ids,
             s.response_ids)
            for s in traj.spans]


@pytest.mark.integration
class TestPromotion:
    def test_a_failed_rollout_a_worker_summarized_is_written_in_full(self, tmp_path):
        """Pre-sample rate 0 (every rollout tallied): the rollouts whose root failed or whose
        generation stopped at `length` are sent in full after all (counted), and the collector's
        tail (keep_errors=1) keeps one per step, 'error', with the spans, attributes, values and
        nesting the same rollout has recorded in full; each rollout is counted once."""
        settings = {"max_traces_per_step": 0, "keep_errors": 1}
        promoted, promoted_stats, worker_stats = collector_run(tmp_path, 0.0, prompts=4, **settings)
        recorded, _, _ = collector_run(tmp_path, 1.0, prompts=4, **settings)
        # truncated (p 2) and root_raises (p 3), 2 rollouts each, 2 steps: 8 of 16 sent in full
        assert worker_stats["summaries_promoted"] == 8 and worker_stats["rollouts_summarized"] == 8
        assert "summaries_promotion_skipped" not in worker_stats
        assert promoted_stats["collector_summaries_received"] == 8
        assert [t.kept for t in promoted.trajectories] == [["error"], ["error"]]
        expected = {key(t): t for t in recorded.trajectories}
        assert {key(t) for t in promoted.trajectories} == expected.keys()
        for t in promoted.trajectories:
            # its root says it was promoted (the collector's sample never takes it): the rest as recorded
            assert t.root.attributes.pop("rtrace.promoted") is True
            assert tree(t) == tree(expected[key(t)])
            assert [s[2] for s in tree(t)][:3] == [None, "rollout", "agent_loop"]  # nested as recorded
            assert t.status == expected[key(t)].status and t.reward == expected[key(t)].reward
        every = [summarize(t) for t in promoted.trajectories] + promoted.summaries
        assert sorted(key(s) for s in every) == sorted((False, st, p, r) for st in range(2) for p in range(4)
                                                       for r in range(2))
        assert_same_metrics(by_step(promoted.metrics), by_step(recorded.metrics), timing=False)

    def test_promotion_is_bounded_per_step(self, tmp_path):
        """RTRACE_PROMOTE_PER_STEP=1: one rollout per step sent in full, the others summarized
        and counted (summaries_promotion_skipped)."""
        _, stats, worker_stats = collector_run(tmp_path, 0.0, prompts=4, env={"RTRACE_PROMOTE_PER_STEP": "1"},
                                               max_traces_per_step=0, keep_errors=1)
        assert worker_stats["summaries_promoted"] == 2 and worker_stats["summaries_promotion_skipped"] == 6
        assert stats["collector_summaries_received"] == worker_stats["rollouts_summarized"] == 14


# ----------------------------------------------------------------------------- the wire
class TestWire:
    def test_to_wire_has_every_field_and_reads_back(self):
        """to_wire() (written out for speed) names every slot; from_wire() reads it back, a
        NaN reward included."""
        s = RolloutSummary("ab" * 16, "rollout", step=3, sample_index=1, rollout_n=0, validate=True, group_id="g",
                           reward=float("nan"), outcome={"correct": True}, annotations={"advantage": 0.5},
                           status="error", error="ValueError: x", turns=2, tool_calls=1, tokens_in=5, tokens_out=7,
                           finish_reasons={"stop": 2}, finish_reason="stop", start_ns=1, end_ns=9,
                           generation_ms=0.5, tool_ms=0.25, health=[{"check": "generation", "detail": "d"}],
                           kept=["error"], priority=0.25, dropped_spans=1)
        wire = s.to_wire()
        assert list(wire) == list(RolloutSummary.__slots__)
        from rtrace.summary import _WIRE_RULES

        assert [rule[0] for rule in _WIRE_RULES] == list(RolloutSummary.__slots__)[1:]  # every field checked
        back = RolloutSummary.from_wire(wire)
        assert math.isnan(back.reward)
        assert {k: getattr(back, k) for k in RolloutSummary.__slots__ if k != "reward"} == {
            k: getattr(s, k) for k in RolloutSummary.__slots__ if k != "reward"}

    BAD = [("health", 5), ("health", [{"check": 1}]), ("health", ["x"]), ("kept", ["sampled", 2]), ("name", 7),
           ("status", ["error"]), ("error", {"a": 1}), ("generation_ms", "fast"), ("tool_ms", True),
           ("finish_reasons", {"stop": "2"}), ("finish_reasons", {"stop": True}), ("validate", "yes"),
           ("partial", 1), ("group_id", [1, 2]), ("experiment", {"x": 1}), ("priority", "low"),
           ("finish_reason", 3), ("extra", [1]), ("turns", 1.5), ("step", True), ("recorded", "no")]

    @pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
    def test_from_wire_refuses_a_field_of_the_wrong_type(self, field, value):
        wire = RolloutSummary("ab" * 16, step=1, sample_index=0).to_wire()
        wire[field] = value
        with pytest.raises(ValueError, match=field):
            RolloutSummary.from_wire(wire)

    def test_the_collector_refuses_a_bad_summary_alone(self, collector, tmp_path):
        """A worker's summaries, some of the wrong shape, in one span: those are refused and
        counted (collector_refused.summary), the others counted in the metrics and the sinks
        (a bad one used to reach the step metrics and raise there, losing the worker's round)."""
        from rtrace.pipeline.stream import SUMMARIES_ATTR, summaries_shells
        from tests.test_collector_security import request_of, send_raw

        probe = Probe()
        c = collector(sinks=[probe])
        good = [RolloutSummary(f"{i + 1:032x}", step=1, sample_index=i, rollout_n=0, reward=1.0, turns=1,
                               start_ns=1, end_ns=2, health=[]).to_wire() for i in range(3)]
        bad = []
        for i, (field, value) in enumerate(self.BAD):
            wire = RolloutSummary(f"{100 + i:032x}", step=1, sample_index=10 + i, rollout_n=0).to_wire()
            wire[field] = value
            bad.append(wire)
        import grpc

        (shell,) = summaries_shells(good[:1])  # one span that carries them all
        shell.spans[0].attributes[SUMMARIES_ATTR] = good[:1] + bad + good[1:]
        assert send_raw(c.endpoint, request_of(shell)) == grpc.StatusCode.OK
        assert c.flush(30)
        assert c.stats()["collector_refused.summary"] == len(self.BAD)
        assert sorted(s.sample_index for s in probe.summaries) == [0, 1, 2]
        (metrics,) = probe.metrics
        assert metrics.values["rollout/trajectories"] == 3
