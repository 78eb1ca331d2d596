"""Trajectories that cross processes: ``inject`` in the driver, ``extract`` in the worker.

::

    driver                                           worker process / inference server
    with rtrace.rollout_context(step=3, ...):        with rtrace.extract(carrier):
        carrier = rtrace.inject({})   ---- dict ---->     run_tool(...)   # @traced_tool
        pool.submit(task, carrier)   HTTP headers,
                                     Ray kwargs...

``inject`` writes W3C ``traceparent`` (+ ``tracestate``) for the current span and W3C
``baggage`` with the trajectory's RL coordinates (``rl.step``, ``rl.sample_index``, ...,
``rl.extra.<key>``). ``extract`` restores both: spans made inside are children of the
driver's span, in the driver's trace, and carry the driver's coordinates.

The worker never sees the driver's root span end, so what it records is exported as its
own unit, a *segment*: ``extract`` opens a local span (kind ``segment``, name ``segment``
unless given) whose parent is the remote span, and registers it as a trajectory root.
The driver decided sampling: the segment is recorded when the ``traceparent`` sampled
flag is set (never subject to the worker's ``max_traces_per_step``); an untraced driver
trajectory propagates the flag cleared and the worker records nothing.

Segments of one trace in one process share one unit, because rtrace's open-trajectory
table is keyed by trace id: concurrent ``extract`` of the same trace (threads, asyncio
tasks) join the unit, each with its own segment span under its own remote parent, and
the unit is exported when the last of them exits (the root of a unit is always a
segment span still open, so none of its spans arrives late). A segment that starts
while the previous unit of its trace is ended but not yet assembled rejoins that unit.
When the trace is already open in this process because the driver runs here (threads,
in-process servers), ``extract`` joins the driver's trajectory instead.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping, MutableMapping

from opentelemetry import baggage as otel_baggage
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import _ids, _stats
from ..pipeline.records import CallRecord, CallSpec, TrajectoryState
from . import _state
from .decorators import fail_span

__all__ = ["inject", "extract", "Extracted", "BAGGAGE_PREFIX"]

#: Baggage keys of RL coordinates: ``rl.<field>`` and ``rl.extra.<key>``.
BAGGAGE_PREFIX = "rl."

#: Marks segment spans as kind ``segment`` in the trajectory (no arguments captured).
_SEGMENT_SPEC = CallSpec(kind="segment", name="segment", capture=False, param_names=(), skip_first=False,
                         options={})

_TRACE_CONTEXT = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()


# ----------------------------------------------------------------------------- values
# Baggage values are strings. A coordinate is written as its JSON text, except a string
# that is not itself JSON text (the usual "p17"), which is written as is and stays
# readable in a backend. Reading tries JSON first, so 3 -> "3" -> 3, False -> "false" ->
# False, "p17" -> "p17" -> "p17", and the string "3" -> '"3"' -> "3" round-trip exactly.


def _encode(value: Any) -> str:
    if isinstance(value, str) and value == value.strip():
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, default=str, separators=(",", ":"))


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class _CaseInsensitiveGetter(Getter[Mapping[str, Any]]):
    """Reads ``traceparent`` from a dict, HTTP headers (any case) or Ray/multiprocessing kwargs."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            lowered = key.lower()
            for k, v in carrier.items():
                if isinstance(k, str) and k.lower() == lowered:
                    value = v
                    break
        if value is None:
            return None
        return list(value) if isinstance(value, (list, tuple)) else [str(value)]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier.keys())


_GETTER = _CaseInsensitiveGetter()


# ----------------------------------------------------------------------------- inject


