"""The open-trajectory table: one owner, one lock, a declared interface.

Every trajectory that is being recorded has one :class:`~rtrace.pipeline.records.TrajectoryState`
in the registry, keyed by its trace id, from the moment its root starts (in one process)
or its first span arrives (in the collector) until the worker hands it to the sinks.
It is in one of two tables:

* **open** (running): its root has not arrived. Bounded by ``max_open_trajectories``
  (and, in the collector, ``RTRACE_COLLECTOR_MAX_HELD_BYTES``): what the hot path's
  ``register`` and the collector's admission and eviction count.
* **waiting**: its root arrived, and it waits for awaited annotations or the
  collector's ``settle_s`` (:meth:`TrajectoryRegistry.hold`). Bounded apart
  (``max_waiting_trajectories``, ``RTRACE_COLLECTOR_MAX_WAITING_BYTES``): a full
  waiting table writes its oldest now, complete but without what it waited for
  (``trajectories_written_early``). Finished trajectories that wait never take a running
  one's room, and eviction never sees them (before, they did both: waiting for an
  advantage, they filled the open table, and the collector's push-back evicted
  rollouts still running, written partial).

Both are found by ``lookup``, so a span of a waiting trajectory (another process's,
within ``settle_s``) still joins it. Three parties use the registry, each through the
methods of :class:`Registry` only:

* the hot path registers a trajectory when its root span starts (``register``) and the
  span processor asks whether an ended span is ours (``lookup``: a dict read or two, safe
  without the lock under the GIL);
* ``rtrace.extract`` moves a segment unit's root to the segment still open
  (``set_root``), and the worker decides whether an arriving span is the root
  (``arrive``). Both run under the lock, so a root moved by one thread is never
  missed by the other;
* the worker moves finished trajectories that wait to the waiting table (``hold``),
  removes finished trajectories (``remove``) and expires orphans (``expire``).

Nobody else touches the table.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Protocol

from .. import _stats
from .records import TrajectoryState

__all__ = ["Registry", "TrajectoryRegistry"]


class Registry(Protocol):
    """What the hot path and propagation may do with the open trajectories."""

    #: spans kept per trajectory (the hot path stops storing call records beyond it)
    max_spans: int

    def register(self, state: TrajectoryState) -> bool:
        """Add a new trajectory; False (counted) when over the cap or stopping."""

    def lookup(self, trace_id: int) -> TrajectoryState | None:
        """The trajectory of ``trace_id`` still being recorded (open or waiting), if any."""

    def set_root(self, state: TrajectoryState, span_id: int) -> bool:
        """Make ``span_id`` the root of ``state``; False when ``state`` is no longer open
        or its root was already seen by the worker."""


class TrajectoryRegistry:
    """The one implementation of :class:`Registry`, plus the worker's side."""

    def __init__(self, max_open: int, max_spans: int, max_waiting: int = 20_000,
                 max_waiting_bytes: int = 1 << 62, max_waiting_summaries: int = 100_000) -> None:
        self.max_open = max_open
        self.max_spans = max_spans
        self._lock = threading.Lock()
        #: the running trajectories (root not arrived)
        self._open: dict[int, TrajectoryState] = {}
        self._closed = False
        #: collector: wire bytes of the spans the open (running) trajectories hold
        self.held_bytes = 0
        #: trajectories whose root arrived and that wait (awaited annotations, settle_s),
        #: oldest first (in the order they began to wait); at most ``max_waiting``, and
        #: ``max_waiting_bytes`` wire bytes (collector)
        self._held: OrderedDict[int, TrajectoryState] = OrderedDict()
        self.max_waiting = max_waiting
        self.max_waiting_bytes = max_waiting_bytes
        #: collector: wire bytes of the spans the waiting trajectories hold
        self.waiting_bytes = 0
        #: rollouts recorded as summaries only that wait (a state and a summary each, no spans:
        #: never looked up by a span), oldest first, at most ``max_waiting_summaries``; a step of
        #: 10^5 summarized rollouts waiting for the trainer's advantages must not push out the
        #: trajectories recorded in full, nor they it
        self._light: OrderedDict[int, TrajectoryState] = OrderedDict()
        self.max_waiting_summaries = max_waiting_summaries
        #: collector (:meth:`remember_finished`): trace ids that left the table, oldest
        #: first, at most this many (0: not kept, as in one process, where a span of an
        #: unknown trace is never opened as a new trajectory)
        self.finished_bound = 0
        self._finished: OrderedDict[int, None] = OrderedDict()
        #: collector: the open trajectories (their root not arrived), least recently active
        #: first (:meth:`touch` moves one to the end): eviction takes them from the front,
        #: O(1) each, instead of sorting the table for every one
        self._running: OrderedDict[int, TrajectoryState] = OrderedDict()

    # ------------------------------------------------------------------ hot path
    def register(self, state: TrajectoryState) -> bool:
        if self._add(state):
            return True
        _stats.incr("trajectories_dropped_open_limit")
        _stats.warn_once("open-limit", "rtrace: more than %d open trajectories; new ones are not traced",
                         self.max_open)
        return False

    def _add(self, state: TrajectoryState) -> bool:
        with self._lock:
            if not self._closed and len(self._open) < self.max_open:
                self._open[state.trace_id] = state
                return True
        return False

    def lookup(self, trace_id: int) -> TrajectoryState | None:
        # Two dict reads at most, safe without the lock under the GIL: hold() puts a state
        # in the waiting table before it takes it out of the open one.
        state = self._open.get(trace_id)
        return state if state is not None else self._held.get(trace_id)

    def set_root(self, state: TrajectoryState, span_id: int) -> bool:
        with self._lock:
            if self._open.get(state.trace_id) is not state or state.root_at is not None:
                return False
            state.root_span_id = span_id
            return True

    def mark_root_lost(self, trace_id: int, span_id: int) -> None:
        """The root span of ``trace_id`` was dropped before the worker saw it: the
        trajectory is finished as partial in the worker's next round."""
        with self._lock:
            state = self._open.get(trace_id)
            if state is not None and state.root_span_id == span_id:
                state.root_lost = True

    # ------------------------------------------------------------------ worker side
    def open_or_get(self, trace_id: int, factory: Callable[[], TrajectoryState]) -> TrajectoryState | None:
        """The open trajectory of ``trace_id``, opening it with ``factory()`` when new
        (the collector: the first span of a trace opens it). None over the cap (not
        counted: the collector counts each trajectory it loses once, not each span)."""
        state = self._open.get(trace_id)
        if state is not None:
            return state
        state = factory()
        if not self._add(state):
            return None
        with self._lock:
            if state.root_at is None and self._open.get(trace_id) is state:
                self._running[trace_id] = state
        return state

    def arrive(self, trace_id: int, span_id: int) -> tuple[TrajectoryState | None, bool]:
        """The state a span of ``trace_id`` belongs to, and whether it is the root (then
        ``state.root_at`` is set)."""
        state = self._open.get(trace_id)
        if state is None:
            # waiting (its root arrived: a span that ends after it, or another process's
            # within settle_s, joins it), or gone (None: the span is late)
            return self._held.get(trace_id), False
        if state.root_span_id != span_id:
            # Not its root as of this read, which is one step under the GIL: a set_root that
            # moves the root here afterwards finds it as it would after the locked check
            # below. Only a root's arrival acts (root_at), so only it takes the lock.
            return state, False
        with self._lock:
            state = self._open.get(trace_id)
            if state is None:
                return None, False
            is_root = state.root_span_id == span_id and state.root_at is None
            if is_root:
                state.root_at = time.monotonic()
            return state, is_root

    def claim_root(self, state: TrajectoryState, span_id: int) -> bool:
        """Collector: ``span_id`` says it is the root of ``state``; True if it is the first."""
        with self._lock:
            if state.root_at is not None:
                return False
            state.root_span_id = span_id
            state.root_at = time.monotonic()
            self._running.pop(state.trace_id, None)  # finished: never evicted
            return True

    def touch(self, state: TrajectoryState, nbytes: int) -> None:
        """Collector: a span of ``nbytes`` arrived for ``state`` (activity and bytes held)."""
        with self._lock:
            state.touched = time.monotonic()
            state.held_bytes += nbytes
            if self._open.get(state.trace_id) is state:
                self.held_bytes += nbytes
                if state.trace_id in self._running:
                    self._running.move_to_end(state.trace_id)  # now the most recently active
            elif self._held.get(state.trace_id) is state:
                self.waiting_bytes += nbytes  # the bound is kept at the worker's next hold()

    def remove(self, state: TrajectoryState) -> None:
        """Forget a finished trajectory: spans of its trace that arrive later are late."""
        self.remove_all((state,))

    def remove_all(self, states: Iterable[TrajectoryState]) -> None:
        """:meth:`remove` for each of ``states``, under one hold of the lock."""
        with self._lock:
            for state in states:
                if self._open.get(state.trace_id) is state:
                    del self._open[state.trace_id]
                    self._running.pop(state.trace_id, None)
                    self.held_bytes -= state.held_bytes
                    self._left(state.trace_id)
                elif self._held.get(state.trace_id) is state:
                    del self._held[state.trace_id]
                    self.waiting_bytes -= state.held_bytes
                    self._left(state.trace_id)
                elif self._light.get(state.trace_id) is state:
                    del self._light[state.trace_id]

    def hold(self, states: Iterable[TrajectoryState]) -> list[TrajectoryState]:
        """Worker thread: ``states`` (root arrived) wait for awaited annotations or
        ``settle_s``: each leaves the open table for the waiting one (a state built without
        spans, ``log_rollout_batch``'s, is added), freeing its room and bytes for running
        trajectories. Then the waiting table is brought within ``max_waiting`` and
        ``max_waiting_bytes`` (bytes late spans added count too): its oldest leave it and
        are returned, to be written now, complete but without what they waited for
        (counted: ``trajectories_written_early``). Never a running trajectory."""
        early: list[TrajectoryState] = []
        with self._lock:
            held, light = self._held, self._light
            for state in states:
                tid = state.trace_id
                if state.summary_only:
                    light[tid] = state
                    continue
                if held.get(tid) is state:
                    continue
                held[tid] = state  # first: a lookup without the lock finds it in one table or the other
                self.waiting_bytes += state.held_bytes
                if self._open.get(tid) is state:
                    del self._open[tid]
                    self._running.pop(tid, None)
                    self.held_bytes -= state.held_bytes
            while held and (len(held) > self.max_waiting or self.waiting_bytes > self.max_waiting_bytes):
                _, state = held.popitem(last=False)
                self.waiting_bytes -= state.held_bytes
                self._left(state.trace_id)
                early.append(state)
            while len(light) > self.max_waiting_summaries:
                early.append(light.popitem(last=False)[1])
        if early:
            _stats.incr("trajectories_written_early", len(early))
            _stats.warn_once("waiting-limit", "rtrace: more than %d finished trajectories (or %d bytes) wait for "
                             "annotations or their settle time; the oldest are written without waiting longer "
                             "(counted: trajectories_written_early)", self.max_waiting, self.max_waiting_bytes)
        return early

    def waiting(self) -> list[TrajectoryState]:
        """Worker thread (the waiting table's only writer): the waiting trajectories, oldest first."""
        return list(self._held.values()) + list(self._light.values())

    def num_waiting(self) -> int:
        return len(self._held) + len(self._light)

    def is_waiting(self, state: TrajectoryState) -> bool:
        table = self._light if state.summary_only else self._held
        return table.get(state.trace_id) is state

    def waiting_since(self, cutoff: float) -> list[TrajectoryState]:
        """Worker thread: the waiting trajectories, from the oldest, whose root arrived at
        ``cutoff`` (``time.monotonic()``) or before: those an annotation timeout may release."""
        out = []
        for table in (self._held, self._light):
            for state in table.values():
                if state.root_at is not None and state.root_at > cutoff:
                    break
                out.append(state)
        return out

    def remember_finished(self, bound: int) -> None:
        """Collector: keep the last ``bound`` trace ids that left the table (finished,
        evicted or expired), so that a span of one of them that comes later is told
        apart from the first span of a new trajectory (:meth:`was_finished`)."""
        self.finished_bound = bound

    def was_finished(self, trace_id: int) -> bool:
        """Did ``trace_id`` leave the table (among the last ``finished_bound``)? Worker thread."""
        return trace_id in self._finished

    def _left(self, trace_id: int) -> None:
        """Under the lock: ``trace_id`` left the table."""
        if self.finished_bound:
            finished = self._finished
            finished[trace_id] = None
            if len(finished) > self.finished_bound:
                finished.popitem(last=False)

    def evict(self, max_open: int, max_bytes: int) -> list[TrajectoryState]:
        """Collector under pressure: remove the least recently active trajectories still
        waiting for their root until at most ``max_open`` are open and at most
        ``max_bytes`` held; returned marked partial (written with what arrived). O(1) per
        trajectory evicted: they are kept in the order of their last activity."""
        evicted = []
        with self._lock:
            running = self._running
            while running and (len(self._open) > max_open or self.held_bytes > max_bytes):
                _, state = running.popitem(last=False)
                if self._open.get(state.trace_id) is not state:  # pragma: no cover - kept in step
                    continue
                del self._open[state.trace_id]
                self.held_bytes -= state.held_bytes
                self._left(state.trace_id)
                state.partial = True
                evicted.append(state)
        if evicted:
            _stats.incr("trajectories_evicted", len(evicted))
            _stats.incr("trajectories_partial", len(evicted))
        return evicted

    def expire(self, now: float, timeout_s: float, force: bool = False) -> list[TrajectoryState]:
        """Remove and return trajectories whose root was lost, or that waited for their
        root longer than ``timeout_s`` (all of them with ``force``), marked partial."""
        with self._lock:
            expired = [st for st in self._open.values()
                       if st.root_at is None and (force or st.root_lost or now - st.created > timeout_s)]
            for state in expired:
                del self._open[state.trace_id]
                self._running.pop(state.trace_id, None)
                self.held_bytes -= state.held_bytes
                self._left(state.trace_id)
                state.partial = True
        if expired:
            _stats.incr("trajectories_partial", len(expired))
        return expired

    def close(self) -> None:
        """Refuse new trajectories (shutdown)."""
        with self._lock:
            self._closed = True

    def __len__(self) -> int:
        """The open (running) trajectories: the waiting ones are counted apart (:meth:`num_waiting`)."""
        return len(self._open)
