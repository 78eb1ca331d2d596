"""The worker side of collector mode (``RTRACE_EXPORTER=collector``): spans to the
job's rtrace collectors over standard OTLP/gRPC.

The worker's pipeline (``rtrace.pipeline.stream``) hands this sink *segments*: the
spans of one trace that ended since the last round, already converted (captured values
as JSON-safe data, ``rl.*`` coordinates stamped, the trajectory root marked
``rtrace.root``), and the trainer's annotations as one-span segments. They are encoded as
OTLP spans in the compact form of :func:`rtrace.exporters.otel.encode_compact` (standard
ids, parents, times and status; rtrace's record as one JSON attribute: the SDK's generic
encoder would cost the worker more than all the rest of its tracing). No decoding and no
backend work happens here: the tokenizer and the sinks live in the collector.

**Placement.** ``RTRACE_COLLECTOR_ENDPOINT`` names one collector or a comma list. Each
segment (and annotation) goes to the collector that owns its key, ``run|validate|step|
sample_index`` (its trace id when it has no coordinates), on the consistent-hash ring of
``rtrace/placement.py`` — the OpenTelemetry Collector loadbalancing exporter's ring, so an
OTel Collector in front routes the same way. Every request carries the key on its resources
(``rtrace.route``, one resource per key), which is what that exporter's attribute routing
reads. A segment is never sent to another collector than its owner.

**One lane per collector.** :meth:`CollectorSink.export` (the sink's thread) only routes and
encodes; each collector has its own :class:`_Lane`: a thread and a queue of encoded requests
bounded in bytes (``RTRACE_COLLECTOR_QUEUE_BYTES``). A lane sends what is queued a few MB at
a time (:data:`MAX_REQUEST_BYTES`; serialized requests concatenate into one) with the
standard OTLP/gRPC service (``TraceService/Export``), retrying UNAVAILABLE, DEADLINE_EXCEEDED
and RESOURCE_EXHAUSTED (the collector's push-back: after the delay its ``RetryInfo`` names,
else with exponential backoff) within ``OTEL_EXPORTER_OTLP_TIMEOUT``. So a collector that is
down or pushing back costs its own rollouts (retried, then counted), never the others' nor
the traced program's time, and one ``annotate_batch`` call of 10^5 rows leaves as a few large
requests.

Counters (docs/stats.md): ``sink.collector.exported`` counts segments routed to a lane;
``sink.collector.sent`` those a collector took; ``.failed_batches`` / ``.failed_trajectories``
requests and segments a collector did not take (down, or still pushing back at the timeout);
``.dropped_batches`` / ``.dropped_trajectories`` a lane's full queue; ``.abandoned_trajectories``
what a lane still held when shutdown's time ran out; the same per collector under
``collector_endpoint.<host:port>.``. Spans a collector refused for good (answered
``partial_success``) are counted in ``sink.collector.rejected_spans``. After any of these the
next ``flush()`` returns False.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from typing import Any, Sequence

from .. import _stats
from ..config import ConfigError, Settings
from ..events import worker_identity
from ..placement import Ring, endpoint_name, route_key
from ..trajectory import Trajectory
from .base import Sink
from .otel import encode_compact
from .otlp_transport import TRACE_EXPORT_METHOD, retry_delay as _retry_delay

__all__ = ["CollectorSink", "MAX_REQUEST_BYTES", "RECONNECT_BACKOFF_MS", "route_of"]

#: The longest a lane's channel waits between attempts to reconnect to its collector. gRPC's
#: default grows to 120 s: a collector restarted after a minute down got nothing from a worker
#: for up to two more (its rollouts failed as if it were still down); at 1 s, a collector back
#: on its port takes its groups again within about a second, for a connection attempt a second
#: from each worker while it is down.
RECONNECT_BACKOFF_MS = 1000

#: The largest request a lane makes of queued ones (a single larger one goes alone): the
#: OpenTelemetry Collector's gRPC receiver refuses more than 4 MiB by default
#: (``max_recv_msg_size_mib``), and an rtrace collector admits a request whole or pushes it back.
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def route_of(segment: Trajectory, run: str | None) -> str:
    """A segment's placement key (:func:`rtrace.placement.route_key`) from the ``rl.*``
    coordinates the worker stamped on its first span (an annotation's are on its one span);
    ``run`` is this process's experiment, used when the span carries none."""
    attrs = segment.spans[0].attributes if segment.spans else {}
    return route_key(attrs.get("rl.experiment", run), attrs.get("rl.validate"), attrs.get("rl.step"),
                     attrs.get("rl.sample_index"), segment.trace_id)


class CollectorSink(Sink):
    """Streams span segments to the collectors of ``RTRACE_COLLECTOR_ENDPOINT`` (OTLP/gRPC),
    each to its owner (see the module docstring)."""

    name = "collector"
    sample_when_behind = False  # segments, not trajectories: a full queue drops the batch

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        try:
            import grpc
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: F401 - needed by _channel
        except ImportError as exc:
            raise ConfigError("RTRACE_EXPORTER=collector needs the OTLP exporter (pip install 'rtrace[otlp]'): "
                              f"{exc}") from None
        if not settings.collector_endpoint:
            raise ConfigError("RTRACE_EXPORTER=collector needs RTRACE_COLLECTOR_ENDPOINT (host:port)")
        entries = [e.strip() for e in settings.collector_endpoint.split(",") if e.strip()]
        # OTEL_EXPORTER_OTLP_HEADERS (an OpenTelemetry Collector in front, with its own auth),
        # then rtrace's token; gRPC metadata keys are lower case
        headers = {k.lower(): v for k, v in settings.otlp_headers.items()}
        if settings.collector_token:
            headers["authorization"] = f"Bearer {settings.collector_token}"
        compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            settings.otlp_compression, grpc.Compression.NoCompression)
        # the worker's identity on the timeline (docs/timeline.md): the collector reads it back
        # (rtrace.events.worker_of_resource), beside OTel's standard host and process attributes
        self._resource = {"service.name": settings.service_name, "process.pid": os.getpid(),
                          "host.name": socket.gethostname(),
                          "service.instance.id": worker_identity(settings.worker_name)}
        if settings.job_id:
            self._resource["rtrace.job_id"] = settings.job_id
        self._run = settings.experiment
        self._ring = Ring(entries)
        self._lanes: dict[str, _Lane] = {}
        try:
            for entry in entries:
                name = endpoint_name(entry)
                call = _channel(grpc, entry, settings)
                self._lanes[name] = _Lane(name, grpc, call, settings, tuple(headers.items()) or None, compression)
        except BaseException:
            self.shutdown()
            raise
        #: the one collector, when there is one (no ring to consult)
        self._only: _Lane | None = next(iter(self._lanes.values())) if len(self._lanes) == 1 else None

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Route each segment to its collector's lane, one request per collector (one resource
        per key). Never waits for a collector: a lane whose queue is full drops (counted)."""
        run, ring, max_chars = self._run, self._ring, self.settings.max_value_chars
        routed: dict[str, list[tuple[str, int, Trajectory]]] = {}
        only = self._only
        for n, traj in enumerate(trajectories):
            if _broadcast(traj):  # a run event belongs to no rollout: every collector gets it
                for owner in self._lanes:
                    routed.setdefault(owner, []).append(("", n, traj))
                continue
            key = route_of(traj, run)
            owner = only.name if only else ring.owner(key)
            routed.setdefault(owner, []).append((key, n, traj))
        for owner, items in routed.items():
            items.sort(key=lambda item: (item[0], item[1]))  # one resource per key, in order
            request = encode_compact([t for _, _, t in items], self._resource, max_chars, [k for k, _, _ in items])
            # annotations open no trajectory in the collector: requests of them alone merge
            # into large ones; a request that opens trajectories goes as it is (a merged one
            # could be larger than the collector's table, which refuses part of it)
            alone = any(t.spans and t.spans[0].kind != "annotation" for _, _, t in items)
            self._lanes[owner].put(request.SerializeToString(), len(items), alone)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every lane has sent what it holds (or ``timeout_s``); False when it has
        not, or when anything was lost or refused since the previous flush."""
        deadline = time.monotonic() + timeout_s
        ok = True
        for lane in self._lanes.values():
            ok = lane.drain(deadline) and ok
        for lane in self._lanes.values():
            ok = not lane.take_lost() and ok
        return ok

    def shutdown(self) -> None:
        """Send what the lanes hold, for at most half of ``sink_timeout_s`` (the worker's last
        round had the other half); what is left is counted as abandoned."""
        deadline = time.monotonic() + self.settings.sink_timeout_s / 2
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.request_close()
        for lane in lanes:
            lane.close(deadline)


