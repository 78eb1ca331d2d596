"""A real OTLP receiver for tests: OTLP/HTTP (protobuf) and OTLP/gRPC on 127.0.0.1.

It decodes ``ExportTraceServiceRequest`` with opentelemetry-proto and keeps every span as
a plain :class:`ReceivedSpan` (hex ids, decoded attribute values, and the span's protobuf
bytes as the receiver re-serialises them), bounded by ``max_spans`` (beyond it spans are
counted in ``overflow`` and not kept). For retry tests, ``fail_next(n, status, retry_after)``
makes the next ``n`` HTTP requests answer ``status`` (with a ``Retry-After`` header when
given), and ``fail_next(n, code, retry_delay_s)`` the next ``n`` gRPC calls ``code`` (with
``google.rpc.RetryInfo`` in the trailers when given).

Usage::

    with OtlpHttpReceiver() as rx:
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url)
        ...
        rx.wait_for_spans(10, timeout_s=10)
        rx.spans  # list[ReceivedSpan]
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["ReceivedSpan", "OtlpHttpReceiver", "OtlpGrpcReceiver", "any_value"]

_MAX_BODY = 64 * 1024 * 1024


def any_value(v: Any) -> Any:
    """Decode an OTLP ``AnyValue`` into a Python value (lists for arrays, dicts for kvlists)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    """One span as the receiver decoded it."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    resource: dict[str, Any]
    scope: str
    flags: int
    headers: dict[str, str] = field(default_factory=dict)
    #: the Span message, serialised again by the receiver's protobuf
    proto: bytes = b""


class _Store:
    """The spans received so far (thread-safe, bounded), shared by both transports."""

    def __init__(self, max_spans: int) -> None:
        self.max_spans = max_spans
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.overflow = 0
        self._cond = threading.Condition()

    def add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got: list[ReceivedSpan] = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None, name=s.name, kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        status_code=s.status.code, status_message=s.status.message,
                        attributes=_attrs(s.attributes),
                        events=[{"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attrs(e.attributes)}
                                for e in s.events],
                        resource=resource, scope=ss.scope.name, flags=s.flags, headers=headers,
                        proto=s.SerializeToString()))
        with self._cond:
            self.requests += 1
            room = max(0, self.max_spans - len(self.spans))
            self.spans.extend(got[:room])
            self.overflow += max(0, len(got) - room)
            self._cond.notify_all()

    def wait_for_spans(self, n: int, timeout_s: float) -> list[ReceivedSpan]:
        """Wait (bounded) until at least ``n`` spans arrived; return a copy of all of them."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.spans) + self.overflow >= n, timeout_s)
            return list(self.spans)

    def by_trace(self) -> dict[str, list[ReceivedSpan]]:
        with self._cond:
            out: dict[str, list[ReceivedSpan]] = {}
            for s in self.spans:
                out.setdefault(s.trace_id, []).append(s)
            return out


class _Receiver:
    def __init__(self, max_spans: int) -> None:
        self.store = _Store(max_spans)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self.store._cond:
            return list(self.store.spans)

    @property
    def requests(self) -> int:
        return self.store.requests

    def wait_for_spans(self, n: int, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        return self.store.wait_for_spans(n, timeout_s)

    def by_trace(self) -> dict[str, list[ReceivedSpan]]:
        return self.store.by_trace()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class OtlpHttpReceiver(_Receiver):
    """OTLP/HTTP protobuf receiver at ``http://127.0.0.1:<free port>/v1/traces``."""

    def __init__(self, max_spans: int = 200_000) -> None:
        super().__init__(max_spans)
        self._fail_lock = threading.Lock()
        self._fail: list[tuple[int, str | None]] = []
        store, receiver = self.store, self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                length = int(self.headers.get("Content-Length") or 0)
                if self.path.rstrip("/") != "/v1/traces" or length > _MAX_BODY:
                    self._reply(404 if length <= _MAX_BODY else 413, b"")
                    return
                body = self.rfile.read(length)
                failure = receiver._next_failure()
                if failure is not None:
                    self._reply(failure[0], b"", failure[1])
                    return
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except Exception:
                    self._reply(400, b"")
                    return
                store.add(request, {k.lower(): v for k, v in self.headers.items()})
                self._reply(200, ExportTraceServiceResponse().SerializeToString())

            def _reply(self, status: int, payload: bytes, retry_after: str | None = None) -> None:
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.traces_url = self.base_url + "/v1/traces"
        self._thread: threading.Thread | None = None

    def fail_next(self, n: int, status: int = 503, retry_after: str | None = None) -> None:
        """Answer the next ``n`` requests with ``status`` (503: the exporter retries), with
        a ``Retry-After`` header when given."""
        with self._fail_lock:
            self._fail.extend([(status, retry_after)] * n)

    def failures_left(self) -> int:
        """How many of the failures asked for are still to be answered."""
        with self._fail_lock:
            return len(self._fail)

    def _next_failure(self) -> tuple[int, str | None] | None:
        with self._fail_lock:
            return self._fail.pop(0) if self._fail else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="otlp-http-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)


class OtlpGrpcReceiver(_Receiver):
    """OTLP/gRPC receiver on ``127.0.0.1:<free port>`` (plaintext)."""

    def __init__(self, max_spans: int = 200_000) -> None:
        super().__init__(max_spans)
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        store, receiver = self.store, self
        self._fail_lock = threading.Lock()
        self._fail: list[tuple[Any, float | None]] = []

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC API)
                with receiver._fail_lock:
                    failure = receiver._fail.pop(0) if receiver._fail else None
                if failure is not None:
                    code, delay = failure
                    if delay is not None:
                        from google.rpc.error_details_pb2 import RetryInfo

                        info = RetryInfo()
                        info.retry_delay.FromNanoseconds(int(delay * 1e9))
                        context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
                    context.abort(code, "told to fail")
                store.add(request, {k: v for k, v in context.invocation_metadata()})
                return ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def fail_next(self, n: int, code: Any, retry_delay_s: float | None = None) -> None:
        """Answer the next ``n`` calls with status ``code`` (a ``grpc.StatusCode``), naming
        ``retry_delay_s`` as the delay to wait (``RetryInfo``) when given."""
        with self._fail_lock:
            self._fail.extend([(code, retry_delay_s)] * n)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1).wait(5)
