"""Fan-out to the sinks: one thread and one bounded queue of batches per sink.

A slow sink loses trajectories (counted) without slowing the others or the traced
program, and it loses them evenly across steps: when its queue is full, a new batch is
first merged into the queued batches that have room, and if that is not enough the sink
samples fewer trajectories of every step (:meth:`SinkWorker._thin`), so a sink that
falls behind still shows every step, with failures and tail-kept trajectories kept
longest, rather than missing whole batches at random. (In the collector, whose senders
can be told to wait, and in a collector-mode worker, whose collector sink only routes and
encodes, the worker waits for room instead while the sink makes progress:
``Fanout(hold_back=True)``.) Sinks run with OTel
instrumentation suppressed, so a backend's own HTTP calls are not traced into the
trajectories. Shutdown is bounded per sink: each sink gets its
own deadline, a sink that hangs is abandoned (its thread is a daemon) and everything
still queued for it, or inside its export call, is counted as
``sink.<name>.abandoned_trajectories``; the next sink is shut down all the same. So
for every sink, the trajectories handed to it are ``exported + failed_trajectories +
dropped_trajectories + abandoned_trajectories``. A sink whose ``shutdown()`` alone ran out
of time, everything exported, may say that its data is complete and what was left undone
(``Sink.unfinished_shutdown``: the parquet sink's final merge); that is no shutdown timeout.

Stopping starts no thread: each sink's own thread exports what is queued, then runs the
sink's ``shutdown()`` and ends; the stopping thread only waits, with one deadline for all
sinks. ``shutdown()`` runs at interpreter exit (``atexit``), where Python 3.12+ refuses
to start threads (``RuntimeError: can't create new thread at interpreter shutdown``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value

from .. import _stats
from ..events import RunEvent
from ..exporters.base import PartialExport, Sink
from ..summary import RolloutSummary
from ..trajectory import StepMetrics, Trajectory

__all__ = ["SinkWorker", "Fanout"]


class SinkWorker:
    """One sink behind its own thread and bounded queue of batches."""

    def __init__(self, sink: Sink, queue_size: int, timeout_s: float, batch_size: int = 256) -> None:
        self.sink = sink
        self.batch_size = batch_size
        self.sample_when_behind = bool(getattr(sink, "sample_when_behind", True))
        self.name = getattr(sink, "name", type(sink).__name__)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.timeout_s = timeout_s
        #: set when a flush marker found a batch that failed since the previous marker
        self._failed_since_marker = False
        #: the batch inside export() now (counted as abandoned if shutdown gives up on it)
        self._in_flight: list[Trajectory] | None = None
        self._abandoned = False
        #: set by request_stop(): the thread ends once its queue is drained
        self._stop_requested = False
        #: the thread is in the sink's shutdown(): everything queued was exported or counted
        self._closing = False
        #: ``time.monotonic()`` when the thread took the item it works on (None: waiting)
        self._busy_since: float | None = None
        #: rollout summaries taken from the queue, given to the sink together (:meth:`_hold`)
        self._held: list[RolloutSummary] = []
        self._held_since = 0.0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"rtrace-sink-{self.name}", daemon=True)
        self.thread.start()

    def _count(self, what: str, n: int) -> None:
        _stats.incr(f"sink.{self.name}.{what}", n)

    def prepare(self, trajectories: list[Trajectory]) -> None:
        """``sink.prepare`` on the pipeline's thread (:meth:`Sink.prepare`); a failure is
        counted, and export then does the work."""
        try:
            self.sink.prepare(trajectories)
        except Exception:
            self._count("prepare_errors", 1)
            _stats.warn_once(f"sink-prepare-{self.name}", "rtrace sink %r failed in prepare", self.name,
                             exc_info=True)

    def submit(self, batch: list[Trajectory], wait: Callable[[], bool] | None = None) -> None:
        """Queue a batch: at once, or, with ``wait``, waiting for room as long as ``wait()``
        says so (:meth:`Fanout.submit` with ``hold_back``: the collector, while the sink
        makes progress). Only then does a full queue thin what it holds. ``batch`` may be queued for other sinks too: it is never changed; a full
        queue makes new lists (:meth:`_thin`)."""
        q = self.queue
        try:
            if wait is None:
                q.put_nowait(batch)
                return
            while True:
                try:
                    q.put_nowait(batch)
                    return
                except queue.Full:
                    if not wait():
                        raise
                try:
                    q.put(batch, timeout=0.05)
                    return
                except queue.Full:
                    pass
        except queue.Full:
            pass
        lost = self._thin(batch) if self.sample_when_behind else len(batch)
        if not lost:
            return
        with self._lock:
            self._failed_since_marker = True  # the next flush() cannot say "all written"
        self._count("dropped_batches", 1)
        self._count("dropped_trajectories", lost)
        _stats.warn_once(f"sink-full-{self.name}", "rtrace sink %r cannot keep up; it samples fewer "
                         "trajectories per step (counted as dropped)", self.name)

    def _thin(self, batch: list[Trajectory]) -> int:
        """Make room for ``batch`` in the full queue; returns how many trajectories were
        dropped to do it.

        First the batch fills the room left in queued batches (up to ``batch_size`` each):
        nothing is lost. What does not fit costs as many trajectories as it brings, taken
        one at a time from the (validate, step) with the most trajectories queued or
        incoming (on a tie, the one seen last), and within it the last one that was not kept
        for a reason (an error, a tail) before any that was. So every step keeps an even
        share and a burst from one step cannot push the others out. The queue keeps its
        number of items; queued lists are replaced, never changed (other sinks may hold
        them). Runs under the queue's own lock, on the pipeline's thread, only when the
        sink is behind."""
        q = self.queue
        with q.mutex:
            items = q.queue
            if len(items) < q.maxsize:  # the sink's thread took an item meanwhile: room again
                self._put(batch)
                return 0
            slots = [i for i, item in enumerate(items) if type(item) is list]
            if not slots:  # only markers / step metrics queued: nothing to merge into
                return len(batch)
            pending = self._fill(items, slots, list(batch))
            if not pending:
                return 0
            # every queued and incoming trajectory by (validate, step), in arrival order:
            # [plain ones, ones kept for a reason]; each drop is O(number of steps)
            groups: dict[Any, tuple[list[Trajectory], list[Trajectory]]] = {}
            for traj in [t for i in slots for t in items[i]] + pending:
                group = groups.get((traj.validate, traj.step))
                if group is None:
                    group = groups[(traj.validate, traj.step)] = ([], [])
                group[0 if _sample_only(traj) else 1].append(traj)
            order = {key: n for n, key in enumerate(groups)}
            dropped: set[int] = set()
            for _ in range(len(pending)):
                key = max(groups, key=lambda k: (len(groups[k][0]) + len(groups[k][1]), order[k]))
                plain, kept = groups[key]
                dropped.add(id((plain or kept).pop()))
                if not plain and not kept:
                    del groups[key]
            for i in slots:
                if any(id(t) in dropped for t in items[i]):
                    items[i] = [t for t in items[i] if id(t) not in dropped]
            pending = self._fill(items, slots, [t for t in pending if id(t) not in dropped])
            return len(dropped) + len(pending)  # pending is empty: each drop made one place

    def _put(self, batch: list[Trajectory]) -> None:
        """What ``Queue.put`` does, for a caller that holds the queue's lock already."""
        q = self.queue
        q.queue.append(batch)
        q.unfinished_tasks += 1
        q.not_empty.notify()

    def _fill(self, items: Any, slots: list[int], pending: list[Trajectory]) -> list[Trajectory]:
        """Put ``pending`` into the queued batches with room (new lists); returns the rest."""
        for i in reversed(slots):
            if not pending:
                break
            room = self.batch_size - len(items[i])
            if room > 0:
                items[i] = items[i] + pending[:room]
                pending = pending[room:]
        return pending

    def marker(self, deadline: float) -> "_Marker | None":
        """Queue a flush marker (waiting for room until ``deadline``); its event is set once
        everything queued before it is exported and the sink flushed."""
        marker = _Marker()
        try:
            self.queue.put(marker, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return None
        return marker

    def stalled(self) -> bool:
        """Has the sink's thread been on one item (an export, a flush) longer than
        ``timeout_s``? Then nobody waits for room in its queue."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > self.timeout_s

    def _run(self) -> None:
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            while True:
                try:
                    item = self.queue.get(timeout=self._held_wait())
                except queue.Empty:  # summaries held long enough: written now
                    self._busy_since = time.monotonic()
                    self._write_held()
                    self._busy_since = None
                    continue
                if item is None:
                    break
                self._busy_since = time.monotonic()
                self._handle(item)
                self._busy_since = None
                if self._stop_requested and self.queue.empty():
                    break  # stop was requested while the queue was full: it is drained now
            self._write_held()
            # The end: everything queued before is exported. The sink shuts down here, on
            # its own thread: stopping starts no thread (see the module docstring).
            with self._lock:
                closing = self._closing = not self._abandoned
            if closing:
                self._call("shutdown", self.sink.shutdown)
        finally:
            detach(token)

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Metrics):
            if not self._call("export_step_metrics", self.sink.export_step_metrics, list(item)):
                self._count("failed_step_metrics", len(item))
            return
        if isinstance(item, _Events):
            if self._abandoned:
                self._count("abandoned_events", len(item))
            elif self._call("export_events", self.sink.export_events, list(item)):
                self._count("exported_events", len(item))
            else:
                self._failed_since_marker = True
                self._count("failed_events", len(item))
            return
        if isinstance(item, _Summaries):
            self._hold(item)
            return
        if isinstance(item, _Marker):
            self._write_held()
            flushed = self._call("flush", self.sink.flush, self.timeout_s)
            with self._lock:
                item.ok = flushed and not self._failed_since_marker
                self._failed_since_marker = False
            item.set()
            return
        with self._lock:
            if self._abandoned:
                # A late thread writes nothing. Shutdown counted what was inside export() and
                # what it drained from the queue itself; this batch the thread took from the
                # queue meanwhile (back from the export shutdown gave up on), so it is in
                # neither: it is counted here, else it would be in no counter at all
                self._count("abandoned_trajectories", len(item))
                return
            self._in_flight = item
        failed = len(item)
        try:
            self.sink.export(item)
            failed = 0
        except PartialExport as exc:  # part of the batch is durable, ``failed`` is not
            failed = max(0, min(len(item), int(exc.failed)))
            _stats.warn_once(f"sink-partial-{self.name}", "rtrace sink %r could not write part of a batch: %s",
                             self.name, exc)
        except Exception:
            _stats.warn_once(f"sink-export-{self.name}", "rtrace sink %r failed in export", self.name,
                             exc_info=True)
        with self._lock:
            self._in_flight = None
            if self._abandoned:  # shutdown gave up on this batch and counted it
                return
        if len(item) - failed:
            self._count("exported", len(item) - failed)
        if failed:
            self._failed_since_marker = True
            self._count("failed_batches", 1)
            self._count("failed_trajectories", failed)

    def _hold(self, summaries: list[RolloutSummary]) -> None:
        """Keep a batch of summaries to give the sink with the next ones: a collector hands over
        each round's (tens of rows), and the dataset makes a file pair per step per call (~300 µs
        a rollout in small batches). They are written when :data:`SUMMARIES_PER_EXPORT` are held,
        when the first has waited :data:`SUMMARIES_LINGER_S`, before a flush and at the end; only
        then are they counted exported (exported means durable)."""
        with self._lock:
            if self._abandoned:
                self._count("abandoned_summaries", len(summaries))
                return
            if not self._held:
                self._held_since = time.monotonic()
            self._held.extend(summaries)
            full = len(self._held) >= SUMMARIES_PER_EXPORT
        if full:
            self._write_held()

    def _held_wait(self) -> float | None:
        """How long the thread may wait for its next item (None: nothing held, no limit)."""
        if not self._held:
            return None
        return max(0.0, self._held_since + SUMMARIES_LINGER_S - time.monotonic())

    def _write_held(self) -> None:
        """Give the held summaries to the sink (see :meth:`_hold`), counted by what it says."""
        with self._lock:
            batch, self._held = self._held, []
        if not batch:
            return
        if self._call("export_summaries", self.sink.export_summaries, batch):
            self._count("exported_summaries", len(batch))
        else:
            with self._lock:
                self._failed_since_marker = True
            self._count("failed_summaries", len(batch))

    def _call(self, what: str, fn: Any, *args: Any) -> bool:
        try:
            result = fn(*args)
        except Exception:
            _stats.warn_once(f"sink-{what}-{self.name}", "rtrace sink %r failed in %s", self.name, what,
                             exc_info=True)
            return False
        # A sink's flush may say it could not make everything durable by returning False.
        return result is not False

    def request_stop(self) -> None:
        """Ask the sink's thread to export what is queued, shut the sink down and end.
        Never blocks: with a full queue, the thread stops once it has drained it."""
        self._stop_requested = True
        try:
            self.queue.put_nowait(None)  # wakes the thread if it waits on an empty queue
        except queue.Full:
            pass  # a full queue: the thread ends when it has drained it (_run)

    def join(self, deadline: float) -> None:
        """Wait until the sink's thread ended, or ``deadline`` (``time.monotonic()``);
        then whatever it still holds is counted as abandoned."""
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self._abandon()

    def stop(self, timeout_s: float) -> None:
        """Stop within ``timeout_s``: export what is queued, flush and shut the sink down
        (in its own thread); whatever is left behind is counted as abandoned."""
        self.request_stop()
        self.join(time.monotonic() + timeout_s)

    def _abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            lost = len(self._in_flight) if self._in_flight is not None else 0
            closing = self._closing
            held, self._held = self._held, []
        if held:
            self._count("abandoned_summaries", len(held))
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Summaries):
                self._count("abandoned_summaries", len(item))
            elif isinstance(item, _Events):
                self._count("abandoned_events", len(item))
            elif isinstance(item, list) and not isinstance(item, (_Metrics, _Events)):
                lost += len(item)
            elif isinstance(item, _Marker):
                item.set()
        if closing and not lost and self._unfinished():
            return
        self._count("shutdown_timeouts", 1)
        if lost:
            self._count("abandoned_trajectories", lost)
        _stats.warn_once(f"sink-hang-{self.name}", "rtrace sink %r did not finish in time; %d queued "
                         "or in-flight trajectories abandoned", self.name, lost)

    def _unfinished(self) -> bool:
        """Only the sink's shutdown() ran out of time, every trajectory exported: True when
        the sink says its data is complete (and what was left undone), logged once."""
        try:
            note = self.sink.unfinished_shutdown()
        except Exception:
            note = None
        if not note:
            return False
        _stats.warn_once(f"sink-unfinished-{self.name}", "rtrace sink %r did not finish shutting down in time, with "
                         "nothing left to export (0 trajectories abandoned): %s", self.name, note)
        return True


def _put_waiting(q: queue.Queue, item: Any, wait: Callable[[], bool] | None) -> bool:
    """Put ``item`` in ``q``: at once, or while ``wait()`` says to wait for room. False: full."""
    while True:
        try:
            q.put_nowait(item)
            return True
        except queue.Full:
            if wait is None or not wait():
                return False
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            pass


def _implements(sink: Sink, method: str) -> bool:
    """Does ``sink``'s class override the optional :class:`Sink` method ``method``?"""
    return getattr(type(sink), method, None) is not getattr(Sink, method)