class _Lane:
    """One collector's sender: a thread and a queue of encoded requests bounded in bytes."""

    def __init__(self, name: str, grpc: Any, call: tuple[Any, Any], settings: Settings, metadata: Any,
                 compression: Any) -> None:
        self.name = name
        self._grpc = grpc
        self._channel, self._export = call
        self._metadata, self._compression = metadata, compression
        self._timeout_s = settings.otlp_timeout_s
        self._max_bytes = settings.collector_queue_bytes
        self._retry = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED)
        self._items: deque[tuple[bytes, int, bool]] = deque()  # (serialized request, segments, alone)
        self._bytes = 0
        self._in_flight = 0  # segments being sent now
        self._cond = threading.Condition()
        self._closing = False
        self._closed = threading.Event()  # ends a backoff at once
        #: anything lost or refused since the previous flush
        self._lost = False
        self._thread = threading.Thread(target=self._run, name=f"rtrace-collector-{name}", daemon=True)
        self._thread.start()

    def _count(self, what: str, n: int, total: str | None = None) -> None:
        _stats.incr(f"collector_endpoint.{self.name}.{what}", n)
        if total is not None:
            _stats.incr(f"sink.collector.{total}", n)

    # ------------------------------------------------------------------ the sink's thread
    def put(self, body: bytes, segments: int, alone: bool = True) -> None:
        """Queue one encoded request of ``segments`` segments; ``alone``: never merged with
        others (it opens trajectories). Dropped (counted) when the queue's bytes are full."""
        with self._cond:
            if self._closing or self._bytes + len(body) > self._max_bytes:
                self._lost = True
                full = True
            else:
                self._items.append((body, segments, alone))
                self._bytes += len(body)
                self._cond.notify()
                full = False
        if full:
            self._count("dropped", segments, "dropped_trajectories")
            _stats.incr("sink.collector.dropped_batches")
            _stats.warn_once(f"collector-full-{self.name}", "rtrace: the send queue for the collector at %s is full "
                             "(RTRACE_COLLECTOR_QUEUE_BYTES); segments are dropped (counted)", self.name)

    def drain(self, deadline: float) -> bool:
        """Wait until everything queued was sent (or failed); False at ``deadline``."""
        with self._cond:
            while self._items or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def take_lost(self) -> bool:
        with self._cond:
            lost, self._lost = self._lost, False
        return lost

    def request_close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, deadline: float) -> None:
        """Stop after sending what is queued, until ``deadline``; then count what is left as
        abandoned and close the channel (an export in flight then fails, counted)."""
        self.request_close()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            left = sum(n for _, n, _ in self._items)
            self._items.clear()
            self._bytes = 0
        if left:
            self._lost = True
            self._count("abandoned", left, "abandoned_trajectories")
        self._closed.set()
        self._channel.close()

    # ------------------------------------------------------------------ the lane's thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closing:
                    self._cond.wait()
                if not self._items:
                    return  # closing, and everything was sent
                body, segments, alone = self._items.popleft()
                bodies, size = [body], len(body)
                # annotation-only requests merge (serialized requests concatenate into one)
                while not alone and self._items and not self._items[0][2] \
                        and size + len(self._items[0][0]) <= MAX_REQUEST_BYTES:
                    body, n, _ = self._items.popleft()
                    bodies.append(body)
                    size += len(body)
                    segments += n
                self._bytes -= size
                self._in_flight = segments
            try:
                self._send(b"".join(bodies) if len(bodies) > 1 else bodies[0], segments)
            except Exception:  # noqa: BLE001 - the lane must outlive anything a send raises
                self._lost = True
                self._count("failed", segments, "failed_trajectories")
                _stats.incr("sink.collector.failed_batches")
                _stats.warn_once(f"collector-send-{self.name}", "rtrace: sending to the collector at %s failed",
                                 self.name, exc_info=True)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def _send(self, body: bytes, segments: int) -> None:
        """One request (serialized requests concatenate into one), retried on push-back and
        UNAVAILABLE within the timeout; counts what became of its segments."""
        grpc = self._grpc
        deadline = time.monotonic() + self._timeout_s
        backoff = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._export(body, timeout=max(0.05, left), metadata=self._metadata,
                                        compression=self._compression)
            except grpc.RpcError as exc:
                code = exc.code()
                # the collector's push-back names its delay (RetryInfo, as OTLP says); else
                # exponential backoff. Either way the whole request again, within the timeout
                delay = _retry_delay(exc)
                if delay is None:
                    delay, backoff = backoff, min(backoff * 2, 1.0)
                if code not in self._retry or left <= delay or self._closed.is_set():
                    if code == grpc.StatusCode.UNAUTHENTICATED:
                        _stats.warn_once("collector-auth", "the rtrace collector at %s refused this worker's "
                                         "token (RTRACE_COLLECTOR_TOKEN): start workers with collector.env",
                                         self.name)
                    self._lost = True
                    self._count("failed", segments, "failed_trajectories")
                    _stats.incr("sink.collector.failed_batches")
                    _stats.warn_once(f"collector-failed-{self.name}", "rtrace: the collector at %s did not take "
                                     "spans (%s); they are counted as lost, never sent elsewhere", self.name,
                                     getattr(code, "name", code))
                    return
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._count("backpressure_retries", 1, "backpressure_retries")
                self._closed.wait(delay)
                continue
            self._count("sent", segments, "sent")
            rejected = response.partial_success.rejected_spans
            if rejected:  # refused for good (OTLP: never resent): counted here, the sender
                self._lost = True
                self._count("rejected_spans", rejected, "rejected_spans")
                _stats.warn_once("collector-rejected", "the rtrace collector refused spans of this worker: %s "
                                 "(counted in sink.collector.rejected_spans)", response.partial_success.error_message)
            return


