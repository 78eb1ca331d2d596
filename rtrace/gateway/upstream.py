"""The gateway's HTTP/1.1 client to the upstream server: keep-alive connections, streamed bodies.

Why not httpx: measured on this 2-core machine, an ``httpx.AsyncClient`` request to a local
server cost ~1.5 ms of CPU (httpcore's pool, anyio and h11 in pure Python; and a failed
``import sniffio`` per request when sniffio is absent), five times the whole added-latency
budget of the gateway (docs/gateway.md, Performance). This client does only what a proxy to
an OpenAI-compatible server needs, on asyncio's own transports with the ``httptools``
parser (C, uvicorn's): ~0.06 ms of CPU per request.

* one request per connection at a time, connections kept alive and reused (LIFO, at most
  ``max_idle`` idle ones); a reused connection that the server had closed is retried once
  on a new one (nothing of the request was answered);
* the body is read chunk by chunk as it arrives (:meth:`Reply.chunks`); a slow reader
  pauses the socket once 1 MiB waits, so memory stays bounded whatever the upstream sends;
* or piped (:meth:`Reply.pipe`): each chunk is handed to a callback from the socket's read
  callback itself, so a stream wakes no task per chunk (the gateway's streams: each chunk
  goes on to the client at once), and the reader pauses and resumes the socket itself;
* a timeout bounds each wait for the upstream (the response head, then each chunk):
  :class:`UpstreamError` ``timeout``; a refused or lost connection is ``unreachable``; a
  response that is not HTTP is ``protocol``.

:func:`identify` asks the upstream what it is (its ``/models``' ``owned_by``: ``vllm``, ``sglang``)
for the calls' ``gen_ai.provider.name``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import httptools

__all__ = ["Upstream", "Reply", "UpstreamError", "shown_url", "identify"]

#: bytes buffered from the upstream before the socket is paused (resumed below _LOW)
_HIGH, _LOW = 1 << 20, 1 << 18


def shown_url(url: str) -> str:
    """``url`` as the gateway shows it (error bodies, ``/rtrace/health``, its log): scheme,
    host, port and path only; credentials in it (``user:password@``, a query's token) never."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<the upstream URL>"
    return f"{parts.scheme}://{host}{port}{parts.path}"


#: ``owned_by`` of an OpenAI-compatible server's models -> the GenAI ``gen_ai.provider.name``
#: (vLLM 0.32's model cards say ``vllm``, SGLang's ``sglang``)
_OWNERS = {"vllm": "vllm", "sglang": "sglang"}
#: the most of a ``/models`` answer read to identify the upstream
_MODELS_BYTES = 1 << 20


class UpstreamError(Exception):
    """The upstream did not answer: ``kind`` is ``unreachable``, ``timeout`` or ``protocol``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Conn(asyncio.Protocol):
    """One connection and the response being read on it."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.closed = False
        self.loop: Any = None
        self.timeout_s = 0.0
        self._reset()

    def _reset(self) -> None:
        if getattr(self, "paused", False) and not self.closed:
            self.transport.resume_reading()  # a piped body's reader had paused it when it ended
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.answered = False  # any byte of a response arrived
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future | None = None
        #: piped: on_data(chunk) for each chunk, on_end(error or None) once
        self.on_data: Any = None
        self.on_end: Any = None
        self.deadline = 0.0
        self.timer: Any = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - never asked for
            self._fail(UpstreamError("protocol", "the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("protocol", f"the upstream's answer is not HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self.head_done and not self._framed():
                self.complete = True  # a body delimited by the end of the connection
                self._wake()
                self._end(None)
            else:
                self._fail(UpstreamError("unreachable", "the upstream closed the connection"
                                         + (f" ({exc})" if exc else "")))

    def pause_writing(self) -> None:  # pragma: no cover - request bodies are small
        pass

    def resume_writing(self) -> None:  # pragma: no cover
        pass

    # ------------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # asked now: once the message is complete, httptools says False whatever the headers said
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        on_data = self.on_data
        if on_data is not None:
            self.deadline = self.loop.time() + self.timeout_s
            try:
                on_data(body)
            except Exception:  # the reader's failure (it counts it): the connection is not reused
                self._fail(UpstreamError("protocol", "the reader failed to take a chunk"))
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()
        self._end(None)

    # ------------------------------------------------------------------ helpers
    def _framed(self) -> bool:
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length" or (low == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()
        self._end(self.error)

    def _end(self, error: UpstreamError | None) -> None:
        on_end = self.on_end
        if on_end is not None:
            self.on_data = self.on_end = None
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            on_end(error)

    def pipe(self, on_data: Any, on_end: Any, timeout_s: float) -> None:
        """Hand what is buffered and then each chunk to ``on_data`` as it arrives; ``on_end``
        once, with None (the body is complete) or the :class:`UpstreamError`. A wait of more
        than ``timeout_s`` for a chunk ends it with a timeout. One timer for the whole body:
        re-armed when it fires before the deadline that each chunk pushes on."""
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        while self.chunks:
            chunk = self.take()
            on_data(chunk)
        if self.error is not None or self.complete:
            on_end(self.error)
            return
        self.on_data, self.on_end = on_data, on_end
        self.deadline = self.loop.time() + timeout_s
        self.timer = self.loop.call_at(self.deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self.timer = None
        if self.on_end is None:
            return
        now = self.loop.time()
        if now >= self.deadline:
            self._fail(UpstreamError("timeout", f"no data from the upstream within {self.timeout_s:g} s "
                                                "(RTRACE_GATEWAY_TIMEOUT_S)"))
        else:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)

    def pause(self, paused: bool) -> None:
        """The piped body's reader cannot take more for now (True) / can again (False)."""
        if self.transport is None or self.closed:
            return
        if paused and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        elif not paused and self.paused:
            self.paused = False
            self.transport.resume_reading()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float, what: str) -> None:
        """Until something happens on the connection, at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter, what, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes | None:
        """The next buffered chunk (None when none is)."""
        if not self.chunks:
            return None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _LOW and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def reusable(self) -> bool:
        return self.complete and self.error is None and not self.closed and self.keep_alive


def _expire(waiter: asyncio.Future, what: str, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamError("timeout", f"no {what} from the upstream within {timeout_s:g} s "
                                                      "(RTRACE_GATEWAY_TIMEOUT_S)"))


class Reply:
    """An upstream response: ``status`` and ``headers`` at once, the body as it comes."""

    __slots__ = ("status", "headers", "_conn", "_upstream", "_timeout_s", "_done")

    def __init__(self, conn: _Conn, upstream: "Upstream", timeout_s: float) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self._conn = conn
        self._upstream = upstream
        self._timeout_s = timeout_s
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def _next(self) -> bytes | None:
        conn = self._conn
        while True:
            chunk = conn.take()
            if chunk is not None:
                return chunk
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return None
            await conn.wait(self._timeout_s, "data")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk, as the upstream sends it."""
        try:
            while True:
                chunk = await self._next()
                if chunk is None:
                    return
                yield chunk
        finally:
            self.close()

    def pipe(self, on_data: Any, on_end: Any) -> None:
        """Pass the body on as it comes: ``on_data(chunk)`` for each chunk, called from the
        socket's read callback; ``on_end(error)`` once at its end (None, or the
        :class:`UpstreamError`). The connection is given back at the end (call :meth:`close`
        after ``on_end``, or :meth:`abort` to stop early). :meth:`pause` for a slow reader."""
        self._conn.pipe(on_data, on_end, self._timeout_s)

    def pause(self, paused: bool) -> None:
        """Stop (True) / resume (False) reading a piped body: the reader's own flow control."""
        self._conn.pause(paused)

    def fail(self, message: str) -> None:
        """End a piped body with a ``protocol`` :class:`UpstreamError` (its reader cannot take
        what the upstream sends): ``on_end`` gets it, the connection is closed."""
        self._conn._fail(UpstreamError("protocol", message))

    def abort(self) -> None:
        """Stop reading: the connection is closed (the upstream sees the request cancelled)."""
        conn = self._conn
        conn.on_data = conn.on_end = None
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if conn.transport is not None and not conn.complete:
            conn.transport.close()
        self.close()

    def close(self) -> None:
        """Give the connection back (kept alive when the response was read to its end)."""
        if not self._done:
            self._done = True
            self._upstream._release(self._conn)


class Upstream:
    """Requests to one OpenAI-compatible server, e.g. ``http://127.0.0.1:8000/v1``.

    Args:
        url: the server's OpenAI base URL (``/v1`` is added when the URL has no path).
        timeout_s: the longest wait for the response head, and then for each chunk.
        connect_timeout_s: the longest wait for a new connection.
        max_idle: idle keep-alive connections kept.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 max_idle: int = 512) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s):// URL")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/") or "/v1"
        self._host_header = parts.netloc.rsplit("@", 1)[-1].encode()
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Conn, self.host, self.port, ssl=self._ssl,
                                       server_hostname=self.host if self._ssl else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError("timeout", f"no connection to the upstream {self.host}:{self.port} within "
                                           f"{self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamError("unreachable", f"cannot connect to the upstream {self.host}:{self.port}: "
                                               f"{exc.strerror or exc}") from None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            import socket

            try:  # small requests must not wait for Nagle's algorithm
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover
                pass
        return conn

    async def request(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> Reply:
        """Send ``method base_path+path`` and return once the response head arrived.

        Raises:
            UpstreamError: unreachable, timed out, or not HTTP.
        """
        lines = [f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode(), b"host: ", self._host_header,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        data = b"".join(lines) + body
        for attempt in (0, 1):
            conn, reused = None, False
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.closed:
                    conn, reused = candidate, True
                    break
            if conn is None:
                conn = await self._connect()
            conn._reset()
            conn.transport.write(data)
            try:
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(self.timeout_s, "response")
            except UpstreamError as exc:
                conn.transport.close()
                if reused and attempt == 0 and exc.kind == "unreachable" and not conn.answered:
                    continue  # a kept-alive connection the server had closed: once more, on a new one
                raise
            except BaseException:  # cancelled (the client went away): the answer would come to nobody
                conn.transport.close()
                raise
            return Reply(conn, self, self.timeout_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def _release(self, conn: _Conn) -> None:
        if conn.reusable and len(self._idle) < self.max_idle:
            conn.waiter = None
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for conn in idle:
            if conn.transport is not None:
                conn.transport.close()


async def identify(upstream: "Upstream", headers: list[tuple[str, str]]) -> str | None:
    """The GenAI provider name of the server behind ``upstream`` (``vllm``, ``sglang``,
    ``openai``), from its ``GET /models``: the ``owned_by`` its model cards carry, or OpenAI's
    own host; None when it does not say (or does not answer)."""
    if upstream.host == "api.openai.com" or upstream.host.endswith(".openai.com"):
        return "openai"
    try:
        reply = await upstream.request("GET", "/models", headers, b"")
    except UpstreamError:
        return None
    parts, size = [], 0
    try:
        async for chunk in reply.chunks():
            size += len(chunk)
            if size > _MODELS_BYTES:
                reply.abort()
                return None
            parts.append(chunk)
    except UpstreamError:
        return None
    if reply.status != 200:
        return None
    try:
        data = json.loads(b"".join(parts))
        owners = {m.get("owned_by") for m in data["data"] if isinstance(m, dict)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    names = {_OWNERS.get(o) for o in owners if isinstance(o, str)}
    return names.pop() if len(names) == 1 and None not in names else None
