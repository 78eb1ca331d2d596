"""Small stand-ins the tests share (not backends: those are real, see tests/backends.py)."""

from __future__ import annotations

import threading

import rtrace


class BlockingTokenizer:
    """A tokenizer whose ``batch_decode`` holds rtrace's worker thread inside token2text
    until ``release`` is set (``entered`` tells that it is held): the span queue then
    fills, deterministically."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timeout_s = timeout_s

    def batch_decode(self, ids, **kwargs):
        self.entered.set()
        self.release.wait(self.timeout_s)
        return ["x"] * len(ids)



class MetricsSink(rtrace.Sink):
    """A sink that keeps the step metrics the pipeline computes (``metrics``, in arrival order,
    thread-safe) and writes nothing else: having ``export_step_metrics``, it makes the pipeline
    compute them."""

    name = "metrics"

    def __init__(self) -> None:
        super().__init__(None)
        self._lock = threading.Lock()
        self.metrics: list = []

    def export(self, trajectories) -> None:
        pass

    def export_step_metrics(self, metrics) -> None:
        with self._lock:
            self.metrics.extend(metrics)
