"""OTLP sink: trajectories as plain OpenTelemetry spans, sent with the official exporter.

Every :class:`~rtrace.trajectory.SpanRecord` becomes one OTel span with the trace id,
span id, parent, start/end times, status and events it had when it was recorded, and
all its attributes (``rl.*`` and ``gen_ai.*`` are already stamped by the builder), plus:

* ``rtrace.kind``: the span kind (rollout, agent, generation, tool, chain, segment...);
* ``rtrace.input`` / ``rtrace.output``: the captured arguments / return value as JSON
  text, at most ``max_value_chars`` characters;
* ``rtrace.prompt_text`` / ``rtrace.response_text`` on generation spans when
  token2text decoded them (the builder put them there already);
* ``rtrace.prompt_ids`` / ``rtrace.response_ids``: token ids still on the span (token2text
  off, or ``token2text_keep_ids``), at most ``max_value_chars`` of each;
* on the root: ``rtrace.partial`` / ``rtrace.dropped_spans`` when relevant.

Transport: ``opentelemetry-exporter-otlp`` over HTTP/protobuf (default) or gRPC
(``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``). Endpoint, headers and timeout come from
:class:`~rtrace.config.Settings` (config.py is the one reader of the environment) and are
passed to the exporter explicitly. The exporter retries transient failures (connection
refused, 429/502/503/504, gRPC UNAVAILABLE) with exponential backoff inside
``otlp_timeout_s``; a batch still failing then makes :meth:`OtlpSink.export` raise, and
the pipeline counts it (``sink.otlp.failed_batches`` / ``failed_trajectories``). All of
this runs in the sink's thread: the traced program never waits on the collector.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

from .._serialize import json_default, strict_json
from ..config import ConfigError, Settings
from ..trajectory import SpanRecord, Trajectory
from .base import Sink

__all__ = ["OtlpSink", "traces_endpoint", "to_readable_spans"]

#: Default collector addresses (the OTel SDK's defaults).
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"

_INT64 = (-(2**63), 2**63 - 1)


def traces_endpoint(settings: Settings) -> str:
    """The URL (HTTP) or address (gRPC) the sink sends to, resolved as the OTel spec says.

    HTTP: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as is; a base
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` gets ``/v1/traces`` appended. gRPC: the traces
    endpoint, else the base endpoint; an address without a scheme (``host:4317``) is
    taken as plaintext (``http://``), like the collector's own examples.
    """
    if settings.otlp_protocol == "grpc":
        endpoint = settings.otlp_traces_endpoint or settings.otlp_endpoint or DEFAULT_GRPC_ENDPOINT
        return endpoint if "://" in endpoint else "http://" + endpoint
    if settings.otlp_traces_endpoint:
        return settings.otlp_traces_endpoint
    base = settings.otlp_endpoint or DEFAULT_HTTP_ENDPOINT
    if "://" not in base:
        base = "http://" + base
    return base.rstrip("/") + "/v1/traces"


def _check_installed(protocol: str) -> None:
    import importlib.util

    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        found = False
    if not found:
        raise ConfigError(
            f"RTRACE_EXPORTER=otlp (protocol {protocol}) needs opentelemetry-exporter-otlp, which is "
            "not installed; install it with: pip install 'rtrace[otlp]'")


class OtlpSink(Sink):
    """Sends trajectories to an OTLP endpoint (a collector, Jaeger, Tempo, MLflow's
    ``/v1/traces``...). Settings: ``otlp_endpoint``, ``otlp_traces_endpoint``,
    ``otlp_protocol``, ``otlp_headers``, ``otlp_timeout_s``, ``service_name``."""

    name = "otlp"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        _check_installed(settings.otlp_protocol)
        self.endpoint = traces_endpoint(settings)
        self.protocol = settings.otlp_protocol
        self._exporter: Any = None
        self._resource: Any = None
        self._scope: Any = None
        # export() runs in the sink thread, shutdown() may come from another one.
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ exporter
    def _get_exporter(self) -> Any:
        if self._exporter is None:
            # Imported here, in the sink thread, at the first export: `import rtrace` and
            # configure() stay cheap, and protobuf/grpc load only when something is sent.
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            s = self.settings
            timeout = s.otlp_timeout_s
            if self.protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

                # An empty dict would make the exporter fall back to reading the env itself.
                exporter = GrpcExporter(endpoint=self.endpoint, headers=dict(s.otlp_headers) or None,
                                        timeout=timeout)
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

                exporter = HttpExporter(endpoint=self.endpoint, headers=dict(s.otlp_headers), timeout=timeout)
            from .. import __version__

            self._resource = Resource.create({"service.name": s.service_name})
            self._scope = InstrumentationScope("rtrace", __version__)
            self._exporter = exporter
        return self._exporter

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Convert and send one batch (one OTLP request). Raises when the collector did
        not take it after the exporter's retries; the pipeline counts the failure."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the otlp sink is shut down")
            exporter = self._get_exporter()
        spans = to_readable_spans(trajectories, self._resource, self._scope, self.settings.max_value_chars)
        if not spans:
            return
        from opentelemetry.sdk.trace.export import SpanExportResult

        result = exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            raise ConnectionError(f"OTLP export of {len(spans)} spans to {self.endpoint} failed after retries")

    def shutdown(self) -> None:
        """Close the exporter; an export still retrying gives up at its next backoff."""
        with self._lock:
            self._closed = True
            exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.shutdown()


# ----------------------------------------------------------------------------- conversion


def to_readable_spans(trajectories: Sequence[Trajectory], resource: Any, scope: Any,
                      max_value_chars: int = 20_000) -> list[Any]:
    """The OTel ``ReadableSpan`` objects of ``trajectories`` (ids, parents and times kept)."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    sampled = TraceFlags(TraceFlags.SAMPLED)
    out = []
    for traj in trajectories:
        trace_id = int(traj.trace_id, 16)
        root_id = traj.root.span_id
        for rec in traj.spans:
            ctx = SpanContext(trace_id, int(rec.span_id, 16), is_remote=False, trace_flags=sampled)
            parent_hex = rec.parent_id
            remote = False
            if rec.span_id == root_id:
                # A worker-process segment's root points at the driver's span it was
                # extracted from (rtrace.extract records it; the builder blanks root parents).
                parent_hex = parent_hex or rec.attributes.get("rtrace.remote_parent")
                remote = parent_hex is not None
            parent = (SpanContext(trace_id, int(parent_hex, 16), is_remote=remote, trace_flags=sampled)
                      if parent_hex else None)
            if rec.status == "error":
                status = Status(StatusCode.ERROR, rec.error or None)
            else:
                # rtrace records "ok" for spans nobody marked as failed; in OTel terms
                # that is UNSET (the decorators never set OK explicitly).
                status = Status(StatusCode.UNSET)
            events = [Event(str(e.get("name", "event")), _attributes(e.get("attributes") or {}),
                            timestamp=e.get("time_ns")) for e in rec.events]
            out.append(ReadableSpan(
                name=rec.name, context=ctx, parent=parent, resource=resource,
                attributes=_span_attributes(traj, rec, rec.span_id == root_id, max_value_chars),
                events=events, kind=SpanKind.INTERNAL, status=status,
                start_time=rec.start_ns, end_time=max(rec.end_ns, rec.start_ns),
                instrumentation_scope=scope))
    return out


def _span_attributes(traj: Trajectory, rec: SpanRecord, is_root: bool, limit: int) -> dict[str, Any]:
    attrs = _attributes(rec.attributes)
    attrs["rtrace.kind"] = rec.kind
    if rec.input is not None:
        attrs["rtrace.input"] = _json_text(rec.input, limit)
    if rec.output is not None:
        attrs["rtrace.output"] = _json_text(rec.output, limit)
    # Token ids are still here when token2text is off (or keeps them): the only record
    # of what the model saw and said, so they travel too (bounded like captured values).
    if rec.prompt_ids is not None:
        attrs["rtrace.prompt_ids"] = rec.prompt_ids[:limit]
    if rec.response_ids is not None:
        attrs["rtrace.response_ids"] = rec.response_ids[:limit]
    if is_root:
        if traj.partial:
            attrs["rtrace.partial"] = True
        if traj.dropped_spans:
            attrs["rtrace.dropped_spans"] = traj.dropped_spans
    return attrs


def _json_text(value: Any, limit: int) -> str:
    text = json.dumps(strict_json(value), ensure_ascii=False, allow_nan=False, default=json_default)
    if len(text) > limit:
        text = text[:limit] + "...[truncated]"
    return text


def _attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    """OTel-valid attributes: primitives and homogeneous lists are kept, anything else
    (dicts, mixed lists, None, ints beyond int64) becomes JSON text, never dropped."""
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if value is None:
            continue
        if _valid(value):
            out[str(key)] = value
        else:
            out[str(key)] = json.dumps(strict_json(value), ensure_ascii=False, allow_nan=False,
                                       default=json_default)
    return out


def _valid(value: Any) -> bool:
    if isinstance(value, bool) or isinstance(value, (str, float)):
        return True
    if isinstance(value, int):
        return _INT64[0] <= value <= _INT64[1]
    if isinstance(value, (list, tuple)):
        if not value:
            return True
        first = type(value[0])
        return first in (str, bool, int, float) and all(type(v) is first for v in value) and (
            first is not int or all(_INT64[0] <= v <= _INT64[1] for v in value))
    return False
