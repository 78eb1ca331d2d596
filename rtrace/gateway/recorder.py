"""A model call through the gateway is a generation span, made the way ``@traced_generation`` makes one.

The span is opened through the runtime's tracer, in the trajectory the call joins
(:class:`Join`), and carries the same call record a decorated generation carries: its
inputs (the client's request: ``model``, ``messages`` or ``prompt``, ``tools``, sampling
parameters, plus ``prompt_ids``) and its output (the reply the client got, its
``finish_reason`` and ``response_ids``). From there nothing is special: the worker (or the
collector) converts the record (token ids out, usage and finish reason as ``gen_ai.*``
attributes, ``rl.*`` stamped), health checks, sampling, annotations, token2text, the
conversation and every sink treat it as any generation.

What a decorated call cannot know is put on the span as attributes (docs/gateway.md,
"What each call records"): ``rtrace.response_logprobs``, ``rtrace.capture_gap``,
``rtrace.time_to_first_token_ms``, the upstream's ``gen_ai.response.id`` /
``gen_ai.response.model``, its usage when there are no ids, and its weight version
(``rtrace.weight_version``; ``rl.policy_version`` when it is an integer).

How a call joins (:class:`Join`), mirroring ``rtrace.extract``:

* ``session``: a child of the session's root span (or of the caller's span, when its
  ``traceparent`` names one in the session's trace);
* ``segment``: a rollout key or a ``traceparent`` names a span of a trajectory that lives
  elsewhere (the trainer's process): the call's span is a segment under that span, exported
  as its own unit here and stitched into the trainer's trajectory by the collector, or
  joined directly when the trajectory is open in this very process;
* ``own``: no rollout at all (``RTRACE_GATEWAY_UNTRACED=record``): the call is a trajectory
  of its own.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from .. import _stats
from ..instrumentation import _state
from ..instrumentation.propagation import close_segment, open_segment
from ..instrumentation.spans import RSpan
from ..pipeline.records import CallRecord, CallSpec
from .protocol import CHAT

__all__ = ["Join", "Call", "open_call", "SPECS", "remote_context"]

#: The call record's spec of each kind of model call (what a decorator decides once).
SPECS = {
    kind: CallSpec(kind="generation", name=op, capture=True, param_names=(), skip_first=False, options={})
    for kind, op in (("chat", "chat"), ("completions", "text_completion"))
}
_OPERATION = {"chat": "chat", "completions": "text_completion"}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def remote_context(trace_id: int, span_id: int, sampled: bool = True) -> SpanContext:
    """The SpanContext of a span in another process (a key's, a ``traceparent``'s)."""
    return SpanContext(trace_id, span_id, is_remote=True,
                       trace_flags=_SAMPLED if sampled else TraceFlags(TraceFlags.DEFAULT))


class Join:
    """How one call joins a trajectory: ``mode`` is ``session``, ``segment``, ``own`` or
    ``untraced`` (forwarded, not recorded); ``how`` says what the caller gave (``key``,
    ``traceparent``, ``session``, ``none``)."""

    __slots__ = ("mode", "how", "remote", "coords", "session")

    def __init__(self, mode: str, how: str, remote: SpanContext | None = None, coords: dict[str, Any] | None = None,
                 session: Any = None) -> None:
        self.mode = mode
        self.how = how
        self.remote = remote
        self.coords = coords or {}
        self.session = session


class Call:
    """One model call being recorded: its span and the trajectory it belongs to."""

    __slots__ = ("span", "state", "kind", "join", "registry", "segment")

    def __init__(self, span: Any, state: Any, kind: str, join: Join, registry: Any, segment: bool) -> None:
        self.span = span
        self.state = state
        self.kind = kind
        self.join = join
        self.registry = registry
        self.segment = segment

    @property
    def traceparent(self) -> str:
        """The W3C ``traceparent`` of the call's span (sent upstream: a traced server's
        spans become its children)."""
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"

    def finish(self, inputs: dict[str, Any] | None, output: dict[str, Any] | None, attributes: dict[str, Any],
               error: str | None, capture: bool) -> None:
        """Give the span its call record and attributes, and end it (its trajectory's
        worker takes it from there). Never raises: a failure is counted."""
        span = self.span
        try:
            try:
                if type(span) is RSpan:  # the span carries its record, as a decorated call's does
                    record: Any = span
                    self.state.captures.pop(span.span_id, None)  # a segment's placeholder record
                else:  # an application's SDK span: the record waits in the trajectory's captures
                    record = CallRecord(SPECS[self.kind], None, None)
                    self.state.captures[span.get_span_context().span_id] = record
                record.spec = SPECS[self.kind]
                record.arg_lens = None
                record.owner_name = None
                if capture and inputs is not None:
                    record.args, record.kwargs = (), inputs
                    record.output, record.has_output = output, output is not None
                else:
                    record.args = record.kwargs = record.output = None
                    record.has_output = False
                attributes["gen_ai.operation.name"] = _OPERATION[self.kind]
                span.set_attributes(attributes)
                if error is not None:
                    span.set_status(Status(StatusCode.ERROR, error))
            except Exception:
                _stats.incr("gateway_record_errors")
                _stats.warn_once("gateway-record", "rtrace gateway could not record a call (it went through)",
                                 exc_info=True)
        finally:
            try:
                if self.segment:
                    close_segment(span, self.registry)
                else:
                    span.end()
            except Exception:
                _stats.incr("gateway_record_errors")


def open_call(rt: Any, join: Join, kind: str, model: Any) -> Call | None:
    """Open the span of one model call in the trajectory ``join`` names; None when it is
    not recorded (the trajectory table is full, or the session's trajectory has gone)."""
    op = _OPERATION[kind]
    name = f"{op} {model}" if isinstance(model, str) and model else op
    mode = join.mode
    if mode == "session":
        session = join.session
        state = session.state
        if rt.registry.lookup(state.trace_id) is not state:
            return None  # expired as an orphan meanwhile
        remote = join.remote
        parent: Any = NonRecordingSpan(remote) if remote is not None and remote.trace_id == state.trace_id \
            else session.span
        span = rt.tracer.start_span(name, context=otel_trace.set_span_in_context(parent))
        return Call(span, state, kind, join, rt.registry, False)
    if mode == "segment":
        remote = join.remote
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(remote))
        span, frame = open_segment(rt, remote, ctx, name, join.coords)
        if span is None or frame.state is None:
            return None
        return Call(span, frame.state, kind, join, rt.registry, True)
    if mode == "own":
        span, frame = _state.start_root(rt, name, "generation", dict(join.coords))
        if span is None:
            return None
        return Call(span, frame.state, kind, join, rt.registry, False)
    return None


def is_chat(kind: str) -> bool:
    return kind == CHAT
