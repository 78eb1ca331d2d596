"""A model call through the gateway is a generation span, made the way ``@traced_generation`` makes one.

The span is opened through the runtime's tracer, in the trajectory the call joins
(:class:`Join`), and carries the same call record a decorated generation carries: its
inputs (the client's request: ``model``, ``messages`` or ``prompt``, ``tools``, sampling
parameters, plus ``prompt_ids``) and its output (the reply the client got, its
``finish_reason`` and ``response_ids``). From there nothing is special: the worker (or the
collector) converts the record (token ids out, usage and finish reason as ``gen_ai.*``
attributes, ``rl.*`` stamped), health checks, sampling, annotations, token2text, the
conversation and every sink treat it as any generation.

On the event loop a call keeps references only (:class:`Record`: the request as parsed,
the answer's bytes as the upstream sent them, when each streamed event arrived) and ends its
span; the answer is read in rtrace's worker thread when the span is converted
(:class:`Reading`, a :class:`~rtrace.pipeline.records.Deferred`): a call's answer is parsed
once, off the call's path.

What a decorated call cannot know is put on the span as attributes (docs/gateway.md,
"What each call records"): the sampler's logprobs as the generation's per-token ``logprob``
array (docs/token-values.md), ``rtrace.capture_gap``,
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

import time
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from .. import _stats
from ..instrumentation import _state
from ..instrumentation.propagation import close_segment, open_segment
from ..instrumentation.spans import RSpan
from ..pipeline.records import CallRecord, CallSpec, Deferred
from .protocol import RESPONSES, Capture, loads
from .responses import chat_messages

__all__ = ["Join", "Call", "Record", "Reading", "open_call", "SPECS", "remote_context"]

#: The call record's spec of each kind of model call (what a decorator decides once).
SPECS = {
    kind: CallSpec(kind="generation", name=op, capture=True, param_names=(), skip_first=False, options={})
    for kind, op in (("chat", "chat"), ("completions", "text_completion"), ("responses", "chat"))
}
_OPERATION = {"chat": "chat", "completions": "text_completion", "responses": "chat"}
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

    def finish(self, reading: "Reading", error: str | None) -> None:
        """Give the span its record (``reading``, read in the worker) and end it (its
        trajectory's worker takes it from there). Never raises: a failure is counted."""
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
                record.args, record.kwargs = (), reading
                record.output, record.has_output = None, False
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


class Record:
    """What one recorded call keeps on the event loop, and its end (once, whatever happens):
    references only, read in the worker (:class:`Reading`)."""

    __slots__ = ("settings", "runtime", "call", "kind", "payload", "asked", "gaps", "status", "capturing", "done",
                 "started", "raw", "data", "events", "ended", "upstream")

    def __init__(self, call: Call, kind: str, payload: dict[str, Any], asked: Any, settings: Any,
                 runtime: Any, upstream: Any = None) -> None:
        self.settings = settings
        self.runtime = runtime
        #: what the upstream is (app.UpstreamIdentity: its ``provider``, read in the worker)
        self.upstream = upstream
        self.call = call
        self.kind = kind
        self.payload = payload
        self.asked = asked
        self.gaps: list[tuple[str, str]] = []
        self.status = 0
        self.capturing = True
        self.done = False
        self.started = time.time_ns()
        #: a whole answer: its bytes as the upstream sent them, or the parsed object when the
        #: event loop had to parse it (to take out what the gateway asked for)
        self.raw: bytes | None = None
        self.data: dict[str, Any] | None = None
        #: a stream: ``(time.time_ns() at arrival, the event's data)`` of each data event
        self.events: list[tuple[int, bytes]] = []
        #: the client closed a stream once its end had reached it: complete, whatever came after
        self.ended = False

    def gap(self, code: str, detail: str) -> None:
        self.gaps.append((code, detail))

    def finish(self, error: str | None = None) -> None:
        """End the call's span; its record is read later, in the worker (called once; never raises)."""
        if self.done:
            return
        self.done = True
        capture = True
        try:
            capture = bool(self.runtime().capture)
        except Exception:
            pass
        self.call.finish(Reading(self, error, capture), error)


class Reading(Deferred):
    """A call's record as the worker reads it (:meth:`resolve`, once): the answer parsed,
    the reply the client got, the ids, logprobs, version, usage, time to first token, gaps."""

    __slots__ = ("record", "error", "capture")

    def __init__(self, record: Record, error: str | None, capture: bool) -> None:
        self.record = record
        self.error = error
        self.capture = capture

    def resolve(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
        rec = self.record
        cap = Capture(rec.kind)
        gaps = list(rec.gaps)  # what the loop noted (too large, unreadable)
        if rec.data is not None:
            cap.response(rec.data)
        elif rec.raw is not None:
            try:
                data = loads(rec.raw)
            except ValueError:
                data = None
            if type(data) is dict:
                cap.response(data)
            elif rec.status == 200:
                gaps.append(("unreadable", "the upstream's answer is not a JSON object"))
        for at, event in rec.events:
            if event == b"[DONE]":
                cap.done = True
                continue
            try:
                obj = loads(event)
            except ValueError:
                continue
            if type(obj) is dict:
                try:
                    cap.chunk(obj, at)
                except Exception:
                    _stats.incr("gateway_record_errors")
        inputs, output, attrs = self._record(cap, gaps)
        if not self.capture:
            return None, None, attrs
        return inputs, output, attrs

    def _record(self, cap: Capture, gaps: list[tuple[str, str]]) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                                           dict[str, Any]]:
        rec, error = self.record, self.error
        s = rec.settings
        attrs: dict[str, Any] = {"rtrace.gateway.join": rec.call.join.how,
                                 "gen_ai.operation.name": _OPERATION[rec.kind]}
        inputs = dict(rec.payload)
        if rec.kind == RESPONSES and "messages" not in inputs:
            messages = chat_messages(rec.payload)  # the conversation as chat messages, read like a chat call's
            if messages:
                inputs["messages"] = messages
        stream = rec.payload.get("stream") is True
        if stream:
            attrs["rtrace.gateway.stream"] = True
        if rec.status and rec.status != 200:
            attrs["http.response.status_code"] = rec.status
        if cap.prompt_ids is not None:
            inputs["prompt_ids"] = cap.prompt_ids
        answered = error is None and rec.status == 200 and (cap.done or cap.chunks or cap.text or cap.tool_calls)
        output = cap.output() if answered or cap.chunks else None
        provider = getattr(rec.upstream, "provider", None)
        if provider is not None:
            attrs["gen_ai.provider.name"] = provider  # the upstream said what it is (its /v1/models)
        address = getattr(rec.upstream, "address", None)
        if address is not None:  # the inference server that answered (OTel's server.*): the timeline's track
            attrs["server.address"] = address
            port = getattr(rec.upstream, "port", None)
            if port is not None:
                attrs["server.port"] = port
        if cap.model is not None:
            attrs["gen_ai.response.model"] = cap.model
        if cap.response_id is not None:
            attrs["gen_ai.response.id"] = str(cap.response_id)
        usage = cap.usage if type(cap.usage) is dict else {}
        for key, attr in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                          ("completion_tokens", "gen_ai.usage.output_tokens")):
            if type(usage.get(key)) is int:
                attrs[attr] = usage[key]  # token ids, when there are, give the same (the pipeline sets them)
        if cap.version is not None:
            attrs["rtrace.weight_version"] = str(cap.version)
            version = cap.version
            if type(version) is str and version.lstrip("-").isdigit():
                version = int(version)
            if type(version) is int:
                attrs["rl.policy_version"] = version  # the span's own version over the rollout's
        if stream and cap.first_token_ns is not None:
            attrs["rtrace.time_to_first_token_ms"] = (cap.first_token_ns - rec.started) / 1e6
        noted = {code for code, _ in gaps}
        if answered or cap.chunks:
            if (cap.prompt_ids is None or cap.response_ids is None) and not noted:
                if not (s.gateway_token_ids or rec.payload.get("return_token_ids")
                        or rec.payload.get("enable_response_messages")):
                    gaps.append(("not_requested", "token ids were not asked of the upstream "
                                                  "(RTRACE_GATEWAY_TOKEN_IDS=false)"))
                else:
                    gaps.append(("not_returned", "the upstream returned no token ids (not vLLM / SGLang, or an "
                                                 "older version)"))
            if error is not None or (stream and not (cap.done or rec.ended) and "too_large" not in noted):
                gaps.append(("incomplete", "the answer was cut before its end: "
                                           + (error or "the stream ended without [DONE]")))
            if cap.choices > 1:
                gaps.append(("choices", f"n={cap.choices}: only the first choice is recorded"))
        if gaps:
            attrs["rtrace.capture_gap"] = "; ".join(detail for _, detail in gaps)
            attrs["rtrace.capture_gap.codes"] = [code for code, _ in gaps]
            _stats.incr("gateway_capture_gaps")
            for code, _ in gaps:
                _stats.incr(f"gateway_capture_gaps.{code}")
        return inputs, output, attrs
