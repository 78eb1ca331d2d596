"""Records shared by the hot path (instrumentation) and the pipeline's worker thread.

The instrumentation fills these records; the pipeline reads them. They live in the
pipeline (downstream of the decorators) so that nothing imports upward: a sink depends
on the :class:`~rtrace.trajectory.Trajectory` model only, the pipeline on these records,
the decorators on both.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from .._serialize import ListSnapshot
from ..trajectory import SpanRecord

__all__ = ["CallSpec", "CallRecord", "Deferred", "TrajectoryState", "Mark", "Tally", "snapshot_args", "ids_of", "record_of",
           "start_end", "worker_of"]


class CallSpec:
    """What a decorator knows about its function, decided once at decoration time."""

    __slots__ = ("kind", "name", "capture", "param_names", "skip_first", "options", "default_name", "function")

    def __init__(self, kind: str, name: str, capture: bool, param_names: tuple[str, ...],
                 skip_first: bool, options: dict[str, Any], default_name: bool = False,
                 function: str | None = None) -> None:
        self.kind = kind
        self.name = name
        #: ``name`` is the function's qualified name (no ``name=`` given): the worker may
        #: show a tool's or a model's own name instead (pipeline/builder.py)
        self.default_name = default_name
        #: the function's fully-qualified name (``module.qualname``), OTel's ``code.function.name``
        self.function = function
        self.capture = capture
        self.param_names = param_names
        #: the first positional argument is ``self`` / ``cls`` and is not captured
        self.skip_first = skip_first
        #: kind-specific options (generation: prompt_field, response_field, model;
        #: tool: tool_name) — read by the worker only
        self.options = options


class CallRecord:
    """One decorated call as the hot path saw it: references and snapshots, no conversion."""

    __slots__ = ("spec", "args", "kwargs", "output", "has_output", "owner_name", "arg_lens")

    def __init__(self, spec: CallSpec, args: tuple | None, kwargs: dict | None) -> None:
        self.spec = spec
        #: the snapshotted arguments; with ``arg_lens``, the call's own argument tuple
        #: (nothing copied on the hot path), each list argument to be cut at its length
        #: there (-1: not a list): :func:`snapshot_args` makes the snapshots in the worker
        self.args = args
        self.arg_lens: tuple[int, ...] | None = None
        self.kwargs = kwargs
        self.output: Any = None
        self.has_output = False
        #: ``self.name`` of a method's instance (tool classes name themselves this way)
        self.owner_name: str | None = None


class Deferred:
    """A call record's ``kwargs`` that is read in the worker, when the span is converted: the
    hot path keeps references (the capture gateway: the request and the upstream's answer as
    it came, rtrace/gateway/recorder.py) and :meth:`resolve` makes the record from them, off
    the caller's path."""

    __slots__ = ()

    def resolve(self) -> tuple[dict[str, Any] | None, Any, dict[str, Any]]:
        """``(inputs, output, attributes)``: the call's inputs (None: not captured), its
        output (None: none), and attributes for its span (over the span's own)."""
        raise NotImplementedError


def snapshot_args(rec: Any) -> tuple:
    """The arguments of a call record (a :class:`CallRecord`, or a span of rtrace's that
    carries its fields) as the call saw them (worker thread): each list one a
    :class:`~rtrace._serialize.ListSnapshot` of its length at call time."""
    args, lens = rec.args or (), rec.arg_lens
    if lens is None:
        return args
    return tuple([value if n < 0 else ListSnapshot(value, n) for value, n in zip(args, lens)])


def start_end(span: SpanRecord) -> tuple[int, int]:
    """The sort key of spans in start order (ties by end): a key function, not a lambda per sort."""
    return span.start_ns, span.end_ns


def ids_of(span: Any) -> tuple[int, int]:
    """``(trace_id, span_id)`` of an ended span: rtrace's own spans carry them (no
    SpanContext is made for them), an SDK span has them in its context."""
    try:
        return span.trace_id, span.span_id
    except AttributeError:
        ctx = span.context
        return ctx.trace_id, ctx.span_id


def record_of(span: Any, state: "TrajectoryState", span_id: int) -> Any:
    """The call record of an ended span: the span itself when it is one of rtrace's that
    a decorated call made (it carries the record's fields), else the CallRecord kept in
    ``state.captures`` (an SDK span of an application's provider, a segment), if any."""
    if getattr(span, "spec", None) is not None:
        return span
    return state.captures.pop(span_id, None)


