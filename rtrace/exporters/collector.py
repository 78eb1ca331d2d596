"""The worker side of collector mode (``RTRACE_EXPORTER=collector``): spans to the
job's rtrace collector over standard OTLP/gRPC.

The worker's pipeline (``rtrace.pipeline.stream``) hands this sink *segments*: the
spans of one trace that ended since the last round, already converted (captured values
as JSON-safe data, ``rl.*`` coordinates stamped, the trajectory root marked
``rtrace.root``). They go through the one OTel conversion (:mod:`rtrace.exporters.otel`)
and the OTel SDK's own OTLP gRPC exporter (its retries and timeout,
``OTEL_EXPORTER_OTLP_TIMEOUT``). No decoding and no backend work happens here: the
tokenizer and the sinks live in the collector. ``sink.collector.exported`` counts
segments; a failed export (collector down, or refusing) counts the segment batch as
failed, and a full queue drops it (``sink.collector.dropped_batches``).
"""

from __future__ import annotations

import os
from typing import Sequence

from ..config import ConfigError, Settings
from ..trajectory import Trajectory
from .base import Sink
from .otel import to_readable_spans

__all__ = ["CollectorSink"]


class CollectorSink(Sink):
    """Streams span segments to ``RTRACE_COLLECTOR_ENDPOINT`` (OTLP/gRPC)."""

    name = "collector"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
        except ImportError as exc:
            raise ConfigError("RTRACE_EXPORTER=collector needs the OTLP exporter (pip install 'rtrace[otlp]'): "
                              f"{exc}") from None
        if not settings.collector_endpoint:
            raise ConfigError("RTRACE_EXPORTER=collector needs RTRACE_COLLECTOR_ENDPOINT (host:port)")
        self._exporter = OTLPSpanExporter(endpoint=settings.collector_endpoint, insecure=True,
                                          timeout=settings.otlp_timeout_s)
        attrs = {"service.name": settings.service_name, "process.pid": os.getpid()}
        if settings.job_id:
            attrs["rtrace.job_id"] = settings.job_id
        self._resource = Resource.create(attrs)

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        spans = to_readable_spans(trajectories, self._resource, max_value_chars=self.settings.max_value_chars)
        if self._exporter.export(spans) is not SpanExportResult.SUCCESS:
            raise ConnectionError(f"the rtrace collector at {self.settings.collector_endpoint} did not take "
                                  f"{len(spans)} spans")

    def shutdown(self) -> None:
        self._exporter.shutdown()
