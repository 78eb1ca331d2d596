"""Sending serialized OTLP trace requests: OTLP/HTTP (protobuf) and OTLP/gRPC, with retries.

The ``otlp`` sink encodes its requests itself (:func:`rtrace.exporters.otel.encode_request`,
bytes); these senders deliver them as the OTel SDK's OTLP exporters do, honouring every
OTLP setting ``configure()`` validated and nothing else (the SDK's exporters also read
the ``OTEL_EXPORTER_OTLP_*`` variables themselves, raw):

* **HTTP**: ``POST`` to the traces URL with ``Content-Type: application/x-protobuf``, the
  configured headers, the body compressed (``gzip`` / ``deflate``, ``Content-Encoding``),
  TLS verified with ``otlp_certificate`` (else the system's roots) and presenting
  ``otlp_client_certificate`` / ``otlp_client_key`` when set (``requests``).
* **gRPC**: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a channel to
  the endpoint's ``host:port``, TLS for ``https://`` with the same files; headers as
  metadata (lower-cased, as gRPC requires); per-call compression.

**Retries**, within ``otlp_timeout_s`` for the whole request (as the SDK's exporters): HTTP
429 / 502 / 503 / 504 and connection errors (a connection error once at once: a stale
pooled connection; then with backoff); gRPC CANCELLED, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED, ABORTED, OUT_OF_RANGE, UNAVAILABLE, DATA_LOSS. The delay is the one the
server names (HTTP ``Retry-After``, seconds or a date; gRPC ``google.rpc.RetryInfo``: an
rtrace collector's push-back names it), else exponential backoff from 1 s with ±20 %
jitter (the SDK's); at most 6 attempts (the SDK's); a retry whose delay would pass the
timeout is not made, and the request fails (:class:`ExportFailed`). ``close()`` ends a
backoff at once.
"""

from __future__ import annotations

import gzip
import random
import threading
import time
import zlib
from email.utils import parsedate_to_datetime
from typing import Any, Callable
from urllib.parse import urlparse

__all__ = ["ExportFailed", "HttpSender", "GrpcSender", "retry_delay", "TRACE_EXPORT_METHOD"]

#: The OTLP/gRPC method a trace request goes to.
TRACE_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_HTTP_RETRY = frozenset({429, 502, 503, 504})
_GRPC_RETRY = ("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "OUT_OF_RANGE", "UNAVAILABLE",
               "DATA_LOSS")
#: Attempts per request at most (the SDK exporters' number): a server that keeps naming a
#: delay of 0 is not asked again and again until the timeout.
_MAX_ATTEMPTS = 6
#: The longest delay a server may ask for (a bad Retry-After must not park the sink).
_MAX_NAMED_DELAY = 60.0


class ExportFailed(ConnectionError):
    """The request was not delivered: refused for good, or still failing at the timeout."""


class _Sender:
    """The retry loop; a transport's ``_attempt(body, timeout_s)`` returns None when the
    request was delivered, else (retryable, the delay the server named or None, what went
    wrong)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._closed = threading.Event()
        # a private generator: the module-level one is the trainer's, often seeded
        self._random = random.Random()

    def _attempt(self, body: bytes, timeout_s: float) -> tuple[bool, float | None, str] | None:
        raise NotImplementedError

    def send(self, body: bytes) -> None:
        """Deliver one serialized ``ExportTraceServiceRequest``, retrying as the module
        docstring says. Raises :class:`ExportFailed`."""
        deadline = time.monotonic() + self.timeout_s
        backoff = 0
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            outcome = self._attempt(body, max(deadline - time.monotonic(), 0.001))
            if outcome is None:
                return
            retryable, delay, reason = outcome
            if delay is None:
                delay = 2 ** backoff * self._random.uniform(0.8, 1.2)
                backoff += 1
            if not retryable or attempt == _MAX_ATTEMPTS or delay > deadline - time.monotonic() \
                    or self._closed.wait(delay):
                break
        raise ExportFailed(reason + (f" (retryable; gave up after {attempt} attempts)" if retryable else ""))

    def close(self) -> None:
        self._closed.set()


class HttpSender(_Sender):
    """OTLP/HTTP with ``requests``: ``url`` the traces URL; ``certificate`` the CA file
    (None: the system's roots); ``client_cert`` (certificate, key) files or None;
    ``compression`` none, gzip or deflate."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float, compression: str = "none",
                 certificate: str | None = None, client_cert: tuple[str, str] | None = None,
                 user_agent: str = "rtrace") -> None:
        import requests

        super().__init__(timeout_s)
        self.url = url
        self._session = requests.Session()
        self._verify: bool | str = certificate or True
        self._cert = client_cert
        self._headers = {"Content-Type": "application/x-protobuf", "User-Agent": user_agent, **headers}
        self._compress: Callable[[bytes], bytes] | None = None
        if compression == "gzip":
            self._compress = gzip.compress
        elif compression == "deflate":
            self._compress = zlib.compress
        if self._compress is not None and not any(k.lower() == "content-encoding" for k in headers):
            self._headers["Content-Encoding"] = compression
        # what requests raises for a request that may go through on a new connection
        self._connection_errors = (requests.ConnectionError, requests.Timeout)
        self._request_error = requests.RequestException
        self._fresh_retry = True

    def send(self, body: bytes) -> None:
        self._fresh_retry = True
        super().send(self._compress(body) if self._compress is not None else body)

    def _attempt(self, body: bytes, timeout_s: float) -> Any:
        try:
            response = self._session.post(self.url, data=body, headers=self._headers, timeout=timeout_s,
                                          verify=self._verify, cert=self._cert, allow_redirects=False)
        except self._request_error as exc:
            if isinstance(exc, self._connection_errors):
                if self._fresh_retry:  # a pooled connection the server closed: once, at once
                    self._fresh_retry = False
                    return True, 0.0, f"{type(exc).__name__}: {exc}"
                return True, None, f"{type(exc).__name__}: {exc}"
            return False, None, f"{type(exc).__name__}: {exc}"
        status = response.status_code
        if 200 <= status < 300:
            return None
        reason = f"HTTP {status} from {self.url}"
        if status in _HTTP_RETRY:
            return True, _retry_after(response.headers.get("retry-after")), reason
        return False, None, reason

    def close(self) -> None:
        super().close()
        self._session.close()