class TrajectoryState:
    """One open trajectory in the registry.

    In one process the hot path creates it when a root span starts and adds the reward,
    the outcome and, for a decorated call whose span is not one of rtrace's (an
    application's provider), a :class:`CallRecord` in ``captures``; the worker
    converts each ended span into a :class:`~rtrace.trajectory.SpanRecord` as it arrives
    (``records``). In the collector the state is opened by the first span of a trace
    that arrives over OTLP, and the coordinates come from the root span's attributes.

    Fields written by the hot path: ``captures``, ``reward``, ``has_reward``,
    ``outcome``. Everything else belongs to the pipeline (the registry's lock guards
    ``root_span_id``, the worker thread the rest). The worker never writes a field the
    hot path owns.
    """

    __slots__ = ("trace_id", "root_span_id", "name", "kind", "coords", "captures", "reward",
                 "has_reward", "outcome", "created", "created_ns", "records", "dropped_spans",
                 "partial", "root_lost", "root_at", "annotations", "remote_parent", "messages", "kept", "health",
                 "span_ids", "touched", "held_bytes", "plain", "coordinates", "summary_only", "summary", "promoted", "worker")

    def __init__(self, trace_id: int, root_span_id: int | None, name: str, kind: str,
                 coords: dict[str, Any]) -> None:
        self.trace_id = trace_id
        #: None in the collector until the root span arrives
        self.root_span_id = root_span_id
        self.name = name
        self.kind = kind
        self.coords = coords
        self.captures: dict[int, CallRecord] = {}
        self.reward: Any = None
        self.has_reward = False
        self.outcome: dict[str, Any] = {}
        self.created = time.monotonic()
        self.created_ns = time.time_ns()
        #: converted spans, filled by the worker as they arrive (a list from the first one)
        self.records: Sequence[SpanRecord] = ()
        self.dropped_spans = 0
        #: set by the worker when the root never arrived (orphan timeout or shutdown)
        self.partial = False
        #: the root span was dropped on the way (queue full): finish as partial at once
        self.root_lost = False
        #: monotonic time the root arrived (the trajectory is then complete, or waits
        #: for awaited annotations / a collector's settle time)
        self.root_at: float | None = None
        #: annotations joined from rtrace.annotate / annotate_batch (key -> value)
        self.annotations: dict[str, Any] = {}
        #: a segment's remote parent span id (int), for the one OTel conversion
        self.remote_parent: int | None = None
        #: a conversation given with the trajectory (log_rollout_batch(messages=...))
        self.messages: list[dict[str, Any]] | None = None
        #: why the end-of-trajectory selection kept it ("sampled", "error", "best", ...)
        self.kept: Sequence[str] = ()  # a list once something keeps it (no list per waiting trajectory)
        #: rollout-health findings ({"check", "detail"}), filled by the worker (health.py)
        self.health: Sequence[dict[str, str]] = ()  # a list once a check finds something
        #: collector only: the span ids taken (duplicates are refused), when a span last
        #: arrived (the least recently active are evicted first), the bytes held
        self.span_ids: set[int] | None = None
        self.touched = self.created
        self.held_bytes = 0
        # ``worker`` (the process its root ran in, when another one's: the collector sets it from
        # its sender's resource) is left unset here, off the hot path: read with worker_of(state)
        #: every record was converted by the one-process worker with no value that is not
        #: plain JSON data (``Converter.unplain``): True lets finish() vouch for it; None
        #: (records made any other way: the collector, log_rollout_batch) or False do not
        self.plain: bool | None = None
        #: the one-process worker: ``builder.coordinates()`` of this state, made when its
        #: first span was converted, whose ``rl.*`` stamp every record of it then got at
        #: conversion (finish() does not stamp them again); None: records made any other way
        self.coordinates: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None
        #: a rollout recorded as a summary only (made from a :class:`Tally`): its records are
        #: its root and a light record per generation and tool call, enough for its summary
        #: and the first phase of the health checks; it is never kept
        self.summary_only = False
        #: the collector: the summary a worker made of a rollout it recorded as a summary only
        #: (its annotations and the collector's checks are added when it is counted)
        self.summary: Any = None
        #: collector: a rollout its worker recorded as a summary only and sent in full after all
        #: (failed, truncated, unhealthy: ``rtrace.promoted`` on its root): a candidate for the
        #: step's tail, never for its sample (its rank is above the workers' pre-sample rate)
        self.promoted = False

    def add(self, record: SpanRecord) -> None:
        """Add a converted span to ``records`` (the list is made by the first one)."""
        if self.records:
            self.records.append(record)  # type: ignore[attr-defined]
        else:
            self.records = [record]


