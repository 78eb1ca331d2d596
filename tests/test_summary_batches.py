"""A sink that writes every rollout's summary (the dataset) gets them in large batches.

A collector hands its sinks each round's summaries (tens of rows); the parquet sink made a file
pair per step for each call. The sink's thread now holds them and calls ``export_summaries``
once it holds ``SUMMARIES_PER_EXPORT``, when the first has waited ``SUMMARIES_LINGER_S``, before
a flush and at shutdown; ``sink.<name>.exported_summaries`` counts them only once written
(exported means durable), and what it still holds when a shutdown gives up is counted
abandoned. These tests run the real fan-out with a real sink and, for the dataset, the
parquet sink read back through ``rtrace.open_run``.
"""

from __future__ import annotations

import threading
import time

import rtrace
import rtrace.testing
from rtrace.pipeline import fanout
from rtrace.pipeline.fanout import Fanout
from rtrace.summary import RolloutSummary


class Calls(rtrace.Sink):
    """Keeps each export_summaries call's rows; ``gate`` (when set) holds the calls until opened."""

    name = "calls"

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.calls: list[list[RolloutSummary]] = []
        self.gate = gate

    def export(self, trajectories):
        pass

    def export_summaries(self, summaries):
        if self.gate is not None:
            self.gate.wait()
        self.calls.append(list(summaries))


def summaries(n: int, start: int = 0) -> list[RolloutSummary]:
    return [RolloutSummary(f"{i + 1:032x}", step=i // 8, sample_index=i % 8, rollout_n=0) for i in range(start,
                                                                                                    start + n)]


def exported() -> int:
    return rtrace.stats().get("sink.calls.exported_summaries", 0)


def test_small_batches_are_written_together_at_a_flush():
    """50 batches of 4: nothing written (nor counted exported) before the flush; then one call
    with all 200, counted."""
    rtrace.testing.reset()
    sink = Calls()
    out = Fanout([sink], batch_size=256, queue_size=1024, timeout_s=10)
    try:
        for k in range(50):
            out.submit_summaries(summaries(4, 4 * k))
        time.sleep(0.2)
        assert sink.calls == [] and exported() == 0
        (marker,) = out.markers(time.monotonic() + 10)
        assert marker.wait(10) and marker.ok
        assert [len(c) for c in sink.calls] == [200]
        assert [s.trace_id for s in sink.calls[0]] == [s.trace_id for s in summaries(200)]
        assert exported() == 200
    finally:
        out.stop(10)


def test_held_summaries_are_written_when_full_or_old(monkeypatch):
    """SUMMARIES_PER_EXPORT=10: written in calls of 10 or more as they fill; the rest after
    SUMMARIES_LINGER_S without a flush."""
    monkeypatch.setattr(fanout, "SUMMARIES_PER_EXPORT", 10)
    monkeypatch.setattr(fanout, "SUMMARIES_LINGER_S", 0.3)
    rtrace.testing.reset()
    sink = Calls()
    out = Fanout([sink], batch_size=256, queue_size=1024, timeout_s=10)
    try:
        for k in range(7):
            out.submit_summaries(summaries(4, 4 * k))  # 28: calls of 12, 12, then 4 left
        deadline = time.monotonic() + 5
        while sum(map(len, sink.calls)) < 28 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [len(c) for c in sink.calls] == [12, 12, 4]
        assert exported() == 28
    finally:
        out.stop(10)


def test_what_a_shutdown_gives_up_on_is_counted_abandoned(monkeypatch):
    """A sink stuck in its first write: the summaries it holds behind it are counted
    abandoned at the shutdown's timeout, none exported; every one is counted once."""
    monkeypatch.setattr(fanout, "SUMMARIES_PER_EXPORT", 4)
    rtrace.testing.reset()
    gate = threading.Event()
    sink = Calls(gate)
    out = Fanout([sink], batch_size=256, queue_size=1024, timeout_s=0.5)
    out.submit_summaries(summaries(4))  # taken and written: the sink waits at the gate
    time.sleep(0.2)
    out.submit_summaries(summaries(2, 4))
    out.submit_summaries(summaries(1, 6))
    time.sleep(0.2)
    out.stop(0.5)
    gate.set()
    deadline = time.monotonic() + 5
    while exported() < 4 and time.monotonic() < deadline:  # the stuck write ends late
        time.sleep(0.05)
    stats = rtrace.stats()
    assert stats["sink.calls.abandoned_summaries"] == 3
    assert stats.get("sink.calls.exported_summaries", 0) == 4
    assert [len(c) for c in sink.calls] == [4]


def test_the_dataset_gets_a_file_pair_per_step_not_per_round(tmp_path):
    """A capped run of 10 steps x 8 rollouts (1 kept a step) written by the parquet sink, a
    worker round between any two rollouts: the 70 summarized rollouts' rows are written in one
    or two calls (a file pair per step each), not a pair per round; every rollout has its row."""
    rtrace.testing.reset()
    rtrace.configure(exporter="parquet", parquet_path=str(tmp_path), experiment="run", export_interval_s=0.01,
                     max_traces_per_step=1)

    @rtrace.traced_tool
    def tool(i):
        return i

    try:
        for step in range(10):
            for i in range(8):
                with rtrace.rollout_context(step=step, sample_index=i, rollout_n=0):
                    tool(i)
                    rtrace.record_reward(float(i))
                time.sleep(0.02)  # a worker round
        assert rtrace.flush(30)
        stats = rtrace.stats()
    finally:
        rtrace.shutdown()
    assert stats["sink.parquet.exported_summaries"] == 70 and stats["sink.parquet.exported"] == 10
    # the kept trajectories' pairs (a round each: 10), the summaries' (a pair per step and call: 10 or 20)
    batches = stats["sink.parquet.files_written"] // 2 - stats.get("sink.parquet.compactions", 0)
    assert batches <= 10 + 2 * 10, stats
    rows = rtrace.open_run(tmp_path / "run").sql("SELECT step, count(*) FROM trajectories GROUP BY step").fetchall()
    assert sorted(rows) == [(step, 8) for step in range(10)]
