"""Fan-out to the sinks: one thread and one bounded queue of batches per sink.

A slow sink drops its own batches (counted) without slowing the others or the traced
program. Sinks run with OTel instrumentation suppressed, so a backend's own HTTP calls
are not traced into the trajectories. Shutdown is bounded per sink: each sink gets its
own deadline, a sink that hangs is abandoned (its thread is a daemon) and everything
still queued for it, or inside its export call, is counted as
``sink.<name>.abandoned_trajectories``; the next sink is shut down all the same. So
for every sink, the trajectories handed to it are ``exported + failed_trajectories +
dropped_trajectories + abandoned_trajectories``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Sequence

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value

from .. import _stats
from ..exporters.base import Sink
from ..trajectory import StepMetrics, Trajectory

__all__ = ["SinkWorker", "Fanout"]


class SinkWorker:
    """One sink behind its own thread and bounded queue of batches."""

    def __init__(self, sink: Sink, queue_size: int, timeout_s: float) -> None:
        self.sink = sink
        self.name = getattr(sink, "name", type(sink).__name__)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.timeout_s = timeout_s
        #: set when a flush marker found a batch that failed since the previous marker
        self._failed_since_marker = False
        #: the batch inside export() now (counted as abandoned if shutdown gives up on it)
        self._in_flight: list[Trajectory] | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"rtrace-sink-{self.name}", daemon=True)
        self.thread.start()

    def _count(self, what: str, n: int) -> None:
        _stats.incr(f"sink.{self.name}.{what}", n)

    def submit(self, batch: list[Trajectory]) -> None:
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            with self._lock:
                self._failed_since_marker = True  # the next flush() cannot say "all written"
            self._count("dropped_batches", 1)
            self._count("dropped_trajectories", len(batch))
            _stats.warn_once(f"sink-full-{self.name}",
                             "rtrace sink %r cannot keep up; batches are dropped", self.name)

    def marker(self, deadline: float) -> "_Marker | None":
        """Queue a flush marker (waiting for room until ``deadline``); its event is set once
        everything queued before it is exported and the sink flushed."""
        marker = _Marker()
        try:
            self.queue.put(marker, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return None
        return marker

    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                if isinstance(item, _Metrics):
                    if not self._call("export_step_metrics", self.sink.export_step_metrics, list(item)):
                        self._count("failed_step_metrics", len(item))
                    continue
                if isinstance(item, _Marker):
                    flushed = self._call("flush", self.sink.flush, self.timeout_s)
                    with self._lock:
                        item.ok = flushed and not self._failed_since_marker
                        self._failed_since_marker = False
                    item.set()
                    continue
                with self._lock:
                    if self._abandoned:  # counted as abandoned already: a late thread writes nothing
                        continue
                    self._in_flight = item
                ok = self._call("export", self.sink.export, item)
                with self._lock:
                    self._in_flight = None
                    if self._abandoned:  # shutdown gave up on this batch and counted it
                        continue
                if ok:
                    self._count("exported", len(item))
                else:
                    self._failed_since_marker = True
                    self._count("failed_batches", 1)
                    self._count("failed_trajectories", len(item))
        finally:
            detach(token)

    def _call(self, what: str, fn: Any, *args: Any) -> bool:
        try:
            result = fn(*args)
        except Exception:
            _stats.warn_once(f"sink-{what}-{self.name}", "rtrace sink %r failed in %s", self.name, what,
                             exc_info=True)
            return False
        # A sink's flush may say it could not make everything durable by returning False.
        return result is not False

    def stop(self, timeout_s: float) -> None:
        """Stop within ``timeout_s``: export what is queued, flush and shut the sink down
        (in its own thread); whatever is left behind is counted as abandoned."""
        deadline = time.monotonic() + timeout_s
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self._abandon()
            return
        done = threading.Thread(target=self._call, args=("shutdown", self.sink.shutdown),
                                name=f"rtrace-sink-{self.name}-shutdown", daemon=True)
        done.start()
        done.join(max(0.0, deadline - time.monotonic()))
        if done.is_alive():
            self._count("shutdown_timeouts", 1)
            _stats.warn_once(f"sink-hang-{self.name}", "rtrace sink %r did not shut down in time", self.name)

    def _abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            lost = len(self._in_flight) if self._in_flight is not None else 0
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list) and not isinstance(item, _Metrics):
                lost += len(item)
            elif isinstance(item, _Marker):
                item.set()
        self._count("shutdown_timeouts", 1)
        if lost:
            self._count("abandoned_trajectories", lost)
        _stats.warn_once(f"sink-hang-{self.name}", "rtrace sink %r did not finish in time; %d queued "
                         "or in-flight trajectories abandoned", self.name, lost)


class _Metrics(list):
    """A batch of StepMetrics in a sink's queue."""


class _Marker(threading.Event):
    """A flush marker; ``ok`` says whether everything before it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.ok = False


class Fanout:
    """Every sink's worker; batches go to all of them."""

    def __init__(self, sinks: Sequence[Sink], batch_size: int, queue_size: int, timeout_s: float) -> None:
        self.batch_size = batch_size
        self.workers = [SinkWorker(sink, queue_size, timeout_s) for sink in sinks]

    def submit(self, trajectories: list[Trajectory]) -> None:
        size = self.batch_size
        for i in range(0, len(trajectories), size):
            batch = trajectories[i:i + size]
            for worker in self.workers:
                worker.submit(batch)

    def submit_metrics(self, metrics: list[StepMetrics]) -> None:
        for worker in self.workers:
            try:
                worker.queue.put_nowait(_Metrics(metrics))
            except queue.Full:
                worker._count("dropped_step_metrics", len(metrics))

    def markers(self, deadline: float) -> list[_Marker | None]:
        return [w.marker(deadline) for w in self.workers]

    def stop(self, timeout_s: float) -> None:
        """Stop every sink, in parallel, each within ``timeout_s``: a hung sink is
        abandoned (counted) and never keeps the others from shutting down; the whole stop
        takes at most about ``timeout_s``."""
        stoppers = [threading.Thread(target=w.stop, args=(timeout_s,), name=f"rtrace-stop-{w.name}", daemon=True)
                    for w in self.workers]
        for t in stoppers:
            t.start()
        deadline = time.monotonic() + timeout_s + 1.0
        for t in stoppers:
            t.join(max(0.0, deadline - time.monotonic()))
