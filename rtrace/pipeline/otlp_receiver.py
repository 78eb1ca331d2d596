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
503 and closed; on a TLS port closed unanswered), idle HTTP connections closed after :data:`HTTP_IDLE_TIMEOUT_S`.

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

import asyncio
import hmac
import logging
import math
import socket
import socketserver
import ssl
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import grpc
from grpc import aio as grpc_aio
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
    "HTTP_MAX_CONNECTIONS", "HTTP_IDLE_TIMEOUT_S", "MESSAGE_TIMEOUT_S", "TlsFiles",
]

_log = logging.getLogger(__name__)

MiB = 1024 * 1024
#: OTLP/HTTP connections served at once. At the cap, a new connection takes the place of
#: the one that has been sending its request (or waiting idle) the longest, if that began
#: more than :data:`HTTP_EVICT_AFTER_S` ago; else it gets 503 + Retry-After.
HTTP_MAX_CONNECTIONS = 128
HTTP_EVICT_AFTER_S = 1.0
#: An HTTP keep-alive connection idle (or a body not arriving) this long is closed.
HTTP_IDLE_TIMEOUT_S = 30.0
#: A gRPC call must deliver its request within this long after it starts (DEADLINE_EXCEEDED).
MESSAGE_TIMEOUT_S = 10.0
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

