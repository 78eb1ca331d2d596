"""The one conversion from trajectories to OpenTelemetry spans, shared by the OTel sinks.

:func:`otel_spans` is the conversion; its spans are made into OTLP protobuf bytes by
:func:`encode_request` (:mod:`rtrace.exporters.otlp_wire`: the bytes the OTel SDK's OTLP
encoder makes of the same spans, at a fraction of its cost), which the OTLP sink sends, and
into SDK ``ReadableSpan`` objects by :func:`to_readable_spans`. The MLflow sink takes
:func:`to_otlp_protos` (those bytes parsed, MLflow's attributes added on top) and hands them
to ``Span.from_otel_proto``. Every output therefore shows a trajectory the same way:

* **ids**: the trace id and span ids of the trajectory (hex in the Trajectory, ints in
  the SDK, bytes in OTLP); span kind INTERNAL, but CLIENT for a generation the capture
  gateway recorded (a call to a model server over HTTP: :func:`~rtrace.exporters.semconv.span_kind`);
  start / end times (an end before the start is raised to the start).
* **parents**: each span's ``parent_id``. A trajectory root normally has none. A
  *segment* root (the part of a trajectory that ran in another process, opened by
  ``rtrace.extract``) carries ``rtrace.remote_parent`` = the 16-hex id of the span that
  dispatched it (in the driver): that span becomes its parent, with ``is_remote=True``.
  Backends that assemble traces by id (MLflow, Jaeger, Tempo, rtrace's collector) then
  hang the segment under the dispatching span: a trajectory that crossed processes is
  one trace with one root, not one root per process.
* **status**: a span rtrace recorded as ``error`` is ``ERROR`` with its error text as
  the description; every other span (``ok``: nobody marked it failed; ``unset``: the
  stand-in root of a partial trajectory) is ``UNSET``. The OTel convention reserves
  ``OK`` for an application or operator that explicitly overrides a status;
  instrumentation, which rtrace is, leaves a successful span UNSET. MLflow gives a trace
  whose root is UNSET the state OK, as for a root that says OK.
* **attributes**: the span's own attributes (``rl.*``, ``gen_ai.*``, ``rtrace.*``), each
  value passed through :func:`attribute_value` (the one validity check: a value OTel
  does not accept becomes its JSON text, never dropped), plus ``rtrace.kind``;
  ``rtrace.input`` / ``rtrace.output``, the captured arguments and return value as JSON
  text bounded by :func:`bounded` (the one truncation marker,
  ``…[truncated, N chars]``, the form ``rtrace._serialize.Converter.bound`` writes);
  ``rtrace.prompt_ids`` / ``rtrace.response_ids`` when token ids are still on the span
  (at most ``max_value_chars`` ids each); on the root ``rtrace.partial``,
  ``rtrace.dropped_spans`` and the rollout-health findings (``rtrace.health.checks``, the
  failed checks' names; ``rtrace.health``, the findings as JSON) when they apply.
* **events**: name, time (the span's start when unknown) and attributes (checked the
  same way).
* **the GenAI conventions** (``semconv``, ``RTRACE_SEMCONV``: ``rtrace`` by default,
  ``both``, ``genai``): with ``both`` or ``genai``, agent / generation / tool spans are
  named ``invoke_agent {name}`` / ``chat {model}`` / ``execute_tool {tool}`` and carry the
  GenAI attributes (messages as typed parts, tool call arguments and result, conversation
  id...), and the reward terms are ``gen_ai.evaluation.result`` events on the root
  (:mod:`rtrace.exporters.semconv`, docs/semconv.md); ``genai`` leaves out rtrace's copies
  of what those carry, and ``gen_ai.provider.name`` is written where known (``provider``:
  ``RTRACE_GENAI_PROVIDER``). ``rl.*`` is the same in every mode.

A sink may add backend-specific attributes on top of the encoded spans (``extra`` of
:func:`to_otlp_request`): OTLP ``AnyValue`` has maps and nested lists, which the SDK's
attribute API does not, and MLflow reads span inputs and outputs from them.
:func:`set_any_value` writes them into the encoded protobufs in place, in the form
:func:`any_value` defines (the SDK encoder accepts maps too, but builds nested values
message by message, copying each into its parent: for chat transcripts that more than
doubled the MLflow sink's conversion cost).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

from ..placement import ROUTE_ATTR
from .._serialize import attr_ok, fast_json, json_default, plain_json, strict_json, truncate, vouched
from ..trajectory import SpanRecord, Trajectory, token_field
from . import otlp_wire
from .semconv import (DUPLICATES, INPUT_CHARS_FACTOR, MODES, Conversation, evaluation_events,
                      genai_attributes, span_kind, span_name)

__all__ = ["encode_compact", "RECORD_ATTR", "to_readable_spans", "otel_spans", "OtelSpan", "encode_request",
           "to_otlp_request", "to_otlp_protos", "otlp_spans",
           "attribute_value", "attributes", "any_value", "set_any_value", "bounded", "json_text", "utf8",
           "is_valid_attribute", "DEFAULT_MAX_VALUE_CHARS", "DEFAULT_SEMCONV"]

#: The default bound of captured values (``Settings.max_value_chars``).
DEFAULT_MAX_VALUE_CHARS = 20_000
#: The default names on exported spans (``Settings.semconv``, ``RTRACE_SEMCONV``).
DEFAULT_SEMCONV = "rtrace"

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

class OtelSpan(NamedTuple):
    """One span as the conversion makes it (:func:`otel_spans`)."""

    trace_id: str  #: 32 hex digits
    span_id: str  #: 16 hex digits
    parent_id: str | None  #: 16 hex digits
    remote: bool  #: the parent is in another process (a segment root's)
    name: str
    start_ns: int
    end_ns: int  #: never before the start
    attributes: dict[str, Any]
    events: list[tuple[str, Mapping[str, Any], int]]  #: (name, attributes, time)
    error: str | None | bool  #: False: status UNSET; else ERROR with this description (None: none)
    kind: str = "internal"  #: ``internal`` or ``client`` (semconv.span_kind)


#: ``extra(trajectory, span, is_root) -> {key: value}``: attributes a sink adds on top.
ExtraAttributes = Callable[[Trajectory, SpanRecord, bool], Mapping[str, Any]]


# ----------------------------------------------------------------------------- values
def utf8(text: str) -> str:
    """``text`` if protobuf can encode it (valid UTF-8), else with each lone surrogate
    replaced by ``?`` (as MLflow's own encoder does): the OTLP encoder would drop the
    attribute, or fail the whole span for a name."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


#: The one truncation marker (``<first limit characters>…[truncated, N chars]``), the
#: converter's own: :func:`rtrace._serialize.truncate`.
bounded = truncate


#: ``json.dumps(value, ensure_ascii=False, allow_nan=False, default=json_default)``, with the
#: encoder made once (json.dumps makes one per call for non-default options: ~1.5 µs, more
#: than encoding a short value). ``encode`` is reentrant: threads may share it.
_TEXT_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=json_default)


