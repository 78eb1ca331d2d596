"""The worker side of collector mode (``RTRACE_EXPORTER=collector``): spans to the
job's rtrace collector over standard OTLP/gRPC.

The worker's pipeline (``rtrace.pipeline.stream``) hands this sink *segments*: the
spans of one trace that ended since the last round, already converted (captured values
as JSON-safe data, ``rl.*`` coordinates stamped, the trajectory root marked
``rtrace.root``). They are encoded as OTLP spans in the compact form of
:func:`rtrace.exporters.otel.encode_compact` (standard ids, parents, times and status;
rtrace's record as one JSON attribute: the SDK's generic encoder would cost the worker
more than all the rest of its tracing) and sent with the standard OTLP/gRPC service
(opentelemetry-proto's ``TraceService/Export``), retrying UNAVAILABLE and
RESOURCE_EXHAUSTED (the collector's push-back: after the delay its ``RetryInfo`` names,
else with exponential backoff) within ``OTEL_EXPORTER_OTLP_TIMEOUT``. No decoding and no
backend work happens here: the tokenizer and the sinks live in the collector.
``sink.collector.exported`` counts segments; a failed export (collector down, or still
pushing back at the timeout) counts the segment batch as failed, and a full queue drops
it (``sink.collector.dropped_batches``). Spans the collector refused for good (answered
``partial_success``) are counted in ``sink.collector.rejected_spans``, and the next
``flush()`` returns False.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from .. import _stats
from ..config import ConfigError, Settings
from ..trajectory import Trajectory
from .base import Sink
from .otel import encode_compact
from .otlp_transport import retry_delay as _retry_delay

__all__ = ["CollectorSink"]


class CollectorSink(Sink):
    """Streams span segments to ``RTRACE_COLLECTOR_ENDPOINT`` (OTLP/gRPC)."""

    name = "collector"
    sample_when_behind = False  # segments, not trajectories: a full queue drops the batch

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        try:
            import grpc
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
        except ImportError as exc:
            raise ConfigError("RTRACE_EXPORTER=collector needs the OTLP exporter (pip install 'rtrace[otlp]'): "
                              f"{exc}") from None
        if not settings.collector_endpoint:
            raise ConfigError("RTRACE_EXPORTER=collector needs RTRACE_COLLECTOR_ENDPOINT (host:port)")
        self._grpc = grpc
        self._channel = _channel(grpc, settings)
        self._stub = TraceServiceStub(self._channel)
        self._compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            settings.otlp_compression, grpc.Compression.NoCompression)
        # OTEL_EXPORTER_OTLP_HEADERS (an OpenTelemetry Collector in front, with its own auth),
        # then rtrace's token; gRPC metadata keys are lower case
        headers = {k.lower(): v for k, v in settings.otlp_headers.items()}
        if settings.collector_token:
            headers["authorization"] = f"Bearer {settings.collector_token}"
        self._metadata = tuple(headers.items()) or None
        #: the collector refused spans (a partial success) since the previous flush
        self._rejected = False
        self._resource = {"service.name": settings.service_name, "process.pid": os.getpid()}
        if settings.job_id:
            self._resource["rtrace.job_id"] = settings.job_id

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        request = encode_compact(trajectories, self._resource, self.settings.max_value_chars)
        grpc = self._grpc
        retry = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        deadline = time.monotonic() + self.settings.otlp_timeout_s
        backoff = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._stub.Export(request, timeout=max(0.05, left), metadata=self._metadata,
                                             compression=self._compression)
            except grpc.RpcError as exc:
                # the collector's push-back names its delay (RetryInfo, as OTLP says); else
                # exponential backoff. Either way the whole request again, within the timeout
                delay = _retry_delay(exc)
                if delay is None:
                    delay, backoff = backoff, min(backoff * 2, 1.0)
                if exc.code() not in retry or left <= delay:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        _stats.warn_once("collector-auth", "the rtrace collector at %s refused this worker's "
                                         "token (RTRACE_COLLECTOR_TOKEN): start workers with collector.env",
                                         self.settings.collector_endpoint)
                    raise ConnectionError(f"the rtrace collector at {self.settings.collector_endpoint} did not "
                                          f"take the spans: {exc.code().name}") from None
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    _stats.incr("sink.collector.backpressure_retries")
                time.sleep(delay)
                continue
            rejected = response.partial_success.rejected_spans
            if rejected:  # refused for good (OTLP: never resent): counted here, the sender
                self._rejected = True
                _stats.incr("sink.collector.rejected_spans", rejected)
                _stats.warn_once("collector-rejected", "the rtrace collector refused spans of this worker: %s "
                                 "(counted in sink.collector.rejected_spans)", response.partial_success.error_message)
            return

    def flush(self, timeout_s: float) -> bool:
        """False when the collector refused spans since the previous flush (partial success)."""
        rejected, self._rejected = self._rejected, False
        return not rejected

    def shutdown(self) -> None:
        self._channel.close()


def _channel(grpc: Any, settings: Settings) -> Any:
    """A channel to ``RTRACE_COLLECTOR_ENDPOINT``: ``https://host:port`` is TLS, verified with
    OTEL_EXPORTER_OTLP_CERTIFICATE (else the system's roots) and, when both are set,
    presenting OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE / _CLIENT_KEY (the OTel exporters'
    variables); ``host:port`` or ``http://host:port`` is plaintext."""
    endpoint = settings.collector_endpoint
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return grpc.insecure_channel(endpoint)
    target = rest.split("/", 1)[0]
    if scheme != "https":
        return grpc.insecure_channel(target)

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(root_certificates=read(settings.otlp_certificate),
                                         private_key=read(settings.otlp_client_key),
                                         certificate_chain=read(settings.otlp_client_certificate))
    return grpc.secure_channel(target, creds)