_TRACES_PATH = "/v1/traces"
_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# google.rpc.Code values, for the HTTP error bodies
_CODE_INVALID_ARGUMENT, _CODE_RESOURCE_EXHAUSTED, _CODE_INTERNAL, _CODE_UNAUTHENTICATED = 3, 8, 13, 16


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


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS receiver: its certificate chain and key, and optionally the CA
    that client certificates must be signed by (then clients must present one)."""

    cert: str
    key: str
    client_ca: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        def load(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()
        return load(self.cert), load(self.key), load(self.client_ca) if self.client_ca else None


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
                 max_concurrent_rpcs: int = 256, token: str | None = None, tls: TlsFiles | None = None) -> None:
        if max_workers < 1 or max_message_bytes < 1 or max_concurrent_rpcs < 1:
            raise ValueError("max_workers, max_message_bytes and max_concurrent_rpcs must be >= 1")
        self._on_request = on_request
        #: the bearer token every request must carry (None: no authentication)
        self._token = f"Bearer {token}".encode() if token else None
        self.tls = tls
        self.host = host
        self._want_port = int(port)
        self._want_http_port = None if http_port is None else int(http_port)
        self.max_workers = max_workers
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "accepted_spans": 0, "rejected_spans": 0,
                        "backpressure_requests": 0, "backpressure_spans": 0,
                        "failed_requests": 0, "failed_spans": 0, "invalid_requests": 0,
                        "unauthenticated_requests": 0, "grpc_calls": 0, "grpc_refused_calls": 0,
                        "http_evicted_connections": 0}
        self._last_error: str | None = None
        self._state = "new"  # new -> started -> stopped
        self._grpc_server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grpc_executor: futures.ThreadPoolExecutor | None = None
        self._loop_thread: threading.Thread | None = None
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
        # grpc.aio on a thread of its own: a call waiting for its message holds no thread
        # (the sync server's pool thread waits for it: 4 silent calls stopped every export)
        self._grpc_executor = futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="otlp-grpc-worker")
        loop = self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=loop.run_forever, name="otlp-grpc", daemon=True)
        self._loop_thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._serve_grpc(), loop).result(30)

    async def _serve_grpc(self) -> int:
        server = grpc_aio.server(
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     # never share a port with another server silently (gRPC sets SO_REUSEPORT)
                     ("grpc.so_reuseport", 0)])
        self._grpc_server = server
        # raw bytes in and out: the request is decoded here, so what cannot be decoded is
        # counted; a stream handler (same wire format as unary) so the wait for the message
        # has a deadline
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.stream_unary_rpc_method_handler(self._grpc_export)}),))
        address = f"{_host_for_url(self.host)}:{self._want_port}"
        try:
            if self.tls is not None:
                cert, key, client_ca = self.tls.read()
                creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                                    require_client_auth=client_ca is not None)
                port = server.add_secure_port(address, creds)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio >= 1.5x raises instead of returning 0
            raise OSError(f"cannot bind the OTLP gRPC receiver to {address}: {exc}") from exc
        if not port:
            raise OSError(f"cannot bind the OTLP gRPC receiver to {address}")
        await server.start()
        return port

    async def _grpc_export(self, requests: Any, context: Any) -> bytes:
        self._count(grpc_calls=1)
        if self._token is not None and not self._authorized(dict(context.invocation_metadata() or ()).get(
                "authorization")):
            self._count(unauthenticated_requests=1)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")
        try:
            body = await asyncio.wait_for(_only_message(requests), MESSAGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._count(grpc_refused_calls=1)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request within {MESSAGE_TIMEOUT_S:g} s of the call's start")
        except _NoMessage as exc:
            self._count(grpc_refused_calls=1)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:  # noqa: BLE001 - gRPC refused the message (too large once decompressed, ...)
            self._count(grpc_refused_calls=1)
            raise
        # decoded and handed over on a pool thread: a slow or stuck callback holds a thread,
        # never the event loop (which keeps serving, and can stop)
        outcome, detail = await asyncio.get_running_loop().run_in_executor(self._grpc_executor, self._decode, body)
        if outcome == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)
        if outcome == "ok":
            return detail.SerializeToString()
        if outcome == "backpressure":
            if RetryInfo is not None:
                delay = Duration()
                delay.FromNanoseconds(int(detail.retry_after_s * 1e9))
                context.set_trailing_metadata(
                    (("google.rpc.retryinfo-bin", RetryInfo(retry_delay=delay).SerializeToString()),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, detail.message)
        await context.abort(grpc.StatusCode.INTERNAL, detail)
        raise AssertionError("unreachable")  # context.abort raises

    def _decode(self, body: bytes) -> tuple[str, Any]:
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as exc:  # noqa: BLE001 - protobuf DecodeError
            self._invalid(f"not an ExportTraceServiceRequest: {exc}")
            return "invalid", "not an ExportTraceServiceRequest"
        return self._handle(request)

    def _authorized(self, value: Any) -> bool:
        """``value`` is ``Bearer <token>`` (compared in constant time)."""
        if isinstance(value, bytes):
            supplied = value
        elif isinstance(value, str):
            supplied = value.encode("utf-8", "surrogateescape")
        else:
            supplied = b""
        return hmac.compare_digest(supplied, self._token or b"")

    def _start_http(self) -> None:
        server = _HttpServer((self.host, self._want_http_port or 0), self)
        if self.tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.tls.cert, self.tls.key)
            if self.tls.client_ca:
                ctx.load_verify_locations(self.tls.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
            # the handshake happens on the connection's own thread (its first read), not in
            # the accept loop, where one silent client would stop every other
            server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
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
        stopped = None
        if self._grpc_server is not None and self._loop is not None:
            stopped = asyncio.run_coroutine_threadsafe(self._grpc_server.stop(grace_s), self._loop)
        if self._http is not None:
            self._http.shutdown()       # the accept loop (returns within its poll interval)
            self._http.server_close()   # the listening socket: the port is free
            self._http.drain(grace_s)   # requests in progress, then close the connections
            if self._http_thread is not None:
                self._http_thread.join(grace_s + 1)
        if stopped is not None:
            try:
                stopped.result(grace_s + 5)
            except Exception:  # noqa: BLE001 - stopping anyway
                _log.debug("OTLP receiver: gRPC stop", exc_info=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
            if not self._loop.is_running():
                self._loop.close()
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
        insecure=True)``, or ``http://`` + it); with TLS, ``"https://127.0.0.1:PORT"``."""
        if self.port is None:
            raise RuntimeError("OtlpReceiver.start() was not called")
        address = f"{_host_for_url(self.host)}:{self.port}"
        return f"https://{address}" if self.tls is not None else address

    @property
    def http_endpoint(self) -> str | None:
        """``"http://127.0.0.1:PORT"`` (POST to it + ``/v1/traces``; ``https`` with TLS),
        ``None`` without HTTP."""
        if self.http_port is None:
            return None
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{_host_for_url(self.host)}:{self.http_port}"

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict[str, Any]:
        """Counters since start: ``requests`` (handed to ``on_request``), ``accepted_spans``,
        ``rejected_spans`` (partial successes), ``backpressure_requests`` /
        ``backpressure_spans`` (told to retry), ``failed_requests`` / ``failed_spans``
        (``on_request`` raised), ``invalid_requests`` (bodies refused before decoding:
        size, type, encoding, protobuf), ``unauthenticated_requests`` (no or a wrong
        token), ``grpc_calls`` (gRPC calls begun), ``grpc_refused_calls`` (calls whose
        message never came, or that gRPC itself refused: too large, also once
        decompressed), ``http_evicted_connections`` (slow or idle HTTP connections closed
        to make room at the cap), and ``last_error``."""
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


