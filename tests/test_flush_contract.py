"""flush() returns only once every trajectory that finished before it was written."""

from __future__ import annotations

import rtrace
from rtrace.testing import MemorySink


def test_flush_right_after_a_rollout_exports_it():
    """The round that serves a flush exports roots that arrived in it (a regression of the
    collector's settle time: `now` was read before the roots arrived, so flush() returned
    True with the trajectory still open)."""
    sink = MemorySink()
    rtrace.configure(sinks=[sink], export_interval_s=60)  # only flush() drives the worker
    for i in range(20):
        with rtrace.rollout_context(step=0, sample_index=i):
            pass
        assert rtrace.flush(10)
        assert len(sink.trajectories) == i + 1
    assert rtrace.stats()["open_trajectories"] == 0
