"""OTLP trace receiver: OTLP/gRPC (and optionally OTLP/HTTP) in, one callback per request.

The collector's front door. :class:`OtlpReceiver` serves the standard
``opentelemetry.proto.collector.trace.v1.TraceService/Export`` RPC with ``grpcio`` and the
opentelemetry-proto service definitions, and, when ``http_port`` is given, ``POST
/v1/traces`` (binary protobuf, optionally gzip/deflate) with the standard library's
``ThreadingHTTPServer``. Both call ``on_request(request)`` with the decoded
``ExportTraceServiceRequest`` on the server's thread; the callback is meant to be cheap
(append to a bounded queue) and is called by at most ``max_workers`` threads at once per
transport.

Binds 127.0.0.1 unless told otherwise; ``port=0`` picks a free port (see
:attr:`OtlpReceiver.endpoint`). Bounded: ``max_workers`` handler threads,
``max_concurrent_rpcs`` gRPC calls in flight or queued (beyond it gRPC itself answers
RESOURCE_EXHAUSTED), requests larger than ``max_message_bytes`` refused (also after
decompression), at most :data:`HTTP_MAX_CONNECTIONS` HTTP connections (more are answered
503 and closed), idle HTTP connections closed after :data:`HTTP_IDLE_TIMEOUT_S`.

What the callback can say, and what the client sees
---------------------------------------------------

* returns ``None``: gRPC OK / HTTP 200. The OTel SDK exporter returns SUCCESS.
* returns ``PartialSuccess(n, message)``: OK / 200 with ``partial_success.rejected_spans
  = n`` and ``error_message``. SUCCESS; never resent (OTLP spec), so those n spans are gone.
* raises :class:`Backpressure` (queue full): gRPC RESOURCE_EXHAUSTED with a
  ``google.rpc.RetryInfo`` of ``retry_after_s`` in the trailers / HTTP 429 with
  ``Retry-After`` (whole seconds, at least 1) and a ``google.rpc.Status`` body. The SDK
  exporter waits that long and resends the whole request, within its timeout; after
  that, FAILURE.
* raises anything else: gRPC INTERNAL with ``on_request failed: <Type>: <message>`` /
  HTTP 500 with a ``google.rpc.Status``. FAILURE at once (not retryable).

So backpressure is :class:`Backpressure`, never a partial success: OTLP senders treat a
partial success as success (at most they log it; the Python SDK does not even read it)
and never resend the rejected spans, while RESOURCE_EXHAUSTED *with* ``RetryInfo`` (the
OTLP spec makes ``RetryInfo`` the condition for retrying it) and HTTP 429 make every
OTLP sender, the OpenTelemetry Collector's exporters included, hold the batch and send it
again. ``PartialSuccess`` is for spans refused for good (malformed, over a limit).
Nothing the callback raises stops the server; every outcome is counted in
:meth:`OtlpReceiver.stats`. ``Backpressure`` must be raised before the callback kept
anything of the request: the client sends all of it again.

gRPC's own RESOURCE_EXHAUSTED, beyond ``max_concurrent_rpcs`` or ``max_message_bytes``,
carries no ``RetryInfo``: the Python SDK retries it anyway (pointlessly for an oversized
request, until its timeout), the Collector's exporters drop the batch. Keep senders'
concurrency and batch sizes well below those limits.

Helpers for the consumer side: :func:`spans_of` walks a request as ``(resource
attributes, scope name, span)``; :func:`any_value` / :func:`attributes` turn OTLP
``AnyValue`` / ``KeyValue`` lists into Python values.
"""

from __future__ import annotations

import logging
import math
import socket
import socketserver
import threading
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

try:  # googleapis-common-protos: a dependency of the OTLP exporters (the `otlp` extra)
    from google.protobuf.duration_pb2 import Duration
    from google.rpc.error_details_pb2 import RetryInfo
    from google.rpc.status_pb2 import Status as RpcStatus
except ImportError:  # pragma: no cover - then no RetryInfo / Status bodies
    RetryInfo = RpcStatus = Duration = None  # type: ignore[assignment,misc]

__all__ = [
    "Backpressure", "PartialSuccess", "OtlpReceiver", "spans_of", "any_value", "attributes",
    "HTTP_MAX_CONNECTIONS", "HTTP_IDLE_TIMEOUT_S",
]

_log = logging.getLogger(__name__)

MiB = 1024 * 1024
#: OTLP/HTTP connections served at once; further ones get 503 + Retry-After and are closed.
HTTP_MAX_CONNECTIONS = 64
#: An HTTP keep-alive connection idle (or a body not arriving) this long is closed.
HTTP_IDLE_TIMEOUT_S = 30.0