def _retry_after(value: str | None) -> float | None:
    """HTTP ``Retry-After`` (RFC 9110: seconds, or a date) in seconds; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            at = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = at.timestamp() - time.time()
    if seconds != seconds:  # NaN
        return None
    return max(0.0, min(seconds, _MAX_NAMED_DELAY))


class GrpcSender(_Sender):
    """OTLP/gRPC: ``endpoint`` ``http://host:port`` (plaintext) or ``https://host:port``
    (TLS: ``certificate`` the CA file, None for the system's roots; ``client_cert``
    (certificate, key) files or None)."""

    def __init__(self, endpoint: str, headers: dict[str, str], timeout_s: float, compression: str = "none",
                 certificate: str | None = None, client_cert: tuple[str, str] | None = None,
                 user_agent: str = "rtrace") -> None:
        import grpc

        super().__init__(timeout_s)
        self._grpc = grpc
        parsed = urlparse(endpoint)
        target = parsed.netloc or endpoint
        options = [("grpc.primary_user_agent", user_agent)]
        if parsed.scheme == "https":
            key, chain = (_read(client_cert[1]), _read(client_cert[0])) if client_cert else (None, None)
            creds = grpc.ssl_channel_credentials(root_certificates=_read(certificate), private_key=key,
                                                 certificate_chain=chain)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        # the request is already bytes: no serializer; the answer is not needed as an object
        self._export = self._channel.unary_unary(TRACE_EXPORT_METHOD, request_serializer=None,
                                                 response_deserializer=None)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items()) or None
        self._compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            compression, grpc.Compression.NoCompression)
        self._retry = frozenset(getattr(grpc.StatusCode, name) for name in _GRPC_RETRY)

    def _attempt(self, body: bytes, timeout_s: float) -> Any:
        try:
            self._export(body, timeout=timeout_s, metadata=self._metadata, compression=self._compression)
        except self._grpc.RpcError as exc:
            code = exc.code()
            details = exc.details() if hasattr(exc, "details") else exc
            return code in self._retry, retry_delay(exc), f"gRPC {getattr(code, 'name', code)}: {details}"
        return None

    def close(self) -> None:
        super().close()
        self._channel.close()


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def retry_delay(exc: Any) -> float | None:
    """The delay a RESOURCE_EXHAUSTED / UNAVAILABLE status asks for (``google.rpc.RetryInfo``
    in the trailers), in seconds; None when it names none."""
    try:
        value = dict(exc.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
    except Exception:  # noqa: BLE001 - a local error (no trailers): no delay named
        return None
    if not value:
        return None
    try:
        from google.rpc.error_details_pb2 import RetryInfo

        delay = RetryInfo.FromString(value).retry_delay
    except Exception:  # noqa: BLE001 - googleapis-common-protos missing, or garbage
        return None
    return max(0.0, min(delay.seconds + delay.nanos / 1e9, _MAX_NAMED_DELAY))