def _broadcast(segment: Trajectory) -> bool:
    """A run event (``rtrace.mark_weight_update``: rtrace/pipeline/fleet.py's ``rtrace.event``
    one-span segment): it goes to every collector, each of which completes its own rollouts
    with it (readers keep one row per event id)."""
    spans = segment.spans
    return len(spans) == 1 and spans[0].kind == "event" and spans[0].name == "rtrace.event"


def _channel(grpc: Any, endpoint: str, settings: Settings) -> tuple[Any, Any]:
    """A channel to one collector and its export call (serialized requests in, the answer
    parsed by the caller): ``https://host:port`` is TLS, verified with
    OTEL_EXPORTER_OTLP_CERTIFICATE (else the system's roots) and, when both are set,
    presenting OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE / _CLIENT_KEY (the OTel exporters'
    variables); ``host:port`` or ``http://host:port`` is plaintext."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    scheme, sep, rest = endpoint.partition("://")
    options = [("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]
    if not sep:
        channel = grpc.insecure_channel(endpoint, options=options)
    elif scheme != "https":
        channel = grpc.insecure_channel(rest.split("/", 1)[0], options=options)
    else:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(root_certificates=read(settings.otlp_certificate),
                                             private_key=read(settings.otlp_client_key),
                                             certificate_chain=read(settings.otlp_client_certificate))
        channel = grpc.secure_channel(rest.split("/", 1)[0], creds, options=options)
    # the request is already bytes (encoded on the sink's thread): no serializer
    export = channel.unary_unary(TRACE_EXPORT_METHOD, request_serializer=None,
                                 response_deserializer=ExportTraceServiceResponse.FromString)
    return channel, export