_TRACES_PATH = "/v1/traces"
_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# google.rpc.Code values, for the HTTP error bodies
_CODE_INVALID_ARGUMENT, _CODE_RESOURCE_EXHAUSTED, _CODE_INTERNAL = 3, 8, 13


class Backpressure(Exception):
    """Raise from ``on_request`` when the request cannot be taken now (queue full).

    The client is told to send the *whole* request again after ``retry_after_s``
    (gRPC RESOURCE_EXHAUSTED with ``RetryInfo``; HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str = "receiver queue full", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(0.0, float(retry_after_s))


@dataclass(frozen=True)
class PartialSuccess:
    """Return from ``on_request`` when it kept the request but refused ``rejected_spans``
    of its spans for good (the client does not retry them)."""

    rejected_spans: int
    error_message: str = ""


OnRequest = Callable[[ExportTraceServiceRequest], "PartialSuccess | None"]


# ----------------------------------------------------------------------------- decoding
def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value: str, bool, int, float, bytes, a list
    (array) or a dict (kvlist), recursively; ``None`` when empty. (``string_value_strindex``
    only means something in profiles' dictionaries, never in traces: ``None`` too.)"""
    which = value.WhichOneof("value")
    if which is None or which == "string_value_strindex":
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which)


_SCALARS = frozenset(("string_value", "bool_value", "int_value", "double_value", "bytes_value"))


def attributes(key_values: Iterable[Any]) -> dict[str, Any]:
    """A repeated OTLP ``KeyValue`` (span, resource, event, link attributes) as a dict."""
    out: dict[str, Any] = {}
    for kv in key_values:
        value = kv.value
        which = value.WhichOneof("value")
        out[kv.key] = getattr(value, which) if which in _SCALARS else any_value(value)
    return out


def spans_of(request: ExportTraceServiceRequest) -> Iterator[tuple[dict[str, Any], str, Any]]:
    """Every span of ``request`` as ``(resource attributes, scope name, span proto)``.

    The resource dict is decoded once per ``ResourceSpans`` and shared by its spans:
    read it, don't mutate it. The span is the ``opentelemetry.proto.trace.v1.Span``
    itself (ids are bytes: ``span.trace_id.hex()``; ``parent_span_id`` is empty for a root)."""
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                yield resource, scope, span


def count_spans(request: ExportTraceServiceRequest) -> int:
    """How many spans ``request`` carries."""
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


