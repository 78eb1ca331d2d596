"""rtrace's own spans on the hot path: small records that are OTel spans to everyone else.

The OTel SDK's span object costs ~20-25 µs to start and end here (a sampler, bounded
attribute and event containers, a lock, a ReadableSpan copy at ``end``, the processor
chain), most of what a traced call costs. When rtrace owns its TracerProvider (the
application set none globally), nothing but rtrace ever sees its spans, so none of that
machinery is needed: :class:`SpanTracer` makes :class:`RSpan` s, a few slots each, and
hands each ended one straight to the pipeline's span processor.

An :class:`RSpan` *is* an ``opentelemetry.trace.Span``: ``trace.get_current_span()``
returns it, its ``get_span_context()`` is a real ``SpanContext`` (propagation, ``inject``,
application spans made inside it by another tracer all use it), and it records status,
events and exceptions the way the SDK does. It also reads like the SDK's
``ReadableSpan`` for the worker (``context``, ``parent``, ``name``, times, ``status``,
``attributes``, ``events``): spans become SpanRecords there (pipeline/builder.py), and OTel
SDK spans only in a sink that needs them (the one OTel conversion, exporters/otel.py).

Sampling follows the SDK's default (``ParentBased(ALWAYS_ON)``): a span whose parent is
valid but not sampled (an unsampled remote ``traceparent``) does not record. On an
application's provider rtrace keeps using the SDK's tracer, so the application's own
processors, exporters and sampler see rtrace's spans as before.
"""

from __future__ import annotations

import traceback
from time import time_ns
from typing import Any, Callable, Mapping, Sequence

from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from .._ids import span_id as _new_span_id
from .._ids import trace_id as _new_trace_id
from ._otel_private import current_span as _current_span
from ._otel_private import current_value as _current_value
from ._otel_private import span_context as _span_context

