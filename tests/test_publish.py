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