# ----------------------------------------------------------------------------- receiver
class OtlpReceiver:
    """An OTLP trace receiver calling ``on_request`` with every decoded request.

    Args:
        on_request: called on a server thread with each ``ExportTraceServiceRequest``;
            returns ``None`` or a :class:`PartialSuccess`, may raise
            :class:`Backpressure` (see the module docstring for what clients see).
        host: the address both transports bind (``0.0.0.0`` only behind a firewall).
        port: the gRPC port; 0 picks a free one (read :attr:`port` after :meth:`start`).
        http_port: serve OTLP/HTTP ``POST /v1/traces`` there too (0: a free port);
            ``None``: gRPC only.
        max_workers: threads running ``on_request``, per transport.
        max_message_bytes: largest request accepted (after decompression).
        max_concurrent_rpcs: gRPC calls in flight or waiting for a worker; more get
            RESOURCE_EXHAUSTED from gRPC itself.
    """

    def __init__(self, on_request: OnRequest, *, host: str = "127.0.0.1", port: int = 0,
                 http_port: int | None = None, max_workers: int = 4, max_message_bytes: int = 64 * MiB,
                 max_concurrent_rpcs: int = 64) -> None:
        if max_workers < 1 or max_message_bytes < 1 or max_concurrent_rpcs < 1:
            raise ValueError("max_workers, max_message_bytes and max_concurrent_rpcs must be >= 1")
        self._on_request = on_request
        self.host = host
        self._want_port = int(port)
        self._want_http_port = None if http_port is None else int(http_port)
        self.max_workers = max_workers
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "accepted_spans": 0, "rejected_spans": 0,
                        "backpressure_requests": 0, "backpressure_spans": 0,
                        "failed_requests": 0, "failed_spans": 0, "invalid_requests": 0}
        self._last_error: str | None = None
        self._state = "new"  # new -> started -> stopped
        self._grpc_server: Any = None
        self._grpc_executor: futures.ThreadPoolExecutor | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self.port: int | None = None
        self.http_port: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind and serve. Raises ``OSError`` when a port cannot be bound."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"OtlpReceiver already {self._state}")
            self._state = "started"
        try:
            self._start_grpc()
            if self._want_http_port is not None:
                self._start_http()
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _start_grpc(self) -> None:
        self._grpc_executor = futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="otlp-grpc")
        self._grpc_server = grpc.server(
            self._grpc_executor, maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     # never share a port with another server silently (gRPC sets SO_REUSEPORT)
                     ("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc_server)
        address = f"{_host_for_url(self.host)}:{self._want_port}"
        try:
            port = self._grpc_server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio >= 1.5x raises instead of returning 0
            raise OSError(f"cannot bind the OTLP gRPC receiver to {address}: {exc}") from exc
        if not port:
            raise OSError(f"cannot bind the OTLP gRPC receiver to {address}")
        self.port = port
        self._grpc_server.start()

    def _start_http(self) -> None:
        server = _HttpServer((self.host, self._want_http_port or 0), self)
        self._http = server
        self.http_port = server.server_address[1]
        self._http_thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                             name="otlp-http-accept", daemon=True)
        self._http_thread.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop both transports and free their ports, waiting at most about ``grace_s``
        for requests in progress (after it they are cancelled; a callback still running
        finishes on its own thread, its answer is lost). Idempotent."""
        with self._lock:
            if self._state == "stopped":
                return
            self._state = "stopped"
        grace_s = max(0.0, grace_s)
        stopped = self._grpc_server.stop(grace_s) if self._grpc_server is not None else None
        if self._http is not None:
            self._http.shutdown()       # the accept loop (returns within its poll interval)
            self._http.server_close()   # the listening socket: the port is free
            self._http.drain(grace_s)   # requests in progress, then close the connections
            if self._http_thread is not None:
                self._http_thread.join(grace_s + 1)
        if stopped is not None:
            stopped.wait(grace_s + 5)
        if self._grpc_executor is not None:
            self._grpc_executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "OtlpReceiver":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ addresses
    @property
    def endpoint(self) -> str:
        """The gRPC address, ``"127.0.0.1:PORT"`` (give it to ``OTLPSpanExporter(endpoint=...,
        insecure=True)``, or ``http://`` + it)."""
        if self.port is None:
            raise RuntimeError("OtlpReceiver.start() was not called")
        return f"{_host_for_url(self.host)}:{self.port}"

    @property
    def http_endpoint(self) -> str | None:
        """``"http://127.0.0.1:PORT"`` (POST to it + ``/v1/traces``), ``None`` without HTTP."""
        if self.http_port is None:
            return None
        return f"http://{_host_for_url(self.host)}:{self.http_port}"

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict[str, Any]:
        """Counters since start: ``requests`` (handed to ``on_request``), ``accepted_spans``,
        ``rejected_spans`` (partial successes), ``backpressure_requests`` /
        ``backpressure_spans`` (told to retry), ``failed_requests`` / ``failed_spans``
        (``on_request`` raised), ``invalid_requests`` (HTTP bodies refused before
        decoding: size, type, encoding, protobuf), and ``last_error``."""
        with self._lock:
            return {**self._counts, "last_error": self._last_error}

    def _count(self, **inc: int) -> None:
        with self._lock:
            for key, n in inc.items():
                self._counts[key] += n

    def _handle(self, request: ExportTraceServiceRequest) -> tuple[str, Any]:
        """Run the callback; ``("ok", response)``, ``("backpressure", exc)`` or ``("failed", text)``."""
        n = count_spans(request)
        try:
            result = self._on_request(request)
        except Backpressure as exc:
            self._count(requests=1, backpressure_requests=1, backpressure_spans=n)
            return "backpressure", exc
        except Exception as exc:  # noqa: BLE001 - any bug in the callback: count, answer, keep serving
            text = f"on_request failed: {type(exc).__name__}: {exc}"
            with self._lock:
                first = self._counts["failed_requests"] == 0
                self._counts["requests"] += 1
                self._counts["failed_requests"] += 1
                self._counts["failed_spans"] += n
                self._last_error = text
            if first:
                _log.exception("OTLP receiver: %s (further failures are only counted)", text)
            return "failed", text
        response = ExportTraceServiceResponse()
        rejected = 0
        if isinstance(result, PartialSuccess) and (result.rejected_spans or result.error_message):
            rejected = max(0, min(int(result.rejected_spans), n))
            response.partial_success.CopyFrom(ExportTracePartialSuccess(
                rejected_spans=rejected, error_message=result.error_message))
        self._count(requests=1, accepted_spans=n - rejected, rejected_spans=rejected)
        return "ok", response

    def _invalid(self, why: str) -> None:
        with self._lock:
            self._counts["invalid_requests"] += 1
            self._last_error = why


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ----------------------------------------------------------------------------- gRPC
class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._rx = receiver

    def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
        outcome, detail = self._rx._handle(request)
        if outcome == "ok":
            return detail
        if outcome == "backpressure":
            if RetryInfo is not None:
                delay = Duration()
                delay.FromNanoseconds(int(detail.retry_after_s * 1e9))
                context.set_trailing_metadata(
                    (("google.rpc.retryinfo-bin", RetryInfo(retry_delay=delay).SerializeToString()),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, detail.message)
        context.abort(grpc.StatusCode.INTERNAL, detail)
        raise AssertionError("unreachable")  # context.abort raises


# ----------------------------------------------------------------------------- HTTP
class _HttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bound on connections and a record of them for stop()."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], receiver: OtlpReceiver) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.receiver = receiver
        self.slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)
        self.workers = threading.BoundedSemaphore(receiver.max_workers)
        self.cond = threading.Condition()
        self.in_flight = 0
        self.connections: set[socket.socket] = set()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup): not needed here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            # Answered from the accept loop without reading the request: 503 is retryable for
            # OTLP clients (so is the connection reset they may see instead if they were still
            # sending: what already arrived is read, without waiting, to make that rarer).
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                                b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                request.setblocking(False)
                for _ in range(16):
                    if not request.recv(65536):
                        break
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self.cond:
            self.connections.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self.cond:
            if request in self.connections:
                self.connections.discard(request)
                self.slots.release()

    def drain(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for requests in progress, then close every connection."""
        with self.cond:
            self.cond.wait_for(lambda: self.in_flight == 0, grace_s)
            conns = list(self.connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = HTTP_IDLE_TIMEOUT_S
    server: _HttpServer

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        srv = self.server
        with srv.cond:
            srv.in_flight += 1
        try:
            self._post(srv.receiver)
        finally:
            with srv.cond:
                srv.in_flight -= 1
                srv.cond.notify_all()

    def _post(self, rx: OtlpReceiver) -> None:
        if urlsplit(self.path).path.rstrip("/") != _TRACES_PATH:
            return self._refuse(rx, 404, f"no such path {self.path!r}; OTLP traces go to {_TRACES_PATH}")
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._refuse(rx, 411, "a Content-Length is required")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._refuse(rx, 400, "bad Content-Length")
        if length < 0 or length > rx.max_message_bytes:
            return self._refuse(rx, 413, f"request larger than {rx.max_message_bytes} bytes")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            rx._invalid("truncated request body")
            return None
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype not in _PROTOBUF_TYPES:
            return self._refuse(rx, 415, f"unsupported Content-Type {ctype!r}: send application/x-protobuf "
                                         "(OTLP/JSON is not supported)")
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        with self.server.workers:  # at most max_workers decode and call back at once
            try:
                body = _decompress(body, encoding, rx.max_message_bytes)
            except _BodyError as exc:
                return self._refuse(rx, exc.status, str(exc))
            request = ExportTraceServiceRequest()
            try:
                request.ParseFromString(body)
            except Exception as exc:  # noqa: BLE001 - protobuf DecodeError
                return self._refuse(rx, 400, f"not an ExportTraceServiceRequest: {exc}")
            outcome, detail = rx._handle(request)
        if outcome == "ok":
            return self._reply(200, detail.SerializeToString())
        if outcome == "backpressure":
            retry_after = max(1, math.ceil(detail.retry_after_s))  # delay-seconds is an integer
            return self._reply(429, _status_body(_CODE_RESOURCE_EXHAUSTED, detail.message),
                               {"Retry-After": str(retry_after)})
        return self._reply(500, _status_body(_CODE_INTERNAL, detail))

    def _refuse(self, rx: OtlpReceiver, status: int, message: str) -> None:
        rx._invalid(message)
        self.close_connection = True  # the body may be unread; refusals are rare, start afresh
        self._reply(status, _status_body(_CODE_INVALID_ARGUMENT, message))

    def _reply(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: counted in stats()
        _log.debug("OTLP/HTTP %s: " + format, self.client_address[0], *args)


class _BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        d = zlib.decompressobj()
    else:
        raise _BodyError(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    try:
        out = d.decompress(body, limit + 1)  # bounded: a small body may inflate to gigabytes
    except zlib.error as exc:
        raise _BodyError(400, f"bad {encoding} body: {exc}") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise _BodyError(413, f"request larger than {limit} bytes once decompressed")
    return out


def _status_body(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (the OTLP/HTTP error body), or nothing without googleapis-common-protos."""
    return RpcStatus(code=code, message=message).SerializeToString() if RpcStatus is not None else b""