__all__ = ["RSpan", "SpanTracer", "Event"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NO_STATE = SpanContext(1, 1, False).trace_state  # the API's DEFAULT_TRACE_STATE
_UNSET = Status(StatusCode.UNSET)
_get_current_span = otel_trace.get_current_span


class Event:
    """A span event, read like the SDK's (``name``, ``timestamp``, ``attributes``)."""

    __slots__ = ("name", "timestamp", "attributes")

    def __init__(self, name: str, attributes: Mapping[str, Any] | None, timestamp: int) -> None:
        self.name = name
        self.attributes = dict(attributes) if attributes else {}
        self.timestamp = timestamp


class RSpan(otel_trace.Span):
    """One span of rtrace's: an OTel API span, recorded as plain fields."""

    __slots__ = ("name", "trace_id", "span_id", "trace_state", "_context", "parent_ref", "start_time", "end_time",
                 "_attributes", "_events", "status", "links", "_on_end",
                 # what a decorated call saw, when ``spec`` is set: a CallRecord's fields
                 # (pipeline/records.py) kept on the span itself, one object less per call
                 "spec", "args", "kwargs", "arg_lens", "output", "has_output", "owner_name")

    def __init__(self, name: str, trace_id: int, span_id: int, trace_state: Any, parent: "RSpan | SpanContext | None",
                 attributes: Mapping[str, Any] | None, links: Sequence[Any] | None,
                 on_end: Callable[["RSpan"], None]) -> None:
        self.name = name
        #: the ids, valid and sampled (rtrace's own, never 0); the SpanContext is made
        #: when first asked for: a span waiting in the pipeline is one object less for
        #: Python's GC to walk
        self.trace_id = trace_id
        self.span_id = span_id
        self.trace_state = trace_state
        self._context: SpanContext | None = None
        #: the parent span (one of rtrace's) or its SpanContext (another tracer's, remote):
        #: both have ``trace_id`` and ``span_id``, which the worker reads without making a
        #: SpanContext (pipeline/builder.py)
        self.parent_ref = parent
        #: (the worker reads these two as they are: pipeline/builder.py)
        self._attributes = dict(attributes) if attributes else None
        self._events: list[Event] | None = None
        self.status = _UNSET
        self.links = tuple(links) if links else ()
        self._on_end = on_end
        self.spec = None  # not a decorated call's (the decorators set it, and the record's fields)
        self.end_time: int | None = None
        self.start_time = time_ns()

    # ------------------------------------------------------------------ ReadableSpan, for the worker
    @property
    def context(self) -> SpanContext:
        ctx = self._context
        if ctx is None:
            ctx = self._context = _span_context(self.trace_id, self.span_id, _SAMPLED, self.trace_state)
        return ctx

    @property
    def parent(self) -> SpanContext | None:
        parent = self.parent_ref
        return parent.context if type(parent) is RSpan else parent

    @property
    def attributes(self) -> Mapping[str, Any]:
        return self._attributes or {}

    @property
    def events(self) -> Sequence[Event]:
        return self._events or ()

    # ------------------------------------------------------------------ opentelemetry.trace.Span
    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return  # ended twice: the SDK warns and ignores it too
        self.end_time = end_time if end_time is not None else time_ns()
        self._on_end(self)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            if self._attributes is None:
                self._attributes = {}
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is None and attributes:
            if self._attributes is None:
                self._attributes = {}
            self._attributes.update(attributes)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self.end_time is None:
            if self._events is None:
                self._events = []
            self._events.append(Event(name, attributes, timestamp if timestamp is not None else time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links += (otel_trace.Link(context, attributes),)

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # the SDK's rules: OK is final, UNSET never overwrites
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self.status = status
        elif status is not StatusCode.UNSET:
            self.status = Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """The SDK's ``exception`` event, with the same attributes."""
        cls = type(exception)
        module = cls.__module__
        attrs: dict[str, Any] = {
            "exception.type": f"{module}.{cls.__qualname__}" if module and module != "builtins" else cls.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(cls, exception, exception.__traceback__)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def __repr__(self) -> str:
        return f"RSpan(name={self.name!r}, trace_id=0x{self.trace_id:032x}, span_id=0x{self.span_id:016x})"


class SpanTracer(otel_trace.Tracer):
    """Makes :class:`RSpan` s; every ended one goes to ``on_end`` (the pipeline's processor)."""

    def __init__(self, on_end: Callable[[Any], None]) -> None:
        self.on_end = on_end

    def start_root(self, name: str, links: Sequence[Any] | None = None,
                   attributes: Mapping[str, Any] | None = None) -> otel_trace.Span:
        """``start_span(name, context=Context(), links=links, attributes=attributes)``: a
        span in a new trace (a trajectory's root)."""
        return RSpan(name, _new_trace_id(), _new_span_id(), _NO_STATE, None, attributes, links, self.on_end)

    def start_child(self, name: str) -> otel_trace.Span:
        """``start_span(name)`` in the current context, the decorators' usual case: the
        child of one of rtrace's own spans is made without the general path's checks."""
        parent = _current_value()
        if type(parent) is not RSpan:
            return self.start_span(name)
        # always valid and sampled
        return RSpan(name, parent.trace_id, _new_span_id(), parent.trace_state, parent, None, None, self.on_end)

    def start_span(self, name: str, context: Any = None, kind: Any = None, attributes: Mapping[str, Any] | None = None,
                   links: Sequence[Any] | None = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> otel_trace.Span:
        parent = (_current_span() if context is None else _get_current_span(context)).get_span_context()
        if parent.is_valid:
            if not parent.trace_flags.sampled:  # ParentBased: an unsampled parent's children are not recorded
                return NonRecordingSpan(SpanContext(parent.trace_id, _new_span_id(), False, parent.trace_flags,
                                                    parent.trace_state))
            span = RSpan(name, parent.trace_id, _new_span_id(), parent.trace_state, parent, attributes, links,
                         self.on_end)
        else:
            span = self.start_root(name, links, attributes)
        if start_time is not None:
            span.start_time = start_time
        return span

    def start_as_current_span(self, name: str, context: Any = None, kind: Any = None,
                              attributes: Mapping[str, Any] | None = None, links: Sequence[Any] | None = None,
                              start_time: int | None = None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True) -> Any:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return otel_trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                   set_status_on_exception=set_status_on_exception)