def worker_of(state: TrajectoryState) -> str | None:
    """The process a state's root ran in, when the collector set it (its sender's OTLP
    resource); None otherwise (one process: the pipeline's own)."""
    return getattr(state, "worker", None)


class Mark:
    """One decorated call inside a rollout recorded as a summary only (a :class:`Tally`):
    what a :class:`CallRecord` holds, with the call's times and failure, and no span.

    The pipeline reads it as it reads one of rtrace's spans: the generation's token counts
    and finish reason come from the same code as a recorded call's (pipeline/summaries.py),
    and a rollout the worker sends in full after all (collector mode: an error, a
    truncation) is converted from its marks as from spans. It keeps no parent: finding the
    enclosing call would cost every summarized call a context variable; a promoted
    rollout's nesting is rebuilt from the times (``summaries.records_of_tally``).
    """

    __slots__ = ("spec", "args", "kwargs", "arg_lens", "output", "has_output", "owner_name", "start_time",
                 "end_time", "error")

    def __init__(self, spec: CallSpec, start_time: int) -> None:
        self.spec = spec
        self.start_time = start_time
        # (``_capture`` sets args, kwargs and arg_lens of a captured call at once)
        self.args = self.kwargs = self.arg_lens = self.output = self.owner_name = self.end_time = None
        self.has_output = False
        #: ``"<ExceptionType>: <message>"`` when the call raised (bounded), else None
        self.error: str | None = None

    def fail(self, exc: BaseException) -> None:
        """The call raised ``exc`` (never raises itself)."""
        self.error = error_text(exc)

    def end(self) -> None:
        self.end_time = time.time_ns()


class Tally:
    """A rollout recorded as a summary only: sampled out when it started
    (``max_traces_per_step`` in one process, ``RTRACE_PRE_SAMPLE_RATE`` in a collector's
    worker) while ``RTRACE_SUMMARIES`` is on. The hot path appends a :class:`Mark` per
    decorated call and sets the reward and outcome; when the rollout ends it is handed to
    the pipeline (``Pipeline.submit_tallies``), which makes its summary
    (:class:`~rtrace.summary.RolloutSummary`) so the step metrics count it.

    Fields written by the hot path: all of them, until ``end_ns`` is set; the pipeline
    reads it only after that.
    """

    __slots__ = ("trace_id", "name", "kind", "coords", "start_ns", "end_ns", "error", "reward", "has_reward",
                 "outcome", "marks", "dropped_marks", "intake")

    #: a root call's record is the tally itself: nothing of its own call is captured
    args = None

    def __init__(self, trace_id: int, name: str, kind: str, coords: dict[str, Any], start_ns: int,
                 intake: Any = None) -> None:
        self.trace_id = trace_id
        self.name = name
        self.kind = kind
        self.coords = coords
        self.start_ns = start_ns
        self.end_ns: int | None = None
        #: the root's failure (``"<ExceptionType>: <message>"``), else None
        self.error: str | None = None
        self.reward: Any = None
        self.has_reward = False
        self.outcome: dict[str, Any] = {}
        #: the rollout's decorated calls, in the order they started (bounded by
        #: ``max_spans_per_trajectory``: the rest are counted in ``dropped_marks``)
        self.marks: list[Mark] = []
        self.dropped_marks = 0
        #: its ``submit_tallies([self])`` is called when the rollout ends (the pipeline; not the
        #: bound method: one object less per rollout kept alive for Python's GC)
        self.intake = intake

    def fail(self, exc: BaseException) -> None:
        """The rollout (its root) raised ``exc`` (never raises itself)."""
        self.error = error_text(exc)

    def end(self) -> None:
        """The rollout ended: hand it to the pipeline (once)."""
        if self.end_ns is not None:
            return
        self.end_ns = time.time_ns()
        intake = self.intake
        if intake is not None:
            intake.submit_tallies([self])


#: The longest exception text a summarized call keeps, as a recorded span's status (the
#: worker bounds it to max_value_chars, as a span's; a summary keeps less).
_ERROR_CHARS = 65_536


def error_text(exc: BaseException) -> str:
    """``"<ExceptionType>: <message>"``, bounded; never raises (an exception whose
    ``__str__`` raises reaches the program unchanged)."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception failed>"
    return f"{type(exc).__name__}: {text[:_ERROR_CHARS]}"
