"""OTLP sink: trajectories as plain OpenTelemetry spans, sent with the official exporter.

Every :class:`~rtrace.trajectory.SpanRecord` becomes one OTel span through the shared
conversion, :func:`rtrace.exporters.otel.to_readable_spans` (the MLflow sink uses the
same one): the trace id, span id, parent (a segment root's remote parent included),
start/end times, status (error -> ERROR, else UNSET), events, and all its attributes
(``rl.*`` and ``gen_ai.*`` are already stamped by the builder), plus:

* ``rtrace.kind``: the span kind (rollout, agent, generation, tool, chain, segment...);
* ``rtrace.input`` / ``rtrace.output``: the captured arguments / return value as JSON
  text, at most ``max_value_chars`` characters (then ``…[truncated, N chars]``);
* ``rtrace.prompt_text`` / ``rtrace.response_text`` on generation spans when
  token2text decoded them (the builder put them there already);
* ``rtrace.prompt_ids`` / ``rtrace.response_ids``: token ids still on the span (token2text
  off, or ``token2text_keep_ids``), at most ``max_value_chars`` of each;
* on the root: ``rtrace.partial`` / ``rtrace.dropped_spans`` when relevant.

Transport: ``opentelemetry-exporter-otlp`` over HTTP/protobuf (default) or gRPC
(``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``). Endpoint, headers, timeout, compression and the
TLS files (CA, client certificate and key) come from :class:`~rtrace.config.Settings`
(config.py is the one reader of the environment) and are passed to the exporter
explicitly, so what ``configure()`` accepted is what is used. The exporter retries transient failures (connection
refused, 429/502/503/504, gRPC UNAVAILABLE) with exponential backoff inside
``otlp_timeout_s``; a batch still failing then makes :meth:`OtlpSink.export` raise, and
the pipeline counts it (``sink.otlp.failed_batches`` / ``failed_trajectories``). All of
this runs in the sink's thread: the traced program never waits on the collector.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from ..config import ConfigError, Settings
from ..trajectory import Trajectory
from .base import Sink
from .otel import to_readable_spans

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


#: settings.otlp_compression -> the exporters' own values
_GRPC_COMPRESSION = {"none": lambda grpc: grpc.Compression.NoCompression, "gzip": lambda grpc: grpc.Compression.Gzip,
                     "deflate": lambda grpc: grpc.Compression.Deflate}
_HTTP_COMPRESSION = {"none": lambda c: c.NoCompression, "gzip": lambda c: c.Gzip, "deflate": lambda c: c.Deflate}


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _pinned_session(verify: bool | str, cert: tuple[str, str] | None) -> Any:
    """A ``requests.Session`` that sends every request with ``verify`` and ``cert``: the
    TLS settings configure() accepted. The OTLP/HTTP exporter takes a session (a public
    parameter), but where a certificate argument is None it also reads the environment
    variables itself (``OTEL_EXPORTER_OTLP_[TRACES_]CLIENT_CERTIFICATE`` ...) and sets what
    it found on the session or on each request; pinned here, what it found is not used."""
    import requests

    class PinnedSession(requests.Session):
        # what the exporter sets on the session is ignored (a request without its own value
        # takes the session's), and so is what it passes with each request (older versions)
        verify = property(lambda self: verify, lambda self, value: None)  # type: ignore[assignment]
        cert = property(lambda self: cert, lambda self, value: None)  # type: ignore[assignment]

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["verify"], kwargs["cert"] = verify, cert
            return super().request(method, url, *args, **kwargs)

    return PinnedSession()


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
            # Every setting is passed explicitly, as configure() validated it: left unset, the
            # exporter reads the OTEL_EXPORTER_OTLP_* variables itself, raw (a blank
            # OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, unset for configure(), made it load a
            # certificate named '   ' and fail every export)
            if self.protocol == "grpc":
                import grpc
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

                secure = self.endpoint.startswith("https://")
                exporter = GrpcExporter(
                    endpoint=self.endpoint, insecure=not secure,
                    credentials=grpc.ssl_channel_credentials(
                        root_certificates=_read(s.otlp_certificate), private_key=_read(s.otlp_client_key),
                        certificate_chain=_read(s.otlp_client_certificate)) if secure else None,
                    # an empty dict would make the exporter fall back to reading the env itself
                    headers=tuple(s.otlp_headers.items()) or None, timeout=s.otlp_timeout_s,
                    compression=_GRPC_COMPRESSION[s.otlp_compression](grpc))
            else:
                from opentelemetry.exporter.otlp.proto.http import Compression
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

                client = (s.otlp_client_certificate, s.otlp_client_key) if s.otlp_client_certificate else None
                exporter = HttpExporter(
                    endpoint=self.endpoint, certificate_file=s.otlp_certificate,
                    client_key_file=s.otlp_client_key, client_certificate_file=s.otlp_client_certificate,
                    headers=dict(s.otlp_headers), timeout=s.otlp_timeout_s,
                    compression=_HTTP_COMPRESSION[s.otlp_compression](Compression),
                    session=_pinned_session(s.otlp_certificate or True, client))
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
        spans = to_readable_spans(trajectories, self._resource, self._scope, self.settings.max_value_chars,
                                  self.settings.semconv)
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