def _sample_only(traj: Trajectory) -> bool:
    """Kept only as part of the step's sample (not for an error or a tail): dropped first."""
    return traj.status != "error" and all(reason == "sampled" for reason in traj.kept)


class _Metrics(list):
    """A batch of StepMetrics in a sink's queue."""


#: Rollout summaries a sink's thread gives its sink in one ``export_summaries`` call, at most,
#: and how long it holds the first of them before it writes what it has (SinkWorker._hold)
SUMMARIES_PER_EXPORT = 16_384
SUMMARIES_LINGER_S = 2.0


class _Summaries(list):
    """A batch of RolloutSummary in a sink's queue (sinks with ``export_summaries``)."""


class _Events(list):
    """A batch of RunEvent in a sink's queue (sinks with ``export_events``)."""


class _Marker(threading.Event):
    """A flush marker; ``ok`` says whether everything before it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.ok = False


class Fanout:
    """Every sink's worker; batches go to all of them."""

    def __init__(self, sinks: Sequence[Sink], batch_size: int, queue_size: int, timeout_s: float,
                 hold_back: bool = False) -> None:
        self.batch_size = batch_size
        self.workers = [SinkWorker(sink, queue_size, timeout_s, batch_size) for sink in sinks]
        #: wait for room in a sink's full queue while the sink makes progress (the collector:
        #: its worker waits, its queue and table fill, its receiver pushes back, and the
        #: senders wait, instead of a sink thinning what was accepted); never for a sink
        #: stuck on one item longer than ``timeout_s``; once stopping, until the last
        #: round's deadline only
        self.hold_back = hold_back
        self.stopping = False
        #: the sinks that encode on the pipeline's thread, while the trajectories are hot (Sink.prepare)
        self._preparing = [w for w in self.workers if _implements(w.sink, "prepare")]
        #: the sinks that write every rollout's summary (Sink.export_summaries: the dataset)
        self._summarizing = [w for w in self.workers if _implements(w.sink, "export_summaries")]
        #: the sinks that write the run's events (Sink.export_events: the dataset, JSONL)
        self._eventing = [w for w in self.workers if _implements(w.sink, "export_events")]

    @property
    def wants_step_metrics(self) -> bool:
        """Does any sink write step metrics (implements ``export_step_metrics``: trackio,
        MLflow, a sink of the application's)? If none does, the pipeline does not compute
        them (a fifth of the worker's time with a JSONL or OTLP sink alone)."""
        return any(_implements(w.sink, "export_step_metrics") for w in self.workers)

    def submit(self, trajectories: list[Trajectory], wait_until: float | None = None) -> None:
        """Hand ``trajectories`` to every sink, in batches. With ``hold_back`` (the
        collector), a sink whose queue is full is waited for while it makes progress, and
        once stopping until ``wait_until``; without, it thins what it holds at once (one
        process: the traced program's spans must not wait behind the worker)."""
        waits = self.hold_back
        for worker in self._preparing:
            # a sink that is behind (its queue full) thins what it gets: encoding it here
            # would spend the worker's time on trajectories it may drop; its export does it
            if waits or not worker.queue.full():
                worker.prepare(trajectories)
        size = self.batch_size
        for i in range(0, len(trajectories), size):
            batch = trajectories[i:i + size]
            for worker in self.workers:
                worker.submit(batch, self._waiting(worker, wait_until) if waits else None)

    def _waiting(self, worker: SinkWorker, wait_until: float | None) -> Callable[[], bool]:
        """Whether to go on waiting for room in ``worker``'s queue: never for a sink stuck on
        one item longer than its timeout; while the pipeline is not stopping; once it is,
        until ``wait_until`` (a stop's last round)."""
        def wait() -> bool:
            if worker.stalled():
                return False
            if not self.stopping:
                return True
            return wait_until is not None and time.monotonic() < wait_until
        return wait

    @property
    def wants_summaries(self) -> bool:
        """Does any sink write the summaries of rollouts it gets no trajectory of?"""
        return bool(self._summarizing)

    def submit_summaries(self, summaries: list[RolloutSummary], wait_until: float | None = None) -> None:
        """Hand rollout summaries to the sinks that write them, in batches (as :meth:`submit`:
        with ``hold_back`` a full queue is waited for; else the batch is dropped, counted in
        ``sink.<name>.dropped_summaries``)."""
        size = max(self.batch_size, 4096)  # small records: fewer, larger batches
        for worker in self._summarizing:
            for i in range(0, len(summaries), size):
                batch = _Summaries(summaries[i:i + size])
                wait = self._waiting(worker, wait_until) if self.hold_back else None
                if not _put_waiting(worker.queue, batch, wait):
                    with worker._lock:
                        worker._failed_since_marker = True
                    worker._count("dropped_summaries", len(batch))
                    _stats.warn_once(f"sink-summaries-{worker.name}", "rtrace sink %r cannot keep up with the "
                                     "rollout summaries; some are dropped (counted)", worker.name)

    def submit_events(self, events: list[RunEvent], wait_until: float | None = None) -> None:
        """Hand run events to the sinks that write them (as :meth:`submit_summaries`: with
        ``hold_back`` a full queue is waited for; else they are dropped, counted in
        ``sink.<name>.dropped_events``)."""
        for worker in self._eventing:
            wait = self._waiting(worker, wait_until) if self.hold_back else None
            if not _put_waiting(worker.queue, _Events(events), wait):
                with worker._lock:
                    worker._failed_since_marker = True
                worker._count("dropped_events", len(events))

    def submit_metrics(self, metrics: list[StepMetrics]) -> None:
        for worker in self.workers:
            try:
                worker.queue.put_nowait(_Metrics(metrics))
            except queue.Full:
                worker._count("dropped_step_metrics", len(metrics))

    def markers(self, deadline: float) -> list[_Marker | None]:
        return [w.marker(deadline) for w in self.workers]

    def stop(self, timeout_s: float) -> None:
        """Stop every sink, in parallel (each in its own thread, which exists already),
        within ``timeout_s`` in all: a hung sink is abandoned (counted) and never keeps the
        others from shutting down. Starts no thread (safe at interpreter exit)."""
        self.stopping = True
        for w in self.workers:
            w.request_stop()
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.join(deadline)
