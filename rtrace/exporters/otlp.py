"""OTLP sink: trajectories as plain OpenTelemetry spans, over OTLP/HTTP or OTLP/gRPC.

Every :class:`~rtrace.trajectory.SpanRecord` becomes one OTel span through the shared
conversion, :func:`rtrace.exporters.otel.otel_spans` (the MLflow sink uses the same one):
the trace id, span id, parent (a segment root's remote parent included), start/end times, status (error -> ERROR, else UNSET), events, and all its attributes
(``rl.*`` and ``gen_ai.*`` are already stamped by the builder), plus:

* ``rtrace.kind``: the span kind (rollout, agent, generation, tool, chain, segment...);
* ``rtrace.input`` / ``rtrace.output``: the captured arguments / return value as JSON
  text, at most ``max_value_chars`` characters (then ``…[truncated, N chars]``);
* ``rtrace.prompt_text`` / ``rtrace.response_text`` on generation spans when
  token2text decoded them (the builder put them there already);
* ``rtrace.prompt_ids`` / ``rtrace.response_ids``: token ids still on the span (token2text
  off, or ``token2text_keep_ids``), at most ``max_value_chars`` of each;
* on the root: ``rtrace.partial`` / ``rtrace.dropped_spans`` when relevant.

Encoding: :func:`rtrace.exporters.otel.encode_request` writes the ``ExportTraceServiceRequest``
in protobuf's wire format directly, the same bytes the OTel SDK's OTLP encoder makes of
those spans at a fraction of its cost (with ``RTRACE_SEMCONV=both`` the GenAI attributes
add ~20 values and 3 events to a six-span trajectory, a few µs each in the SDK encoder).

Transport (:mod:`rtrace.exporters.otlp_transport`): OTLP over HTTP/protobuf (default) or
gRPC (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``). Endpoint, headers, timeout, compression and the
TLS files (CA, client certificate and key) come from :class:`~rtrace.config.Settings`
(config.py is the one reader of the environment), so what ``configure()`` accepted is what
is used. Transient failures (connection errors, HTTP 429/502/503/504, gRPC UNAVAILABLE,
RESOURCE_EXHAUSTED...) are retried after the delay the server names (``Retry-After``,
``RetryInfo``), else with exponential backoff, inside ``otlp_timeout_s``; a batch still
failing then makes :meth:`OtlpSink.export` raise, and the pipeline counts it
(``sink.otlp.failed_batches`` / ``failed_trajectories``). All of this runs in the sink's
thread: the traced program never waits on the collector.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from ..config import ConfigError, Settings
from ..trajectory import Trajectory
from .base import Sink
from .otel import encode_request

__all__ = ["OtlpSink", "traces_endpoint"]

#: Default collector addresses (the OTel SDK's defaults).
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"


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

    module = "grpc" if protocol == "grpc" else "requests"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        found = False
    if not found:
        raise ConfigError(
            f"RTRACE_EXPORTER=otlp (protocol {protocol}) needs {module}, which is not installed; install it "
            "with: pip install 'rtrace[otlp]'")


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
        self._sender: Any = None
        self._resource: Any = None
        self._scope: Any = None
        # export() runs in the sink thread, shutdown() may come from another one.
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ transport
    def _get_sender(self) -> Any:
        if self._sender is None:
            # Imported here, in the sink thread, at the first export: `import rtrace` and
            # configure() stay cheap, and grpc / requests load only when something is sent.
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            from .. import __version__
            from .otlp_transport import GrpcSender, HttpSender

            s = self.settings
            # Every setting as configure() validated it (the SDK's exporters, left a setting
            # unset, read the raw OTEL_EXPORTER_OTLP_* variable themselves: a blank
            # OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, unset for configure(), made one load a
            # certificate named '   ' and fail every export)
            sender = GrpcSender if self.protocol == "grpc" else HttpSender
            client = (s.otlp_client_certificate, s.otlp_client_key) if s.otlp_client_certificate else None
            self._sender = sender(self.endpoint, dict(s.otlp_headers), s.otlp_timeout_s, s.otlp_compression,
                                  certificate=s.otlp_certificate, client_cert=client,
                                  user_agent=f"rtrace/{__version__}")
            self._resource = Resource.create({"service.name": s.service_name})
            self._scope = InstrumentationScope("rtrace", __version__)
        return self._sender

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Convert, encode and send one batch (one OTLP request). Raises when the endpoint
        did not take it after the retries; the pipeline counts the failure."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the otlp sink is shut down")
            sender = self._get_sender()
        body = encode_request(trajectories, self._resource, self._scope, self.settings.max_value_chars,
                              self.settings.semconv, self.settings.genai_provider)
        if body:
            sender.send(body)

    def shutdown(self) -> None:
        """Close the transport; an export still retrying gives up at once."""
        with self._lock:
            self._closed = True
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
