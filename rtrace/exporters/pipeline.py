"""The trajectory pipeline: span processor, worker thread, one thread per sink.

::

    span.end() --on_end--> bounded deque --worker thread--> TrajectoryExporter --> sink queues
      (caller's thread:      (drops counted)    (every export_interval_s,      (one thread and one
       one dict lookup,                          or at flush)                   bounded queue per sink)
       one append)

rtrace owns its queue and threads instead of using the SDK's BatchSpanProcessor: that
one runs ``export()`` on the caller's thread at ``force_flush`` and hides its drops.
Here the traced program's thread only appends to a deque; assembling, converting,
decoding and writing all happen in rtrace's threads, also during ``flush()``.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Sequence

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from .. import _stats
from .._capture import TrajectoryState
from ..config import Settings
from ..trajectory import Trajectory
from .base import Sink
from .builder import TrajectoryBuilder

__all__ = ["TrajectoryExporter", "Pipeline"]


class TrajectoryExporter:
    """Assembles ended spans into trajectories (worker thread only).

    Spans are grouped by trace id under the :class:`TrajectoryState` the hot path
    registered when the trajectory started. The root span's arrival completes a
    trajectory (children end before their root). A trajectory whose root has not
    arrived after ``orphan_timeout_s`` is emitted as partial.
    """

    def __init__(self, settings: Settings, open_table: dict[int, TrajectoryState],
                 builder: TrajectoryBuilder) -> None:
        self.settings = settings
        self.open = open_table
        self.builder = builder

    def export(self, spans: Sequence[ReadableSpan]) -> list[TrajectoryState]:
        """Add ended spans; return the states of the trajectories they completed."""
        done: list[TrajectoryState] = []
        # the root arrives last and is always kept: children get one place less
        max_children = self.settings.max_spans_per_trajectory - 1
        for span in spans:
            ctx = span.context
            state = self.open.get(ctx.trace_id)
            if state is None:  # ended after its root, in the same batch
                _stats.incr("spans_late")
                continue
            is_root = ctx.span_id == state.root_span_id
            if len(state.spans) >= max_children and not is_root:
                state.dropped_spans += 1
                _stats.incr("spans_dropped_trajectory_limit")
                continue
            state.spans.append(span)
            if is_root:
                self._finish(state)
                done.append(state)
        return done

    def expire(self, now: float, force: bool = False) -> list[TrajectoryState]:
        """Pop trajectories open longer than the orphan timeout (all of them if ``force``)."""
        limit = self.settings.orphan_timeout_s
        expired = [st for st in list(self.open.values()) if force or now - st.created > limit]
        for state in expired:
            self._finish(state)
            state.partial = True
            _stats.incr("trajectories_partial")
        return expired

    def _finish(self, state: TrajectoryState) -> None:
        # Spans of this trace that end from now on are ignored by on_end (not ours any more).
        self.open.pop(state.trace_id, None)

    def build(self, states: list[TrajectoryState], prebuilt: Sequence[Trajectory] = ()) -> list[Trajectory]:
        """Turn finished states into Trajectory objects (conversion, token2text, messages);
        ``prebuilt`` trajectories join the same postprocessing."""
        return self.builder.build_many(states, prebuilt)


class _SinkWorker:
    """One sink behind its own thread and bounded queue of batches."""

    def __init__(self, sink: Sink, settings: Settings) -> None:
        self.sink = sink
        self.name = getattr(sink, "name", type(sink).__name__)
        self.queue: queue.Queue = queue.Queue(maxsize=settings.sink_queue_size)
        self.timeout_s = settings.sink_timeout_s
        self.thread = threading.Thread(target=self._run, name=f"rtrace-sink-{self.name}", daemon=True)
        self.thread.start()

    def submit(self, batch: list[Trajectory]) -> None:
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            _stats.incr(f"sink.{self.name}.dropped_batches")
            _stats.incr(f"sink.{self.name}.dropped_trajectories", len(batch))
            _stats.warn_once(f"sink-full-{self.name}",
                             "rtrace sink %r cannot keep up; batches are dropped", self.name)

    def marker(self, deadline: float) -> threading.Event | None:
        """Queue a flush marker (waiting for room until ``deadline``); its event is set once
        everything queued before it is exported and the sink flushed."""
        event = threading.Event()
        try:
            self.queue.put(event, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return None
        return event

    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    self._call("flush", self.sink.flush, self.timeout_s)
                    item.set()
                    continue
                if self._call("export", self.sink.export, item):
                    _stats.incr(f"sink.{self.name}.exported", len(item))
                else:
                    _stats.incr(f"sink.{self.name}.failed_batches")
                    _stats.incr(f"sink.{self.name}.failed_trajectories", len(item))
        finally:
            detach(token)

    def _call(self, what: str, fn: Any, *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception:
            _stats.warn_once(f"sink-{what}-{self.name}", "rtrace sink %r failed in %s", self.name, what,
                             exc_info=True)
            return False

    def stop(self, deadline: float) -> None:
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if not self.thread.is_alive():
            self._call("shutdown", self.sink.shutdown)


class Pipeline(SpanProcessor):
    """rtrace's span processor: collects spans of registered trajectories, exports them
    from a worker thread to every sink."""

    def __init__(self, settings: Settings, sinks: Sequence[Sink], builder: TrajectoryBuilder) -> None:
        self.settings = settings
        self.max_spans = settings.max_spans_per_trajectory
        self.open: dict[int, TrajectoryState] = {}
        self._max_open = settings.max_open_trajectories
        self._max_queue = settings.max_queue_size
        self._wake_at = max(1, min(2048, self._max_queue // 2))
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        #: trajectories built outside the span path (rtrace.log_rollout_batch)
        self._prebuilt: collections.deque[Trajectory] = collections.deque()
        self._cond = threading.Condition()
        self._flush_requests: list[tuple[threading.Event, list]] = []
        self._stopping = False
        self.exporter = TrajectoryExporter(settings, self.open, builder)
        self.sinks = [_SinkWorker(sink, settings) for sink in sinks]
        self._worker = threading.Thread(target=self._run, name="rtrace-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ hot path
    def register(self, state: TrajectoryState) -> bool:
        """Record a new trajectory (called when its root span starts)."""
        if len(self.open) >= self._max_open or self._stopping:
            _stats.incr("trajectories_dropped_open_limit")
            _stats.warn_once("open-limit", "rtrace: more than %d open trajectories; new ones are not traced",
                             self._max_open)
            return False
        self.open[state.trace_id] = state
        return True

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_id not in self.open:
            return  # not ours (or already finished: counted by the worker as late)
        q = self._queue
        if len(q) >= self._max_queue:
            _stats.incr("spans_dropped_queue")
            _stats.warn_once("queue-full", "rtrace span queue is full (%d); spans are dropped", self._max_queue)
            return
        q.append(span)
        if len(q) == self._wake_at:
            with self._cond:
                self._cond.notify()

    def submit_trajectories(self, trajectories: Sequence[Trajectory]) -> int:
        """Queue trajectories built without spans (already sampled); they get the same
        postprocessing (token2text, messages when empty) and go to the same sinks.

        Returns:
            How many were queued; the rest were dropped (queue full) and counted.
        """
        room = max(0, self._max_queue - len(self._prebuilt))
        if room < len(trajectories):
            _stats.incr("trajectories_dropped_queue", len(trajectories) - room)
        for traj in trajectories[:room]:
            self._prebuilt.append(traj)
        with self._cond:
            self._cond.notify()
        return min(room, len(trajectories))

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            last_expiry = time.monotonic()
            while True:
                with self._cond:
                    if not self._stopping and not self._flush_requests:
                        self._cond.wait(self.settings.export_interval_s)
                    requests, self._flush_requests = self._flush_requests, []
                    stopping = self._stopping
                now = time.monotonic()
                force = stopping
                expire = force or now - last_expiry > min(1.0, self.settings.orphan_timeout_s)
                self._process(now, expire, force)
                if expire:
                    last_expiry = now
                for done, markers in requests:
                    deadline = now + self.settings.sink_timeout_s
                    markers.extend(w.marker(deadline) for w in self.sinks)
                    done.set()
                if stopping:
                    return
        finally:
            detach(token)

    def _process(self, now: float, expire: bool, force: bool) -> None:
        q, pre = self._queue, self._prebuilt
        spans = [q.popleft() for _ in range(len(q))]
        prebuilt = [pre.popleft() for _ in range(len(pre))]
        try:
            states = self.exporter.export(spans) if spans else []
            if expire:
                states += self.exporter.expire(now, force)
            if not states and not prebuilt:
                return
            trajectories = self.exporter.build(states, prebuilt)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("worker", "rtrace worker failed to assemble trajectories", exc_info=True)
            return
        _stats.incr("trajectories_completed", len(trajectories))
        size = self.settings.max_export_batch_size
        for i in range(0, len(trajectories), size):
            batch = trajectories[i:i + size]
            for worker in self.sinks:
                worker.submit(batch)

    # ------------------------------------------------------------------ control
    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything that has ended and wait for every sink to write it.

        Returns:
            True if all sinks finished within the timeout.
        """
        deadline = time.monotonic() + timeout_millis / 1000.0
        if not self._worker.is_alive():
            return False
        done, markers = threading.Event(), []
        with self._cond:
            self._flush_requests.append((done, markers))
            self._cond.notify()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return False
        ok = True
        for event in markers:
            if event is None or not event.wait(max(0.0, deadline - time.monotonic())):
                ok = False
        return ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Emit what is open as partial trajectories, flush the sinks, stop the threads."""
        if self._stopping:
            return
        timeout_s = self.settings.sink_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self.sinks:
            worker.stop(deadline)
