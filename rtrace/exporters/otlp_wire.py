"""OTLP trace requests written directly in protobuf's wire format.

The OTLP sink and the MLflow sink send what the one conversion (:mod:`rtrace.exporters.otel`)
makes of a trajectory. The OTel SDK's OTLP encoder builds a protobuf message per span,
attribute and value and copies each into its parent (``PB2KeyValue(key=..., value=...)``):
~5 µs per attribute value, more than all the rest of the sink. Building the messages in
place (``add()``, as :func:`rtrace.exporters.otel.encode_compact` does) still costs ~1.2 µs
per value; writing the bytes of each field here costs ~0.3 µs, and the result is the same
``ExportTraceServiceRequest``, byte for byte: fields in field-number order, proto3's
defaults left out where the SDK's messages leave them out, and the message fields it always
sets (a span's status, an attribute's value) always written
(``tests/test_otlp_wire.py`` compares the bytes with the SDK encoder's, and decodes them
with opentelemetry-proto).

Only what rtrace's spans hold is written: ids, parent, name, kind (INTERNAL, CLIENT), times,
attributes, events, status and flags; no trace state, links or dropped counts (always
empty or zero in rtrace's spans). Values follow the SDK encoder's rules (bool, str, int,
float, bytes, sequences, mappings, None as an empty value).

Field numbers: ``opentelemetry/proto/{collector/trace,trace,common,resource}/v1/*.proto``.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["varint", "any_value", "key_value", "attributes", "span", "event", "request", "scope"]

_U64 = (1 << 64) - 1
_SMALL = [bytes((i,)) for i in range(128)]
_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack

# tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32)
_STRING, _BOOL_FALSE, _BOOL_TRUE, _INT, _DOUBLE = b"\n", b"\x10\x00", b"\x10\x01", b"\x18", b"!"
_ARRAY, _KVLIST, _BYTES = b"*", b"2", b":"          # AnyValue 5, 6, 7
_SPAN_ATTRIBUTE, _SPAN_EVENT, _SPAN_STATUS = b"J", b"Z", b"z"   # Span 9, 11, 15
_EVENT_ATTRIBUTE = b"\x1a"                            # Span.Event 3
_KIND_INTERNAL = b"0\x01"                             # Span 6 = SPAN_KIND_INTERNAL
_KIND_CLIENT = b"0\x03"                               # Span 6 = SPAN_KIND_CLIENT
#: Span 16 (fixed32): SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE, with _IS_REMOTE for a remote parent
_FLAGS_LOCAL, _FLAGS_REMOTE = b"\x85\x01" + _fixed32(0x100), b"\x85\x01" + _fixed32(0x300)
_STATUS_UNSET = b"z\x00"                              # a Status message with nothing set
_STATUS_CODE_ERROR = b"\x18\x02"                      # Status 3 = STATUS_CODE_ERROR


def varint(n: int) -> bytes:
    """A non-negative int as a protobuf varint."""
    if n < 128:
        return _SMALL[n]
    if n < 16384:
        return bytes((n & 127 | 128, n >> 7))
    out = bytearray()
    while n > 127:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: protobuf refuses it; "?" as utf8() writes it
        return text.encode("utf-8", "replace")


def any_value(value: Any) -> bytes:
    """The ``AnyValue`` message of ``value`` (its body, without tag and length), as the
    SDK encoder writes it (``_encode_value``)."""
    cls = type(value)
    if cls is str:
        data = _utf8(value)
        return _STRING + varint(len(data)) + data
    if cls is bool:
        return _BOOL_TRUE if value else _BOOL_FALSE
    if cls is int:
        return _INT + varint(value & _U64)  # int64: two's complement, 10 bytes when negative
    if cls is float:
        return _DOUBLE + _double(value)
    if cls is list or cls is tuple:
        return _ARRAY + _message(b"".join([b"\n" + _message(any_value(v)) for v in value]))
    return _any_other(value)


def _any_other(value: Any) -> bytes:
    """Subclasses and the rarer types, in the SDK encoder's order of checks."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return any_value(bool(value))
    if isinstance(value, str):
        return any_value(str(value))
    if isinstance(value, int):
        return any_value(int(value))
    if isinstance(value, float):
        return any_value(float(value))
    if isinstance(value, bytes):
        return _BYTES + _message(bytes(value))
    if isinstance(value, Sequence):
        return any_value(list(value))
    if isinstance(value, Mapping):
        return _KVLIST + _message(b"".join([b"\n" + _message(key_value(str(k), v)) for k, v in value.items()]))
    raise TypeError(f"no OTLP value for {type(value).__name__}")


def _message(body: bytes) -> bytes:
    """A length-delimited field's length and body."""
    return varint(len(body)) + body


#: key -> the KeyValue's key field and the value field's tag (bounded: cleared when full)
_KEYS: dict[str, bytes] = {}
_KEYS_MAX = 4096