class _NoMessage(Exception):
    """A gRPC call whose stream did not carry exactly one request message."""


async def _only_message(requests: Any) -> bytes:
    """The one message of an Export call's request stream, read to its end.

    ``async for`` to the end, not ``requests.__anext__()``: one ``__anext__`` leaves
    grpc.aio's message receiver (an async generator) suspended with the message in its
    frame, in a reference cycle that only Python's cyclic GC frees: every request body
    (up to 64 MiB) stayed in memory until a full collection, which ``rtrace collect``
    makes rare (tune_gc). A generator run to its end keeps nothing."""
    body, more = None, 0
    async for message in requests:
        if body is None:
            body = message
        else:  # let go at once, and read on: leaving the stream early would keep it
            more += 1
    if body is None or more:
        raise _NoMessage("no request message" if body is None else f"{more + 1} request messages, not one")
    return body


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ----------------------------------------------------------------------------- HTTP
class _HttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bound on connections and a record of them for stop()."""

    daemon_threads = True
    block_on_close = False
    # socketserver's default listen backlog is 5: a burst of clients then waits for the
    # kernel's SYN retry (1 s) every few connections
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], receiver: OtlpReceiver) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.receiver = receiver
        self.slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)
        self.workers = threading.BoundedSemaphore(receiver.max_workers)
        self.cond = threading.Condition()
        self.in_flight = 0
        self.connections: set[socket.socket] = set()
        #: connection -> monotonic time it began waiting for (or reading) a request
        self.reading: dict[socket.socket, float] = {}
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup): not needed here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False) and not self._evict_slowest():
            # Answered from the accept loop without reading the request: 503 is retryable for
            # OTLP clients (so is the connection reset they may see instead if they were still
            # sending: what already arrived is read, without waiting, to make that rarer).
            # On a TLS port nothing is written: writing would run the client's handshake
            # here, in the accept loop, waiting on a client that may never send a byte. The
            # connection is closed; OTLP clients retry a failed connection too.
            if isinstance(request, ssl.SSLSocket):
                self.shutdown_request(request)
                return
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

    def _evict_slowest(self) -> bool:
        """At the cap: close the connection that has been waiting for or sending its request
        the longest (a slow or stalled client, or an idle keep-alive one), if that began
        over :data:`HTTP_EVICT_AFTER_S` ago, and take its slot. An honest request arrives
        in milliseconds, so a flood of slow connections cannot keep honest clients out."""
        with self.cond:
            now = time.monotonic()
            candidates = [(since, conn) for conn, since in self.reading.items() if now - since > HTTP_EVICT_AFTER_S]
            if not candidates:
                return False
            _, victim = min(candidates, key=lambda item: item[0])
            self.reading.pop(victim, None)
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its thread reads EOF, ends and frees the slot
        except OSError:
            pass
        self.receiver._count(http_evicted_connections=1)
        return self.slots.acquire(timeout=1.0)

    def _forget(self, request: Any) -> None:
        with self.cond:
            self.reading.pop(request, None)
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

    def handle_one_request(self) -> None:
        srv = self.server
        with srv.cond:  # waiting for (then reading) a request: may be evicted at the cap
            srv.reading[self.request] = time.monotonic()
        try:
            super().handle_one_request()
        except (OSError, ssl.SSLError):  # evicted, reset, or a failed TLS handshake
            self.close_connection = True
        finally:
            with srv.cond:
                srv.reading.pop(self.request, None)

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
        if rx._token is not None and not rx._authorized(self.headers.get("Authorization")):
            rx._count(unauthenticated_requests=1)
            self.close_connection = True  # the body is not read
            return self._reply(401, _status_body(_CODE_UNAUTHENTICATED, "a bearer token is required"),
                               {"WWW-Authenticate": "Bearer"})
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
        with self.server.cond:  # the request is in: no longer a candidate for eviction
            self.server.reading.pop(self.request, None)
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
