"""The trajectory pipeline: span processor, worker thread, fan-out to the sinks.

::

    span.end() --on_end--> bounded deque --worker thread------------------------> Fanout
      (caller's thread:      (drops counted;   registry.arrive: root?              (one thread and
       one dict lookup,       a dropped root    convert span -> SpanRecord          bounded queue
       one append)            frees its slot)   annotations joined / awaited        per sink)
                                                orphans expired as partial
                                                finish -> Trajectory
                                                token2text, messages

rtrace owns its queue and threads instead of using the SDK's BatchSpanProcessor: that
one runs ``export()`` on the caller's thread at ``force_flush`` and hides its drops.
Here the traced program's thread only appends to a deque; assembling, converting,
decoding and writing all happen in rtrace's threads, also during ``flush()``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Sequence

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from .. import _stats
from ..config import Settings
from ..events import RunEvent, worker_identity
from ..summary import RolloutSummary
from ..trajectory import Trajectory
from .annotations import Annotation, AnnotationTable, coord_key, estimated_bytes
from .builder import SpanConverter, coordinates, finish, tail_of
from .fanout import Fanout
from .fleet import MAX_QUEUED_EVENTS, Versions, take_in
from .health import NO_REWARD, HealthChecker, finding
from .messages import build_messages
from .metrics import StepMetricsTracker
from .records import Tally, TrajectoryState, ids_of, record_of, worker_of
from .registry import TrajectoryRegistry
from .summaries import state_of_tally, summarize, summary_of_state
from .tokens import attach as attach_tokens, has_rows

__all__ = ["Pipeline", "ProcessorBridge"]

Postprocessor = Callable[[list[Trajectory]], None]


class ProcessorBridge(SpanProcessor):
    """The SDK span processor rtrace adds to a TracerProvider: a filter and an append.

    One bridge per provider, for the life of the process: a provider cannot drop a
    processor, so when rtrace shuts down or is configured again the bridge is pointed at
    the new pipeline (or at nothing) instead of adding another. A bridge with no
    pipeline ignores spans and its ``force_flush`` returns True at once, so an
    application's provider keeps flushing its other processors.
    """

    def __init__(self) -> None:
        self.target: Pipeline | None = None

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        target = self.target
        if target is not None:
            target.offer(span)

    def shutdown(self) -> None:
        self.target = None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        target = self.target
        return True if target is None else target.force_flush(timeout_millis)


#: Spans a round takes at a time (about 64 trajectories of 6): each part is converted,
#: finished and handed to the sinks before the next is read. A round of thousands of spans
#: at once kept all their records, trajectories and messages alive together, so Python's
#: GC promoted them and walked them in full collections (a tight loop's backlog measured
#: ~7% of the process's CPU more, benchmarks/bench_hot_path.py).
_CHUNK = 384


class Pipeline:
    """Collects the spans of registered trajectories and exports them from a worker thread."""

    #: True during the round that serves a flush request: its last part releases what the
    #: selector holds and settle times are skipped (a round that was already running when
    #: flush() was called does not: the rest of the backlog is in the next round)
    _serving_flush = False
    #: a stop's deadline (``time.monotonic()``) while the worker serves its last round: a
    #: collector's sink whose queue is full is waited for until then (Fanout.hold_back)
    _wait_until: float | None = None
    #: a step's metrics wait this long after its last trajectory once a later step began
    metrics_linger_s = 1.0
    #: refuse new trajectories once shutdown starts (one process: the hot path may still
    #: start some; the collector has stopped receiving already, and what it accepted must
    #: still be assembled in the last round)
    refuse_new_at_shutdown = True
    #: seconds a trajectory waits after its root arrived (the collector: spans of other
    #: processes may still be on their way); 0 in one process, where children end first
    settle_s = 0.0

    def __init__(self, settings: Settings, fanout: Fanout, postprocessors: Sequence[Postprocessor] = (),
                 health_tokenizer: Callable[[], Any] = lambda: None) -> None:
        self.settings = settings
        self._tokenizer = health_tokenizer
        self.registry = TrajectoryRegistry(settings.max_open_trajectories, settings.max_spans_per_trajectory,
                                           settings.max_waiting_trajectories, settings.collector_max_waiting_bytes,
                                           settings.max_waiting_summaries)
        self.fanout = fanout
        self.postprocessors = list(postprocessors)
        self.annotations = AnnotationTable(settings.await_annotations or (), settings.annotation_timeout_s,
                                           settings.await_eval_annotations,
                                           learn=settings.await_annotations is None
                                           and "logprob_mismatch" in settings.health_checks)
        #: per-step metrics over the exported trajectories (None: summary_metrics off, or
        #: no sink writes step metrics)
        # every group is whole in the metrics when every rollout is counted (summaries), or
        # whole groups are sampled, or nothing is capped: then odd group sizes are reported
        whole = settings.summaries or settings.sample_groups or (
            settings.max_traces_per_step is None and settings.val_cap is None)
        self.metrics = StepMetricsTracker(min(self.metrics_linger_s, settings.step_linger_s),
                                          settings.step_table_rows, settings.health_checks,
                                          whole, every_rollout=settings.summaries,
                                          ) if settings.summary_metrics and fanout.wants_step_metrics else None
        #: every finished rollout leaves a summary (RTRACE_SUMMARIES): for the step metrics and
        #: the sinks that write one row per rollout (the dataset's ``export_summaries``)
        self.summaries = settings.summaries
        #: rollouts recorded as summaries only (the hot path's tallies), for the worker
        self._tallies: collections.deque[Tally] = collections.deque()
        #: this process's worker identity (docs/timeline.md): its events', and its rollouts'
        #: (:attr:`rollout_worker`; the collector's rollouts carry their sender's)
        self.worker_name = worker_identity(settings.worker_name)
        self.rollout_worker: str | None = self.worker_name
        #: run events (weight updates) waiting for the worker, and the updates seen so far
        self._events: collections.deque[RunEvent] = collections.deque()
        self.versions = Versions()
        #: states the selection dropped in this part of a round: summarized at its end
        self._dropped: list[TrajectoryState] = []
        #: end-of-trajectory selection (the collector; one process with tail keeping)
        self.selector: Any = None
        #: rollout-health checks (None: RTRACE_HEALTH_CHECKS=none)
        self.health: HealthChecker | None = HealthChecker(
            settings.health_checks, settings.health_max_staleness, health_tokenizer,
            (settings.mismatch_ratio, settings.mismatch_max_fraction, settings.mismatch_max_k3)
        ) if settings.health_checks else None
        self._max_queue = settings.max_queue_size
        self._wake_at = max(1, min(2048, self._max_queue // 2))
        # A tally holds a rollout's calls (~20 spans' worth) and what they saw (a realistic one
        # keeps ~50 kB of prompt and response ids alive): the worker is woken for as many calls
        # as spans, not after 2,048 rollouts (~100 MB held until the half-second round).
        self._tally_wake_at = max(1, self._wake_at // 32)
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        #: finished states built without spans (log_rollout_batch), and annotations
        self._states: collections.deque[TrajectoryState] = collections.deque()
        self._annotations: collections.deque[Annotation] = collections.deque()
        #: the estimated bytes of the queued annotations (annotation_queue_bytes), and its lock:
        #: callers' threads add, the worker takes everything at once
        self._annotation_bytes = 0
        self._annotation_lock = threading.Lock()
        #: waiting trajectories whose settle time had not passed when last seen, oldest root
        #: first (the collector; a trajectory written meanwhile is skipped when it comes up)
        self._settling: collections.deque[TrajectoryState] = collections.deque()
        self._cond = threading.Condition()
        self._flush_requests: list[tuple[threading.Event, list]] = []
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="rtrace-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ hot path
    def offer(self, span: ReadableSpan) -> None:
        """``on_end``: queue an ended span of one of our trajectories (others pass by)."""
        try:  # rtrace's own spans carry their ids (their SpanContext is made when asked for)
            trace_id = span.trace_id
        except AttributeError:  # an SDK span
            trace_id = span.context.trace_id
        if self.registry.lookup(trace_id) is None:
            return  # not ours (or already finished: counted by the worker as late)
        q = self._queue
        if len(q) >= self._max_queue:
            _stats.incr("spans_dropped_queue")
            _stats.warn_once("queue-full", "rtrace span queue is full (%d); spans are dropped", self._max_queue)
            # A dropped root would keep its trajectory open until the orphan timeout:
            # mark it, so the worker writes it as partial in its next round.
            self.registry.mark_root_lost(trace_id, span.context.span_id)
            return
        q.append(span)
        if len(q) == self._wake_at:
            with self._cond:
                self._cond.notify()

    def submit_states(self, states: Sequence[TrajectoryState]) -> int:
        """Queue finished trajectories built without spans (``records`` filled, root set):
        they are finished and post-processed like the others.

        Returns:
            How many were queued; the rest were dropped (queue full) and counted.
        """
        room = max(0, self._max_queue - len(self._states))
        if room < len(states):
            _stats.incr("trajectories_dropped_queue", len(states) - room)
        self._states.extend(states[:room])
        with self._cond:
            self._cond.notify()
        return min(room, len(states))

    def submit_tallies(self, tallies: Sequence[Tally]) -> int:
        """Queue rollouts recorded as summaries only (the hot path's tallies): each becomes
        a summary in the worker (pipeline/summaries.py).

        Returns:
            How many were queued; the rest were dropped (queue full) and counted.
        """
        q = self._tallies
        room = max(0, self._max_queue - len(q))
        if room < len(tallies):
            _stats.incr("summaries_dropped_queue", len(tallies) - room)
        q.extend(tallies[:room])
        if len(q) == self._tally_wake_at:  # as offer(): a tight loop of summarized rollouts fills it fast
            with self._cond:
                self._cond.notify()
        return min(room, len(tallies))

    def submit_events(self, events: Sequence[RunEvent]) -> None:
        """Queue run events (``rtrace.mark_weight_update``) for the worker; beyond
        :data:`~rtrace.pipeline.fleet.MAX_QUEUED_EVENTS` they are dropped and counted."""
        q = self._events
        room = max(0, MAX_QUEUED_EVENTS - len(q))
        if room < len(events):
            _stats.incr("weight_updates_dropped_queue", len(events) - room)
        q.extend(events[:room])

    def annotate(self, annotations: Sequence[Annotation]) -> None:
        """Queue annotations for the worker, bounded in (estimated) bytes, not rows: one
        ``annotate_batch`` call for a step of 10^5 rollouts fits whole (``annotation_queue_bytes``);
        rows beyond the bound are dropped and counted."""
        if not annotations:
            return
        size = estimated_bytes(annotations)
        per_row = max(1, size // len(annotations))
        with self._annotation_lock:
            room = max(0, self.settings.annotation_queue_bytes - self._annotation_bytes)
            taken = len(annotations) if size <= room else room // per_row
            self._annotations.extend(annotations[:taken] if taken < len(annotations) else annotations)
            self._annotation_bytes += size if taken == len(annotations) else taken * per_row
        if taken < len(annotations):
            _stats.incr("annotations_dropped_queue", len(annotations) - taken)
            _stats.warn_once("annotation-queue", "rtrace's annotation queue is full (annotation_queue_bytes=%d); "
                             "annotations are dropped (counted)", self.settings.annotation_queue_bytes)
        if self.annotations.await_keys or self.annotations.await_eval_keys:
            with self._cond:
                self._cond.notify()

    def gauges(self) -> dict[str, int]:
        return {"open_trajectories": len(self.registry), "waiting_trajectories": self.registry.num_waiting(),
                "queued_spans": len(self._queue)}

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
                expire = stopping or now - last_expiry > min(1.0, self.settings.orphan_timeout_s)
                self._serving_flush = bool(requests)
                # a stop gives the worker sink_timeout_s (shutdown joins it that long): half of
                # it for full sink queues, in the collector (Fanout.hold_back)
                self._wait_until = now + self.settings.sink_timeout_s / 2 if stopping else None
                try:
                    self._round(now, expire, stopping)
                except Exception:
                    _stats.incr("internal_errors")
                    _stats.warn_once("worker", "rtrace worker failed to assemble trajectories", exc_info=True)
                if expire:
                    last_expiry = now
                if (requests or stopping) and self.metrics is not None:
                    rows = self.metrics.release()  # flush / stop: every open step is done
                    if rows:
                        self.fanout.submit_metrics(rows)
                for done, markers in requests:
                    markers.extend(self.fanout.markers(now + self.settings.sink_timeout_s))
                    done.set()
                if stopping:
                    return
        finally:
            detach(token)

    def _round(self, now: float, expire: bool, force: bool) -> None:
        """Everything queued when the round starts, :data:`_CHUNK` spans at a time; the last
        part also expires, forces and releases what it should."""
        q = self._queue
        left = len(q)
        while left > _CHUNK:
            self._chunk(now, False, False, _CHUNK, last=False)
            left -= _CHUNK
            now = time.monotonic()
        self._chunk(now, expire, force, left)

    def _chunk(self, now: float, expire: bool, force: bool, n: int, last: bool = True) -> None:
        """One part of a round: the next ``n`` spans, and what finished with them. Only the
        round's ``last`` part may release a step's selection at a flush: a step is sampled
        from its whole backlog, not from the first part of it."""
        q, pre = self._queue, self._states
        spans = [q.popleft() for _ in range(n)]
        prebuilt = [pre.popleft() for _ in range(len(pre))]
        for ann in self._take_annotations():
            self.annotations.add(ann)
        conv = SpanConverter(self.settings)
        arrived = self._assemble(spans, conv) + prebuilt
        if self._events:  # before the rollouts that ended with them are finished
            self._take_events(conv)
        tallies = self._tallies
        if tallies:
            arrived += self._from_tallies([tallies.popleft() for _ in range(len(tallies))], conv)
        for state in arrived:
            self.annotations.arrived(state)
        now = time.monotonic()  # roots arrived during the assembly, after the round's start
        settle = not (force or self._serving_flush or self.settle_s <= 0)
        table = self.annotations
        awaits = bool(table.await_keys or table.await_eval_keys)
        registry = self.registry

        def done(state: TrajectoryState) -> bool:  # a stop (force) writes everything, a missing key counted
            settled = not settle or state.root_at is None or now - state.root_at >= self.settle_s
            return settled and (not awaits or table.ready(state, now, force))

        ready = [state for state in self._due(now, force, awaits) if done(state)]
        waits: list[TrajectoryState] = []
        for state in arrived:
            if done(state):
                ready.append(state)
                continue
            waits.append(state)
            if state.root_at is not None and now - state.root_at < self.settle_s:  # checked once it has settled
                self._settling.append(state)
        registry.remove_all(ready)
        # the ones that wait leave the open table (a running trajectory's room is never theirs);
        # a full waiting table writes its oldest now, without what they waited for (counted)
        for state in registry.hold(waits):
            table.forget(state)
            ready.append(state)
        ready += self._evict()
        if expire:
            ready += self.registry.expire(now, self.settings.orphan_timeout_s, force)
            self.annotations.expire(now)
        for state in ready:  # the trainer's per-token rows onto the generations (pipeline/tokens.py)
            if state.annotations and has_rows(state.annotations):
                self._attach_tokens(state)
        if self.health is not None:  # before the selection: it may keep unhealthy ones
            for state in ready:
                try:
                    self.health.check_state(state)
                except Exception:
                    _stats.incr("health_errors")
                    _stats.warn_once("health", "rtrace could not run the health checks on a trajectory",
                                     exc_info=True)
        summary_only = [state for state in ready if state.summary_only]
        if summary_only:  # never kept: counted by their summaries only
            ready = [state for state in ready if not state.summary_only]
        ready = self._select(ready, now, force, last)
        if ready:
            self._export(ready, conv)
        if summary_only or self._dropped:
            dropped, self._dropped = self._dropped, []
            self._summarize(summary_only + dropped, conv)
        conv.count()
        if self.metrics is not None:
            rows = self.metrics.due(time.monotonic())
            if rows:
                self.fanout.submit_metrics(rows)

    def _take_events(self, conv: SpanConverter) -> None:
        """The queued run events: checked, into the version history, to the sinks."""
        q = self._events
        events = take_in([q.popleft() for _ in range(len(q))], self.worker_name, conv.conv)
        if events:
            self.versions.add(events)
            self.fanout.submit_events(events, self._wait_until)

    def _take_annotations(self) -> list[Annotation]:
        """Every queued annotation, at once (their bytes leave the queue's bound)."""
        with self._annotation_lock:
            taken = list(self._annotations)
            self._annotations.clear()
            self._annotation_bytes = 0
        return taken

    def _due(self, now: float, force: bool, awaits: bool) -> list[TrajectoryState]:
        """The waiting trajectories that may be ready now, each once: every one at a flush or a
        stop; else those whose settle time or annotation timeout has passed, and those an
        annotation came for. A part of a round costs what happened, not the size of the
        waiting table (a scan of 20,000 waiting ones took 60-90 ms, each part)."""
        registry = self.registry
        if force or self._serving_flush:
            return registry.waiting()
        due: list[TrajectoryState] = []
        settling, settle_s = self._settling, self.settle_s
        while settling and now - settling[0].root_at >= settle_s:  # in the order their roots came
            due.append(settling.popleft())
        due += self.annotations.take_touched()
        if awaits:
            due += registry.waiting_since(now - self.annotations.timeout_s)
        # one check each, and only of those still waiting (one written early, or at a flush, left)
        return [state for state in dict.fromkeys(due) if registry.is_waiting(state)]

    def _attach_tokens(self, state: TrajectoryState) -> None:
        try:
            problems = attach_tokens(state.records, state.annotations)
        except Exception:
            _stats.incr("token_arrays_errors")
            _stats.warn_once("tokens", "rtrace could not attach per-token values to a trajectory", exc_info=True)
            return
        if problems:
            _stats.incr("token_arrays_problems", len(problems))
            if self.health is not None and "token_arrays" in self.health.checks:
                state.health = list(state.health) + [finding("token_arrays", p) for p in problems]

    def _evict(self) -> list[TrajectoryState]:
        """Trajectories removed from the registry to make room (the collector), as partial."""
        return []

    def dropped(self, state: TrajectoryState) -> None:
        """The selector sampled ``state`` out: its annotations are then dropped cheaply, and
        its summary counted (at the end of the round's part: :meth:`_summarize`)."""
        if self.summaries:
            self._dropped.append(state)
        else:
            self.annotations.remember(coord_key(state.coords), state.trace_id, "sampled_out")

    def _from_tallies(self, tallies: list[Tally], conv: SpanConverter) -> list[TrajectoryState]:
        """Summary-only states of tallied rollouts (they wait for annotations like others)."""
        out = []
        for tally in tallies:
            try:
                out.append(state_of_tally(tally, self.settings, conv))
            except Exception:
                _stats.incr("summaries_build_failed")
                _stats.warn_once("tally", "rtrace could not summarize a rollout; it is not counted", exc_info=True)
        return out

    def _summarize(self, states: list[TrajectoryState], conv: SpanConverter) -> None:
        """The summaries of rollouts that are not exported (summary-only, or dropped by the
        selection): to the step metrics and the sinks that write every rollout."""
        out: list[RolloutSummary] = []
        for state in states:
            self.annotations.arrived(state)  # annotations that came while the selection held it
            if state.health and state.annotations.get("reward", state.reward) is not None:
                state.health = [f for f in state.health if f != finding("reward", NO_REWARD)]
            try:
                summary = summary_of_state(state, self.settings, conv.conv, self.priority_of(state.coords))
                if summary.worker is None:
                    worker = worker_of(state)
                    summary.worker = worker if worker is not None else self.rollout_worker
                self.versions.complete_summary(summary)
                out.append(summary)
            except Exception:
                _stats.incr("summaries_build_failed")
                _stats.warn_once("summary", "rtrace could not summarize a rollout; it is not counted", exc_info=True)
                continue
            self.annotations.remember(coord_key(state.coords), state.trace_id, "sampled_out")
        if not out:
            return
        _stats.incr("rollouts_summarized", len(out))
        self.fanout.submit_summaries(out, self._wait_until)
        if self.metrics is not None:
            rows = self.metrics.count(out, time.monotonic())
            if rows:
                self.fanout.submit_metrics(rows)

    def priority_of(self, coords: dict[str, Any]) -> float | None:
        """A rollout's rank in its step's sample (the selector's ``priority``), for the
        dataset's readers to cut several collectors' samples; None when the sample is not
        chosen by rank (one process without tail keeping: decided as trajectories start)."""
        selector = self.selector
        return selector.priority(coords) if selector is not None else None

    def _select(self, states: list[TrajectoryState], now: float, force: bool,
                last: bool = True) -> list[TrajectoryState]:
        """Which finished trajectories go to the sinks now: all of them when sampling was
        decided at their start, else what the selector keeps (and releases: at a flush or
        stop only in a round's ``last`` part)."""
        selector = self.selector
        if selector is None:
            s = self.settings
            for state in states:
                cap = s.val_cap if state.coords.get("validate") else s.max_traces_per_step
                if cap is not None and not state.kept:
                    state.kept = ["sampled"]
            return states
        out: list[TrajectoryState] = []
        keep_by = self.settings.keep_by
        for state in states:
            try:  # one trajectory the selector cannot place costs that one, not the round
                out.extend(selector.offer(state.coords, state, now, tail_of(state, keep_by),
                                          sample=not state.promoted))
            except Exception:
                _stats.incr("trajectories_select_failed")
                _stats.warn_once("select", "rtrace could not sample a trajectory; it is dropped", exc_info=True)
        out.extend(selector.release(now, last and (force or self._serving_flush)))
        return out

    def _assemble(self, spans: list[ReadableSpan], conv: SpanConverter) -> list[TrajectoryState]:
        """Convert each span into its trajectory's records; return the trajectories whose
        root arrived. The root is always kept; other spans beyond the cap are dropped."""
        registry = self.registry
        settings = self.settings
        max_children = settings.max_spans_per_trajectory - 1
        arrived: list[TrajectoryState] = []
        values = conv.conv
        for i, span in enumerate(spans):
            # let each span go once converted (it holds what its call saw): a round of
            # thousands of spans would otherwise keep them all for Python's GC to walk
            spans[i] = None
            trace_id, span_id = ids_of(span)
            state, is_root = registry.arrive(trace_id, span_id)
            if state is None:  # ended after its root was assembled
                _stats.incr("spans_late")
                continue
            record = record_of(span, state, span_id)
            if len(state.records) >= max_children and not is_root:
                state.dropped_spans += 1
                _stats.incr("spans_dropped_trajectory_limit")
                continue
            unplain = values.unplain
            if state.coordinates is None and not state.records:
                # its first span: the coordinates, and the rl.* stamp each record starts with
                try:
                    state.coordinates = coordinates(state, settings, values)
                except Exception:
                    pass  # finish() makes them again, and counts the trajectory it cannot build
            try:
                stamp = state.coordinates[2] if state.coordinates is not None else None
                state.add(conv.convert(span, record, stamp))
            except Exception:
                _stats.incr("capture_errors")
                _stats.warn_once("convert", "rtrace could not convert a span; it is dropped", exc_info=True)
            # plain JSON data only so far (a sink may then skip its own check, see vouch())
            state.plain = state.plain is not False and values.unplain == unplain
            if is_root:
                arrived.append(state)
        return arrived

    def _export(self, states: list[TrajectoryState], conv: SpanConverter) -> None:
        out: list[Trajectory] = []
        for state in states:
            # annotations that came while it was held (collector: the job-wide sample)
            self.annotations.arrived(state)
            if state.health and state.annotations.get("reward", state.reward) is not None:
                # the reward came while the selector held it: the check ran before
                state.health = [f for f in state.health if f != finding("reward", NO_REWARD)]
            try:
                out.append(finish(state, self.settings, conv.conv))
            except Exception:
                _stats.incr("trajectories_build_failed")
                _stats.warn_once("build", "rtrace could not build a trajectory; it is dropped", exc_info=True)
                continue
            self.annotations.remember(coord_key(state.coords), state.trace_id, "exported")
            traj = out[-1]
            traj.priority = self.priority_of(state.coords)
            worker = worker_of(state)
            traj.worker = worker if worker is not None else self.rollout_worker
            self.versions.complete_trajectory(traj)
        health = self.health
        if health is not None:
            self._step(health.check_ids, out, "health")  # while the token ids are on the spans
        for post in self.postprocessors:
            try:
                post(out)
            except Exception:
                _stats.incr("postprocess_errors")
                _stats.warn_once(f"post-{post!r}", "rtrace postprocessor %r failed", post, exc_info=True)
        t2t = self.settings.token2text  # unset: decoding once a trainer's adapter handed in its tokenizer
        decoding = bool(t2t) or (t2t is None and self._tokenizer() is not None)
        for traj in out:
            if traj.messages:
                continue
            try:
                traj.messages = build_messages(traj, decoding)
            except Exception:
                _stats.incr("messages_errors")
                _stats.warn_once("messages", "rtrace could not build messages", exc_info=True)
        if health is not None:
            self._step(health.check_text, out, "health")  # with the decoded text and the conversation
            for traj in out:
                traj.health_checks = health.ran(traj)
        _stats.incr("trajectories_completed", len(out))
        self.fanout.submit(out, self._wait_until)
        if self.metrics is not None:
            # observe() releases the steps these trajectories show are done: they go to
            # the sinks now, after the trajectories (a step's rows were lost here before)
            now = time.monotonic()
            rows = self.metrics.observe(out, now)
            if self.summaries:  # counted after their rows are in the table: a step's table is whole
                rows += self.metrics.count([summarize(t, t.priority) for t in out], now)
            if rows:
                self.fanout.submit_metrics(rows)

    @staticmethod
    def _step(fn: Callable[[list[Trajectory]], None], out: list[Trajectory], what: str) -> None:
        try:
            fn(out)
        except Exception:
            _stats.incr(f"{what}_errors")
            _stats.warn_once(f"step-{what}", "rtrace: %s failed on a batch (the trajectories are still exported)",
                             what, exc_info=True)

    # ------------------------------------------------------------------ control
    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything that has ended and wait for every sink to write it.

        Returns:
            True if all sinks wrote everything within the timeout; False when a sink
            failed a batch since the last flush, or the timeout passed.
        """
        deadline = time.monotonic() + max(0, timeout_millis) / 1000.0
        if not self._worker.is_alive():
            return False
        done, markers = threading.Event(), []
        with self._cond:  # the round that serves it releases what the selector holds
            self._flush_requests.append((done, markers))
            self._cond.notify()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return False
        ok = True
        for marker in markers:
            if marker is None or not marker.wait(max(0.0, deadline - time.monotonic())) or not marker.ok:
                ok = False
        return ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Emit what is open as partial trajectories, flush the sinks, stop the threads;
        bounded by ``sink_timeout_s`` for the worker and again for the sinks."""
        if self._stopping:
            return
        timeout_s = self.settings.sink_timeout_s if timeout_s is None else timeout_s
        if self.refuse_new_at_shutdown:
            self.registry.close()
        self.fanout.stopping = True  # a worker waiting for a sink's room (the collector) stops waiting
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._worker.join(timeout_s)
        if self._worker.is_alive():
            _stats.incr("shutdown_worker_timeouts")
        self.fanout.stop(timeout_s)