def inject(carrier: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Write the current trace context and RL coordinates into ``carrier``.

    Adds ``traceparent`` (and ``tracestate``) for the current span, and ``baggage``
    with the open trajectory's coordinates (``rl.step=3,rl.sample_index=17,...``) plus
    any OTel baggage already in the context. Pass the carrier to the other process (a
    task's kwargs, HTTP headers, a message) and open :func:`extract` there.

    Inside a trajectory that is not traced (sampled out), ``traceparent`` has the
    sampled flag cleared, so the worker records nothing either. Outside any trajectory,
    only an application's current span (if any) and baggage are written.

    Args:
        carrier: a mutable mapping to write into; a new dict when omitted.

    Returns:
        The carrier.
    """
    if carrier is None:
        carrier = {}
    try:
        ctx = otel_context.get_current()
        frame = _state.FRAME.get()
        if frame is not None:
            if frame.state is None:
                # The driver decided not to record this trajectory: say so downstream.
                current = otel_trace.get_current_span(ctx).get_span_context()
                if current.is_valid:
                    unsampled = SpanContext(current.trace_id, current.span_id, is_remote=False,
                                            trace_flags=TraceFlags(TraceFlags.DEFAULT),
                                            trace_state=current.trace_state)
                else:
                    unsampled = SpanContext(_ids.trace_id(), _ids.span_id(),
                                            is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT))
                ctx = otel_trace.set_span_in_context(NonRecordingSpan(unsampled), ctx)
            for key, value in frame.coords.items():
                if key == "extra":
                    for ekey, evalue in (value or {}).items():
                        ctx = otel_baggage.set_baggage(f"{BAGGAGE_PREFIX}extra.{ekey}", _encode(evalue), ctx)
                elif value is not None:
                    ctx = otel_baggage.set_baggage(BAGGAGE_PREFIX + key, _encode(value), ctx)
        _TRACE_CONTEXT.inject(carrier, ctx)
        _BAGGAGE.inject(carrier, ctx)
    except Exception:  # telemetry never breaks the traced program
        _stats.incr("internal_errors")
        _stats.warn_once("inject", "rtrace.inject could not write the trace context", exc_info=True)
    return carrier


def _coordinates(ctx: Any) -> dict[str, Any]:
    coords: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in otel_baggage.get_all(ctx).items():
        if not key.startswith(BAGGAGE_PREFIX) or not isinstance(value, str):
            continue
        name = key[len(BAGGAGE_PREFIX):]
        if name.startswith("extra."):
            extra[name[len("extra."):]] = _decode(value)
        elif name:
            coords[name] = _decode(value)
    if extra:
        coords["extra"] = extra
    return coords


def baggage_coordinates(carrier: Mapping[str, Any]) -> dict[str, Any]:
    """The RL coordinates :func:`inject` wrote as W3C ``baggage`` into ``carrier`` (HTTP
    headers, any letter case); {} when there are none."""
    return _coordinates(_BAGGAGE.extract(carrier, context=otel_context.Context(), getter=_GETTER))


# ----------------------------------------------------------------------------- segments


class _Unit:
    """The segments of one trace open in this process, exported together."""

    __slots__ = ("state", "active")

    def __init__(self, state: TrajectoryState) -> None:
        self.state = state
        #: span id -> segment span, for every segment of the unit not exited yet
        self.active: dict[int, Any] = {}


_lock = threading.Lock()
#: trace id -> the unit this process opened for it (removed once its root has ended)
_units: dict[int, _Unit] = {}
#: trace id -> a unit whose root has ended but may not have been assembled yet
_closing: dict[int, _Unit] = {}
#: _closing's size at which it is next swept of assembled units
_sweep = [64]


def open_segment(rt: _state.Runtime, remote: SpanContext, ctx: Any, name: str,
                 coords: dict[str, Any]) -> tuple[Any, _state.Frame]:
    """Start a segment span under ``remote`` (in context ``ctx``) and attach it to a unit (new
    or shared); ``(span, frame)``, span None when the trajectory table is full. The span is
    recorded as kind ``segment`` unless the caller gives it a call record of its own (the
    capture gateway's model calls: rtrace/gateway/recorder.py). End it with
    :func:`close_segment`."""
    tid = remote.trace_id
    registry = rt.registry
    attrs = {"rtrace.remote_parent": format(remote.span_id, "016x")}
    with _lock:
        unit = _units.get(tid)
        if unit is not None and registry.lookup(tid) is not unit.state:
            # left over from an earlier configure() (or expired as an orphan): start afresh
            del _units[tid]
            unit = None
        if unit is None:
            closing = _closing.pop(tid, None)
            owner = registry.lookup(tid)
            if owner is not None and (closing is None or owner is not closing.state):
                # The trace's trajectory is open in this very process (the driver runs
                # here): the segment is part of it, no unit of its own.
                span = rt.tracer.start_span(name, context=ctx, attributes=attrs)
                owner.captures[span.get_span_context().span_id] = CallRecord(_SEGMENT_SPEC, None, None)
                _stats.incr("segments_joined_local")
                return span, _state.Frame(coords, owner)
            span = rt.tracer.start_span(name, context=ctx, attributes=attrs)
            sid = span.get_span_context().span_id
            if owner is not None and registry.set_root(closing.state, sid):
                # The previous unit of this trace ended but the worker has not seen its
                # root yet: this segment is the unit's root again, so nothing is late.
                # (set_root and the worker's root check share the registry's lock.)
                unit = closing
            if unit is None:
                state = TrajectoryState(tid, sid, name, "segment", coords)
                state.remote_parent = remote.span_id
                if not registry.register(state):
                    span.end()
                    return None, _state.Frame(coords, None)
                unit = _Unit(state)
                _stats.incr("segments_started")
            _units[tid] = unit
        else:
            span = rt.tracer.start_span(name, context=ctx, attributes=attrs)
            sid = span.get_span_context().span_id
            _stats.incr("segments_joined")
        unit.active[sid] = span
        unit.state.captures[sid] = CallRecord(_SEGMENT_SPEC, None, None)
    return span, _state.Frame(coords, unit.state)


def close_segment(span: Any, registry: Any = None) -> None:
    """End a segment span; the unit's root is always a segment still open, so the last
    segment to exit is the one whose end completes the unit. ``registry``: the one of the
    runtime that opened it (default: the configured runtime's)."""
    ctx = span.get_span_context()
    tid, sid = ctx.trace_id, ctx.span_id
    if registry is None:
        registry = rt_registry()
    with _lock:
        unit = _units.get(tid)
        if unit is None or sid not in unit.active:  # joined a local trajectory: just end it
            unit = None
        else:
            del unit.active[sid]
            if unit.active:
                if registry is not None:
                    registry.set_root(unit.state, next(iter(unit.active)))
            else:
                if registry is not None:
                    registry.set_root(unit.state, sid)
                del _units[tid]
                _closing[tid] = unit
                if len(_closing) > _sweep[0] and registry is not None:
                    # a unit the worker has assembled (it left the table) can no longer be rejoined:
                    # forget those, and the records they hold (a capture gateway closes hundreds
                    # of units a second, each holding its calls' token ids and messages); the next
                    # sweep waits until the table doubled (amortised: O(1) per close)
                    for key in [k for k, u in _closing.items() if registry.lookup(k) is not u.state]:
                        del _closing[key]
                    _sweep[0] = max(64, 2 * len(_closing))
                if len(_closing) > 1024:  # bounded: forget the oldest; they are long assembled
                    del _closing[next(iter(_closing))]
    span.end()


def rt_registry() -> Any:
    rt = _state.runtime
    return None if rt is None or rt is _state.UNSET else rt.registry


class Extracted:
    """The context manager returned by :func:`extract` (sync and async ``with``)."""

    __slots__ = ("_carrier", "_name", "_span", "_frame", "_frame_token", "_ctx_token", "_remote")

    def __init__(self, carrier: Mapping[str, Any], name: str) -> None:
        self._carrier = carrier
        self._name = name
        self._span: Any = None
        self._frame: _state.Frame | None = None
        self._frame_token: Any = None
        self._ctx_token: Any = None
        self._remote: SpanContext | None = None

    @property
    def coordinates(self) -> dict[str, Any]:
        """The RL coordinates restored from the carrier ({} when it had none)."""
        return dict(self._frame.coords) if self._frame is not None else {}

    @property
    def traced(self) -> bool:
        """True when spans made inside are recorded (a sampled driver trajectory)."""
        return self._frame is not None and self._frame.state is not None

    @property
    def trace_id(self) -> str | None:
        """The driver's trace id (32 hex digits), or None without a valid traceparent."""
        return format(self._remote.trace_id, "032x") if self._remote is not None else None

    def __enter__(self) -> "Extracted":
        try:
            self._enter()
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("extract", "rtrace.extract could not restore the trace context; the code runs "
                             "untraced", exc_info=True)
        return self

    def _enter(self) -> None:
        ctx = _TRACE_CONTEXT.extract(self._carrier, context=otel_context.get_current(), getter=_GETTER)
        ctx = _BAGGAGE.extract(self._carrier, context=ctx, getter=_GETTER)
        remote = otel_trace.get_current_span(ctx).get_span_context()
        if not remote.is_valid:
            # No trajectory to join: only the baggage is restored; decorated calls start
            # their own trajectories as usual.
            self._ctx_token = otel_context.attach(ctx)
            return
        self._remote = remote
        coords = _coordinates(ctx)
        frame = _state.Frame(coords, None)
        rt = _state.get_runtime()
        if rt is not None and remote.trace_flags.sampled:
            self._span, frame = open_segment(rt, remote, ctx, self._name, coords)
            if self._span is not None:
                ctx = otel_trace.set_span_in_context(self._span, ctx)
        self._frame = frame
        self._frame_token = _state.FRAME.set(frame)
        self._ctx_token = otel_context.attach(ctx)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._ctx_token is not None:
            otel_context.detach(self._ctx_token)
            self._ctx_token = None
        if self._frame_token is not None:
            _state.FRAME.reset(self._frame_token)
            self._frame_token = None
        span, self._span = self._span, None
        if span is None:
            return
        try:
            if exc is not None:
                fail_span(span, exc)
            close_segment(span)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("extract-exit", "rtrace.extract could not close its segment", exc_info=True)

    async def __aenter__(self) -> "Extracted":
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)


def extract(carrier: Mapping[str, Any], *, name: str = "segment") -> Extracted:
    """Continue, in this process, the trajectory that :func:`inject` wrote into ``carrier``.

    Use as ``with rtrace.extract(carrier): ...`` (or ``async with``). Inside, decorated
    calls are spans of the driver's trace, children of the span that was current at
    ``inject``, and :func:`rtrace.current_coordinates` / the exported ``rl.*``
    attributes are the driver's coordinates. The spans made inside are exported as one
    unit whose root is a span named ``name`` (kind ``segment``, attribute
    ``rtrace.remote_parent`` = the driver's span id), when the block exits.

    ``carrier`` may be a dict, HTTP headers (any letter case) or a task's kwargs. With
    no valid ``traceparent`` only the baggage is restored; with the sampled flag
    cleared, the coordinates are restored and nothing is recorded.

    Args:
        name: the segment span's name.
    """
    return Extracted(carrier, name)

