"""`rtrace publish` (rtrace/publish.py) following a dataset: steps published once, when done;
rows that land for a published step afterwards counted, not published twice.

Real parts: a run's dataset written by rtrace's parquet sink in this process, read by the
publisher; its sink the JSONL sink (the trackio and MLflow sinks are the issue's end-to-end
test, tests/test_scale_out_job.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

import rtrace  # noqa: E402
from rtrace import _stats  # noqa: E402
from rtrace.config import load_settings  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402
from rtrace.publish import Publisher  # noqa: E402


def _write(step, rollouts):
    for i in rollouts:
        with rtrace.rollout_context(step=step, sample_index=i, rollout_n=0):
            rtrace.record_reward(float(i % 2))
    assert rtrace.flush(30)


def test_following_publishes_done_steps_once_and_counts_late_rows(tmp_path):
    """Polled as `rtrace publish` follows a run: a step is published once a later step exists (and
    its files did not change for the linger), each once; rows landing later for a published step
    are counted in publish.late_rows, and the next polls go on (before: the second poll raised on
    DuckDB's relation, which has no fetchone(), and no later step was ever published)."""
    rtrace.configure(exporter="parquet", parquet_path=str(tmp_path / "ds"), experiment="run-1", export_interval_s=0.02)
    _write(0, range(4))
    _write(1, range(3))
    path = str(tmp_path / "ds" / "run-1")
    publisher = Publisher(path, load_settings({"exporter": "jsonl", "jsonl_path": str(tmp_path / "out.jsonl"),
                                               "experiment": "run-1"}), linger_s=0.0)
    try:
        assert publisher.poll() == 1  # step 0: step 1 exists; step 1 is the newest, not done
        _write(0, range(4, 6))  # late rows of step 0
        _write(2, range(2))
        assert publisher.poll() == 1  # step 1 now
        assert publisher.poll(final=True) == 1  # step 2, at the end
        assert publisher.flush(30)
    finally:
        publisher.close()
    assert publisher.published == {(False, 0): 6, (False, 1): 3, (False, 2): 2}  # rows seen, the late ones too
    assert _stats.snapshot()["publish.late_rows"] == 2
    assert sorted((t.step, t.sample_index) for t in read_jsonl(tmp_path / "out.jsonl")) == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]


def test_published_step_metrics_have_the_fleet_s(tmp_path):
    """The fleet's step metrics (issue 41: crossed updates, time waiting, servers, the slowest
    server's share, staleness, in flight) that `rtrace publish` gives are those of the rollouts it
    reads (before: the worker, wait, versions' end and servers' columns were not read: wait 0,
    no crossed-update rate, no servers)."""
    from rtrace.dataset.layout import open_store
    from rtrace.dataset.writer import DatasetWriter
    from rtrace.pipeline.metrics import StepStats, step_metrics
    from rtrace.summary import summarize
    from tests.doubles import MetricsSink
    from tests.ui import fleet_run

    trajs, events = fleet_run.trajectories(60, seed=5, workers=2, slots=3, servers=2)
    assert any(t.crossed_update for t in trajs) and not all(t.crossed_update for t in trajs)
    folder = tmp_path / "run-f"
    writer = DatasetWriter(open_store(str(folder)), folder.name)
    writer.write(trajs)
    writer.write_events(events)
    writer.close()
    sink = MetricsSink()
    publisher = Publisher(str(folder), load_settings({"sinks": [sink], "experiment": "run-f"}), linger_s=0.0)
    try:
        assert publisher.poll(final=True) == 1
        assert publisher.flush(30)
    finally:
        publisher.close()
    (got,) = sink.metrics
    stats = StepStats()
    for t in trajs:
        stats.add(summarize(t))
    want = step_metrics(False, fleet_run.STEP, stats).values
    fleet = [k for k in want if any(part in k for part in (
        "crossed_update", "wait_ms", "servers", "slowest_server", "staleness", "inflight"))]
    assert {"rollout/crossed_update_rate", "rollout/wait_ms_mean", "rollout/servers",
            "rollout/slowest_server_share"} <= set(fleet)
    assert want["rollout/wait_ms_mean"] > 0 and want["rollout/servers"] == 2
    assert {k: got.values.get(k) for k in fleet} == pytest.approx({k: want[k] for k in fleet})
