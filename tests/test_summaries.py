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
from rtrace import _setup
from rtrace.pipeline.metrics import StepStats, step_metrics
from rtrace.summary import RolloutSummary, summarize
from tests import summary_agent as agent

SPAWN = mp.get_context("spawn")

#: step metrics that measure time: equal only in distribution between two runs
TIMING = ("latency_ms_", "time_generation_frac", "time_tool_frac", "time_other_frac")
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