def key_value(key: str, value: Any) -> bytes:
    """The ``KeyValue`` message of one attribute (its body)."""
    head = _KEYS.get(key)
    if head is None:
        data = _utf8(key)
        head = b"\n" + varint(len(data)) + data + b"\x12"
        if len(_KEYS) >= _KEYS_MAX:
            _KEYS.clear()
        _KEYS[key] = head
    value_ = any_value(value)
    return head + varint(len(value_)) + value_


#: Values at most this long are looked up in a request's table of encoded attributes.
_SHORT = 128


def attributes(tag: bytes, attrs: Mapping[str, Any], out: list[bytes], fields: dict | None = None) -> None:
    """Append each attribute of ``attrs`` as a ``tag`` field (a repeated KeyValue) to ``out``.

    ``fields``: a table of attributes encoded before (in the same request), reused: a
    trajectory's ``rl.*`` coordinates are the same on each of its spans, its
    ``gen_ai.conversation.id`` too, and a batch's spans repeat names and kinds.
    """
    for key, value in attrs.items():
        cls = type(value)
        if fields is not None and (cls is str and len(value) <= _SHORT or cls is int or cls is bool
                                   or cls is float):
            # the type is part of the key: True == 1 == 1.0 as dict keys
            cached = (tag, key, value, cls)
            field = fields.get(cached)
            if field is None:
                kv = key_value(key, value)
                field = fields[cached] = tag + varint(len(kv)) + kv
            out.append(field)
        else:
            kv = key_value(key, value)
            out.append(tag + varint(len(kv)) + kv)


def event(name: str, attrs: Mapping[str, Any], time_ns: int, fields: dict | None = None) -> bytes:
    """A ``Span.Event`` message (its body); ``fields``: see :func:`attributes`."""
    parts = [b"\t" + _fixed64(time_ns)] if time_ns else []
    if name:
        data = _utf8(name)
        parts.append(b"\x12" + varint(len(data)) + data)
    attributes(_EVENT_ATTRIBUTE, attrs, parts, fields)
    return b"".join(parts)


def span(trace_id: bytes, span_id: bytes, parent_id: bytes | None, remote: bool, name: str, start_ns: int,
         end_ns: int, attrs: Mapping[str, Any], events: Iterable[tuple[str, Mapping[str, Any], int]],
         error: str | None | bool, fields: dict | None = None, kind: str = "internal") -> bytes:
    """A ``Span`` message (its body): ``kind`` INTERNAL or ``client`` CLIENT; ``error`` False
    for status UNSET, else status ERROR with that description (None or "" for none);
    ``fields``: see :func:`attributes`."""
    parts = [b"\n\x10" + trace_id + b"\x12\x08" + span_id]
    if parent_id:
        parts.append(b'"\x08' + parent_id)
    if name:
        data = _utf8(name)
        parts.append(b"*" + varint(len(data)) + data)
    parts.append(_KIND_CLIENT if kind == "client" else _KIND_INTERNAL)
    if start_ns:
        parts.append(b"9" + _fixed64(start_ns))
    if end_ns:
        parts.append(b"A" + _fixed64(end_ns))
    attributes(_SPAN_ATTRIBUTE, attrs, parts, fields)
    for name_, attrs_, time_ns in events:
        body = event(name_, attrs_, time_ns, fields)
        parts.append(_SPAN_EVENT + varint(len(body)) + body)
    if error is False:
        parts.append(_STATUS_UNSET)
    else:
        status = _STATUS_CODE_ERROR
        if error:
            data = _utf8(error)
            status = b"\x12" + varint(len(data)) + data + status
        parts.append(_SPAN_STATUS + varint(len(status)) + status)
    parts.append(_FLAGS_REMOTE if remote else _FLAGS_LOCAL)
    return b"".join(parts)


def scope(name: str | None, version: str | None) -> bytes:
    """An ``InstrumentationScope`` message (its body)."""
    parts = []
    for tag, text in ((b"\n", name), (b"\x12", version)):
        if text:
            data = _utf8(text)
            parts.append(tag + varint(len(data)) + data)
    return b"".join(parts)


def request(resource_attributes: Mapping[str, Any], scope_body: bytes, spans: list[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource and one scope holding ``spans``
    (``Span`` bodies, in order); no spans: the empty request."""
    if not spans:
        return b""
    resource: list[bytes] = []
    attributes(b"\n", resource_attributes, resource)
    resource_body = b"".join(resource)
    # one join: the lengths of the enclosing messages are known before their bodies are
    # (a request is a megabyte or two: copying it once per level would cost)
    parts = [b"", b"", b"\n" + varint(len(resource_body)) + resource_body, b"",
             b"\n" + varint(len(scope_body)) + scope_body]
    for body in spans:
        parts.append(b"\x12" + varint(len(body)))
        parts.append(body)
    scope_spans = sum(map(len, parts[4:]))
    parts[3] = b"\x12" + varint(scope_spans)
    resource_spans = len(parts[2]) + len(parts[3]) + scope_spans
    parts[0], parts[1] = b"\n", varint(resource_spans)
    return b"".join(parts)