def json_text(value: Any, limit: int | None = None) -> str:
    """``value`` as strict JSON text (non-finite floats as strings), bounded when a
    ``limit`` is given."""
    try:
        text = _TEXT_JSON.encode(value)
    except ValueError:  # a NaN or infinity inside: written as strings (one C-speed pass before)
        text = _TEXT_JSON.encode(strict_json(value))
    return utf8(text if limit is None else bounded(text, limit))


#: The one OTel attribute check (a primitive, or a homogeneous list / tuple of them):
#: :func:`rtrace._serialize.attr_ok`.
is_valid_attribute = attr_ok


def attribute_value(value: Any) -> Any:
    """``value`` if it is a valid OTel attribute value, else its JSON text (dicts, mixed
    lists, ints beyond 64 bits, objects...); strings pass through :func:`utf8`."""
    if isinstance(value, str):
        return utf8(value)
    if not is_valid_attribute(value):
        return json_text(value)
    if value and isinstance(value, (list, tuple)) and isinstance(value[0], str):
        return [utf8(v) for v in value]
    return value


def attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """OTel-valid attributes: None values left out, the rest through :func:`attribute_value`."""
    return {str(k): attribute_value(v) for k, v in attrs.items() if v is not None}


def any_value(value: Any) -> Any:
    """``value`` in a form the OTLP encoder writes as an ``AnyValue`` without losing it:
    maps with string keys, lists, strings encodable as UTF-8 (a lone surrogate becomes
    ``?``, as in MLflow's own encoder), 64-bit ints (larger ones become their ``str()``),
    floats, bools, None; anything else its ``str()``."""
    cls = type(value)
    if cls is str:
        return utf8(value)
    if value is None or cls is bool or cls is float:
        return value
    if cls is int:
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if cls is dict:
        return {str(k): any_value(v) for k, v in value.items()}
    if cls is list or cls is tuple:
        return [any_value(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return any_value(int(value))
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return any_value(str(value))
    if isinstance(value, Mapping):
        return any_value(dict(value))
    if isinstance(value, (list, tuple)):
        return any_value(list(value))
    return str(value)


def set_any_value(pb: Any, value: Any) -> None:
    """Write ``value`` into the OTLP ``AnyValue`` message ``pb`` in place, in the form
    :func:`any_value` gives (None leaves it empty)."""
    cls = type(value)
    if cls is str:
        pb.string_value = utf8(value)
    elif value is None:
        return
    elif cls is bool:
        pb.bool_value = value
    elif cls is int:
        if _INT64_MIN <= value <= _INT64_MAX:
            pb.int_value = value
        else:
            pb.string_value = str(value)
    elif cls is float:
        pb.double_value = value
    elif cls is dict:
        kvlist = pb.kvlist_value
        kvlist.SetInParent()  # an empty map is still a map
        items = kvlist.values
        for key, item in value.items():
            kv = items.add()
            kv.key = key if type(key) is str and key.isascii() else utf8(str(key))
            set_any_value(kv.value, item)
    elif cls is list or cls is tuple:
        array = pb.array_value
        array.SetInParent()
        items = array.values
        for item in value:
            set_any_value(items.add(), item)
    else:  # subclasses (IntEnum, OrderedDict...) and other objects: any_value gives base types
        set_any_value(pb, any_value(value))


# ----------------------------------------------------------------------------- spans
def span_attributes(traj: Trajectory, rec: SpanRecord, is_root: bool,
                    max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, semconv: str = DEFAULT_SEMCONV,
                    conversation: Conversation | None = None, provider: str | None = None) -> dict[str, Any]:
    """The OTel attributes of one span (see the module docstring); with ``semconv``
    ``both`` or ``genai``, the GenAI ones too (:func:`rtrace.exporters.semconv.genai_attributes`;
    ``conversation``: the trajectory's, shared by its spans; ``provider``: the configured
    ``gen_ai.provider.name``)."""
    attrs = attributes(rec.attributes)
    drop = ()
    if semconv != "rtrace":
        conversation = conversation or Conversation(traj, max_value_chars * INPUT_CHARS_FACTOR, provider)
        attrs.update(genai_attributes(conversation, rec, is_root))
        if semconv == "genai":
            drop = DUPLICATES.get(rec.kind, ())
            for key in drop:
                attrs.pop(key, None)
    if "rtrace.kind" not in drop:
        attrs["rtrace.kind"] = rec.kind
    if rec.input is not None and "rtrace.input" not in drop:
        attrs["rtrace.input"] = json_text(rec.input, max_value_chars)
    if rec.output is not None and "rtrace.output" not in drop:
        attrs["rtrace.output"] = json_text(rec.output, max_value_chars)
    # Token ids are still here when token2text is off (or keeps them): the only record
    # of what the model saw and said, so they travel too (bounded like captured values).
    if rec.prompt_ids is not None:
        attrs["rtrace.prompt_ids"] = attribute_value(rec.prompt_ids[:max_value_chars])
    if rec.response_ids is not None:
        attrs["rtrace.response_ids"] = attribute_value(rec.response_ids[:max_value_chars])
    if rec.token_values:
        _token_attributes(attrs, rec.token_values, max_value_chars * TOKEN_CHARS_FACTOR)
    if is_root:
        if traj.partial:
            attrs["rtrace.partial"] = True
        if traj.dropped_spans:
            attrs["rtrace.dropped_spans"] = traj.dropped_spans
        if traj.health:  # rollout-health findings (docs/health.md)
            attrs["rtrace.health.checks"] = sorted({f["check"] for f in traj.health})
            attrs["rtrace.health"] = json_text(traj.health, max_value_chars)
    return attrs


#: Per-token values get this many times ``max_value_chars`` (a 4,096-token response's four
#: arrays are ~90,000 characters in their compact form).
TOKEN_CHARS_FACTOR = 16


def _token_attributes(attrs: dict[str, Any], values: dict[str, Any], limit: int) -> None:
    """``rtrace.token_values``: a generation's per-token values in the compact form
    (:func:`rtrace.trajectory.token_field`, base64 float32: never one attribute per
    token); the arrays that do not fit in ``limit`` characters are named in
    ``rtrace.token_values.left_out``."""
    field = token_field(values)
    arrays, kept, left, size = field["arrays"], {}, [], 80
    for name in sorted(arrays, key=lambda n: len(arrays[n])):
        size += len(arrays[name]) + len(name) + 6
        if size <= limit:
            kept[name] = arrays[name]
        else:
            left.append(name)
    if kept:
        attrs["rtrace.token_values"] = json_text({**field, "arrays": kept}, None)
    if left:
        attrs["rtrace.token_values.left_out"] = sorted(left)


def otel_spans(trajectories: Iterable[Trajectory], max_value_chars: int = DEFAULT_MAX_VALUE_CHARS,
               semconv: str = DEFAULT_SEMCONV, provider: str | None = None) -> Iterator[OtelSpan]:
    """The one conversion: each span of the trajectories, in their order, as an
    :class:`OtelSpan` (what the module docstring describes). :func:`to_readable_spans` makes
    SDK spans of them, :func:`encode_request` OTLP protobuf bytes."""
    if semconv not in MODES:
        raise ValueError(f"semconv must be one of {', '.join(MODES)}, got {semconv!r}")
    genai = semconv != "rtrace"
    limit = max_value_chars * INPUT_CHARS_FACTOR
    for traj in trajectories:
        conversation = Conversation(traj, limit, provider) if genai else None
        for i, rec in enumerate(traj.spans):
            is_root = i == 0
            parent, remote = rec.parent_id, False
            if is_root:
                # A segment root points at the remote span it was extracted from (the
                # builder blanks root parents; rtrace.extract records the remote one).
                parent = parent or rec.attributes.get("rtrace.remote_parent")
                remote = parent is not None
            events = [(utf8(str(e.get("name") or "event")), attributes(e.get("attributes") or {}),
                       int(e.get("time_ns") or rec.start_ns)) for e in rec.events] if rec.events else []
            attrs = span_attributes(traj, rec, is_root, max_value_chars, semconv, conversation)
            name = rec.name
            if genai:
                events.extend(evaluation_events(traj, rec, is_root))
                name = span_name(rec) or name
            # an error's description: its text, or None; False: status UNSET
            error = (utf8(rec.error) if rec.error else None) if rec.status == "error" else False
            yield OtelSpan(traj.trace_id, rec.span_id, parent or None, remote, utf8(name), rec.start_ns,
                           max(rec.end_ns, rec.start_ns), attrs, events, error, span_kind(rec))


def to_readable_spans(trajectories: Trajectory | Iterable[Trajectory], resource: Any, scope: Any = None,
                      max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, semconv: str = DEFAULT_SEMCONV,
                      provider: str | None = None) -> list[Any]:
    """The SDK ``ReadableSpan`` objects of one or more trajectories, in their order.

    Args:
        trajectories: a trajectory, or several (one batch).
        resource: the ``opentelemetry.sdk.resources.Resource`` of every span.
        scope: their ``InstrumentationScope`` (None: no scope).
        max_value_chars: the bound of ``rtrace.input`` / ``rtrace.output`` (characters)
            and of the token id lists (ids).
        semconv: ``rtrace`` (default), ``both`` or ``genai`` (``RTRACE_SEMCONV``): which
            names the spans carry (:mod:`rtrace.exporters.semconv`).

    Returns:
        One ``ReadableSpan`` per span, with the ids, parents, status, attributes and
        events described in the module docstring (:func:`otel_spans`).
    """
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    if isinstance(trajectories, Trajectory):
        trajectories = (trajectories,)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    unset = Status(StatusCode.UNSET)
    out = []
    for s in otel_spans(trajectories, max_value_chars, semconv, provider):
        trace_id = int(s.trace_id, 16)
        parent = (SpanContext(trace_id, int(s.parent_id, 16), is_remote=s.remote, trace_flags=sampled)
                  if s.parent_id else None)
        out.append(ReadableSpan(
            name=s.name, context=SpanContext(trace_id, int(s.span_id, 16), is_remote=False, trace_flags=sampled),
            parent=parent, resource=resource, attributes=s.attributes,
            events=[Event(n, a, timestamp=ts) for n, a, ts in s.events],
            kind=SpanKind.CLIENT if s.kind == "client" else SpanKind.INTERNAL,
            status=unset if s.error is False else Status(StatusCode.ERROR, s.error),
            start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=scope))
    return out


def encode_request(trajectories: Trajectory | Iterable[Trajectory], resource: Any, scope: Any = None,
                   max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, semconv: str = DEFAULT_SEMCONV,
                   provider: str | None = None) -> bytes:
    """The serialized OTLP ``ExportTraceServiceRequest`` of the trajectories' spans (an
    OTLP/HTTP request body, a gRPC ``Export`` request): the same bytes as the OTel SDK's
    encoder makes of :func:`to_readable_spans` (same arguments), written directly
    (:mod:`rtrace.exporters.otlp_wire`: a fraction of the SDK encoder's cost).

    ``resource`` and ``scope``: anything with the SDK ``Resource``'s ``attributes`` and the
    ``InstrumentationScope``'s ``name`` / ``version`` (None: an empty scope).
    """
    if isinstance(trajectories, Trajectory):
        trajectories = (trajectories,)
    span = otlp_wire.span
    spans: list[bytes] = []
    fields: dict = {}  # attributes encoded in this request (otlp_wire.attributes)
    trace_hex = trace_id = None
    for s in otel_spans(trajectories, max_value_chars, semconv, provider):
        if s.trace_id is not trace_hex:
            trace_hex, trace_id = s.trace_id, _id_bytes(s.trace_id, 16)
        spans.append(span(trace_id, _id_bytes(s.span_id, 8), _id_bytes(s.parent_id, 8) if s.parent_id else None,
                          s.remote, s.name, s.start_ns, s.end_ns, s.attributes, s.events, s.error, fields, s.kind))
    scope_body = otlp_wire.scope(scope.name, scope.version) if scope is not None else b""
    return otlp_wire.request(resource.attributes, scope_body, spans)


def _id_bytes(hex_id: str, size: int) -> bytes:
    """A hex trace or span id as the SDK encodes it (``int.to_bytes``, big-endian, zero-padded)."""
    if len(hex_id) == 2 * size:
        try:
            return bytes.fromhex(hex_id)
        except ValueError:
            pass
    return int(hex_id, 16).to_bytes(size, "big")


def to_otlp_request(trajectories: Trajectory | Iterable[Trajectory], resource: Any, scope: Any = None,
                    max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, extra: ExtraAttributes | None = None,
                    semconv: str = DEFAULT_SEMCONV, provider: str | None = None) -> Any:
    """The trajectories' spans as one OTLP ``ExportTraceServiceRequest`` message: the
    bytes of :func:`encode_request` (what the OTel SDK's encoder makes of
    :func:`to_readable_spans`) parsed, then ``extra(trajectory, span, is_root)``
    attributes, if given, appended to each span with :func:`set_any_value`.

    Its ``SerializeToString()`` is an OTLP/HTTP request body.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    trajectories = (trajectories,) if isinstance(trajectories, Trajectory) else tuple(trajectories)
    request = ExportTraceServiceRequest.FromString(
        encode_request(trajectories, resource, scope, max_value_chars, semconv, provider))
    if extra is not None:
        protos = iter(otlp_spans(request))  # one resource and scope: the spans' order
        for traj in trajectories:
            for i, rec in enumerate(traj.spans):
                added = next(protos).attributes
                for key, value in extra(traj, rec, i == 0).items():
                    if value is not None:
                        kv = added.add()
                        kv.key = key
                        set_any_value(kv.value, value)
    return request


def to_otlp_protos(trajectories: Trajectory | Iterable[Trajectory], resource: Any, scope: Any = None,
                   max_value_chars: int = DEFAULT_MAX_VALUE_CHARS,
                   extra: ExtraAttributes | None = None, semconv: str = DEFAULT_SEMCONV,
                   provider: str | None = None) -> list[Any]:
    """The OTLP protobuf ``Span`` messages of :func:`to_otlp_request` (same arguments),
    one per span, in the trajectories' order."""
    return otlp_spans(to_otlp_request(trajectories, resource, scope, max_value_chars, extra, semconv, provider))


def otlp_spans(request: Any) -> list[Any]:
    """The protobuf ``Span`` messages of an ``ExportTraceServiceRequest``, in order (the
    encoder groups spans by resource and scope; one resource and scope keep the order)."""
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


# ----------------------------------------------------------------------------- collector hop
#: The attribute that carries a span's rtrace record on the worker -> collector hop.
RECORD_ATTR = "rtrace.record"

#: The worker's records are converted (JSON-safe) already: one strict encoder, made once.
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode_compact(trajectories: Iterable[Trajectory], resource_attributes: Mapping[str, Any],
                   max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, routes: Sequence[str] | None = None) -> Any:
    """One OTLP ``ExportTraceServiceRequest`` for the worker -> collector hop.

    Each span keeps its standard OTLP fields (trace and span ids, parent, name, times,
    status, events), and a root span its ``rl.*`` coordinates as attributes too (an
    OpenTelemetry Collector in between can route by trace id or by them); everything
    rtrace records (kind, attributes, captured input and output, token ids) is one JSON
    text attribute, :data:`RECORD_ATTR`, which the rtrace collector reads back
    (``rtrace.pipeline.collector``). One protobuf value instead of one per attribute: the
    encoding costs the worker a fraction of the SDK's generic encoder. The sinks' OTLP
    output (:func:`to_readable_spans`) is unaffected.

    ``routes`` (one per trajectory; equal ones next to each other): each run of equal routes
    gets a resource of its own, the resource attributes plus :data:`rtrace.placement.ROUTE_ATTR`
    = the route, which an OpenTelemetry Collector's loadbalancing exporter routes by
    (``routing_key: attributes``): once per rollout group rather than once per span.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    # Messages are built in place (``add``): constructing them from keyword messages
    # copies each one, three times the cost (benchmarks/bench_collector.py).
    internal = Span.SpanKind.SPAN_KIND_INTERNAL
    error = Status.StatusCode.STATUS_CODE_ERROR
    fromhex = bytes.fromhex
    encode = _COMPACT_JSON.encode

    def put(kvs: Any, key: str, value: Any) -> None:
        any_ = kvs.add(key=key).value
        cls = type(value)
        if cls is bool:
            any_.bool_value = value
        elif cls is int:
            any_.int_value = value
        elif cls is float:
            any_.double_value = value
        else:
            any_.string_value = value if cls is str else json_text(value)

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in attributes(resource_attributes).items():
        put(resource_spans.resource.attributes, key, value)
    base = None
    add = resource_spans.scope_spans.add().spans.add
    route: str | None = None
    for n, traj in enumerate(trajectories):
        if routes is not None and routes[n] != route:
            if route is None:  # the first group: the resource made above
                base = type(resource_spans.resource)()
                base.CopyFrom(resource_spans.resource)
            else:  # the next group: a resource of its own
                resource_spans = request.resource_spans.add()
                resource_spans.resource.CopyFrom(base)
                add = resource_spans.scope_spans.add().spans.add
            route = routes[n]
            put(resource_spans.resource.attributes, ROUTE_ATTR, route)
        trace_id = fromhex(traj.trace_id)
        # a segment the worker vouched for (converted values only) skips the NaN walk
        to_json = plain_json if vouched(traj) else fast_json
        for i, rec in enumerate(traj.spans):
            attrs = rec.attributes
            record: dict[str, Any] = {"kind": rec.kind, "attributes": attrs}
            if rec.input is not None:
                record["input"] = rec.input
            if rec.output is not None:
                record["output"] = rec.output
            if rec.prompt_ids is not None:
                record["prompt_ids"] = rec.prompt_ids[:max_value_chars]
            if rec.response_ids is not None:
                record["response_ids"] = rec.response_ids[:max_value_chars]
            if rec.token_values:  # float32 exactly (base64): the collector measures what the worker had
                record["token_values"] = token_field(rec.token_values)
            text = to_json(record)  # UTF-8 bytes, valid: protobuf takes them for a string
            if text is None:
                try:
                    text = encode(record)
                except (TypeError, ValueError):  # not converted (a NaN, an object): the careful path
                    text = json_text(record)
                if not text.isascii():
                    text = utf8(text)
            parent = rec.parent_id
            remote = False
            if i == 0 and not parent:
                parent = attrs.get("rtrace.remote_parent")
                remote = parent is not None
            name, start, end = rec.name, rec.start_ns, rec.end_ns
            span = add(trace_id=trace_id, span_id=fromhex(rec.span_id),
                       parent_span_id=fromhex(parent) if parent else b"", flags=0x300 if remote else 0x100,
                       name=name if name.isascii() else utf8(name), kind=internal, start_time_unix_nano=start,
                       end_time_unix_nano=end if end >= start else start)
            kvs = span.attributes
            if rec.parent_id is None:
                # the coordinates stay real attributes on the root (route by them if you like)
                for key, value in attrs.items():
                    if key.startswith("rl.") and type(value) is not list and is_valid_attribute(value):
                        put(kvs, key, value)
            kvs.add(key=RECORD_ATTR).value.string_value = text
            for event in rec.events:
                ev = span.events.add(name=utf8(str(event.get("name") or "event")),
                                     time_unix_nano=int(event.get("time_ns") or rec.start_ns))
                for key, value in attributes(event.get("attributes") or {}).items():
                    put(ev.attributes, key, value)
            if rec.status == "error":
                span.status.code = error
                span.status.message = utf8(rec.error or "")
    return request
