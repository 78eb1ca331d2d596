"""The gateway's HTTP/1.1 server: asyncio (uvloop when installed) and the ``httptools`` parser.

Why not uvicorn, which served the gateway before (docs/gateway.md, Performance): per
non-streamed call, uvicorn's request cycle and Starlette's middleware, routing, Request and
Response objects were about a third of the event loop's CPU, and uvicorn writes an answer's
head and body with two socket writes (a write that wakes the client costs ~25 µs on this
VM); each streamed chunk went through an anyio task group, an async generator and two ASGI
layers. Here:

* a model call is handled by the gateway itself (:class:`Request`, ``handler(request)``): the
  whole answer leaves in one write (:meth:`Request.respond`), a stream is written chunk by
  chunk as it comes (:meth:`Request.start` / :meth:`Request.write` / :meth:`Request.end`);
* every other route is the gateway's Starlette app, called as ASGI (:func:`call_asgi`);
* keep-alive (idle connections closed after :data:`KEEP_ALIVE_S`; a request still arriving
  is not idle, but must arrive within :data:`READ_TIMEOUT_S`: 408), pipelined requests
  (answered in order), ``Expect: 100-continue`` (sent once the answers before the request are
  done, never inside one), HEAD and 1xx / 204 / 304 answers without a body, an ``Upgrade``
  (``h2c``) ignored, request bodies bounded (the handler sees ``request.too_large`` and
  answers 413; the connection then closes), flow control (a client that reads slowly pauses
  whoever writes to it: :attr:`Request.on_pause`), the client going away
  (:attr:`Request.on_gone`), a graceful stop (:meth:`Server.stop`).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Awaitable, Callable

import httptools

from .. import _stats

__all__ = ["Request", "Server", "ClientGone", "call_asgi", "new_loop", "KEEP_ALIVE_S"]

#: idle keep-alive connections are closed after this long (OpenAI clients keep connections in
#: their pools for a while)
KEEP_ALIVE_S = 75.0
#: the request head's bytes (URL + headers) accepted
MAX_HEAD_BYTES = 64 * 1024
#: a request's head and body must arrive within this long of its first byte, counted while no
#: earlier answer on the connection is in progress (a client that stalls mid-request is cut: 408)
READ_TIMEOUT_S = 60.0
_STATUS: dict[int, bytes] = {}
#: statuses whose answers have no body and no framing headers (RFC 9110 6.4.1)
_NO_BODY = frozenset((100, 101, 102, 103, 204, 304))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    line = _STATUS.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


_date = [0, b""]


def _date_header() -> bytes:
    """``date: ...\\r\\n``, made once a second."""
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date[1]


class ClientGone(OSError):
    """The client closed its connection (ASGI 2.4: ``send`` raises an ``OSError`` then)."""


class Request:
    """One request, read whole (bounded), and its answer.

    Attributes:
        method, path (percent-decoded), raw_path, query (bytes), http_version ("1.1"),
        headers: lower-case name -> value (str, latin-1; a repeated header keeps its last
        value, as the gateway reads them), raw_headers: [(name, value)] as bytes, body.
        too_large: the body was larger than the server's limit (``body`` is then empty).
        on_gone: called once if the client goes away before the answer ended.
        on_pause: called with True / False when the client's socket buffer fills / drains.
    """

    __slots__ = ("conn", "method", "path", "raw_path", "query", "http_version", "headers", "raw_headers", "body",
                 "too_large", "keep_alive", "on_gone", "on_pause", "started", "finished", "chunked", "bodyless",
                 "_gone_waiter")

    def __init__(self, conn: "_Connection", method: str, raw_path: bytes, query: bytes, http_version: str,
                 raw_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.conn = conn
        self.method = method
        self.raw_path = raw_path
        path = raw_path.decode("latin-1")
        self.path = urllib.parse.unquote(path) if "%" in path else path
        self.query = query
        self.http_version = http_version
        self.raw_headers = raw_headers
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        self.body = b""
        self.too_large = False
        self.keep_alive = keep_alive
        self.on_gone: Callable[[], None] | None = None
        self.on_pause: Callable[[bool], None] | None = None
        self.started = False
        self.finished = False
        self.chunked = False
        #: nothing of the answer's body is written (HEAD, or a status that has none)
        self.bodyless = method == "HEAD"
        self._gone_waiter: asyncio.Future | None = None

    @property
    def gone(self) -> bool:
        """The client's connection is closed."""
        return self.conn.closed

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> list[bytes]:
        out = [_status_line(status), _date_header()]
        for name, value in headers:
            out += (name, b": ", value, b"\r\n")
        out.append(framing)
        if not self.keep_alive:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        return out

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole answer in one write (``content-length`` is added; ``headers`` must not
        carry framing headers). A status that has no body (1xx, 204, 304) is sent without one."""
        if self.started:
            raise RuntimeError("the answer was started already")
        self.started = self.finished = True
        if status in _NO_BODY:
            out = self._head(status, headers, b"")
        else:
            out = self._head(status, headers, b"content-length: %d\r\n" % len(body))
            if self.method != "HEAD":
                out.append(body)
        self.conn.write(b"".join(out))
        self.conn.answered(self)

    def start(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"",
              length: int | None = None) -> None:
        """Start an answer whose body follows (:meth:`write`, :meth:`end`): chunked, or of
        ``length`` bytes when it is known, or delimited by the connection's end (HTTP/1.0)."""
        if self.started:
            raise RuntimeError("the answer was started already")
        self.started = True
        if status in _NO_BODY:  # (an upstream's 204 or 304 relayed): no framing, nothing written after the head
            framing, self.bodyless = b"", True
        elif length is not None:
            framing = b"content-length: %d\r\n" % length
        elif self.http_version == "1.1":
            # a HEAD answer says how the GET answer would be framed, and has no body (no last chunk)
            framing, self.chunked = b"transfer-encoding: chunked\r\n", not self.bodyless
        elif not self.bodyless:
            framing, self.keep_alive = b"", False
        else:
            framing = b""
        out = self._head(status, headers, framing)
        if body and not self.bodyless:
            out.append(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)
        self.conn.write(b"".join(out))

    def write(self, data: bytes) -> None:
        """A part of a started answer."""
        if data and not self.finished and not self.bodyless:
            self.conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def end(self, data: bytes = b"") -> None:
        """The end of a started answer (with its last part)."""
        if self.finished:
            return
        if self.bodyless:
            data = b""
        if self.chunked:
            self.conn.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            self.conn.write(data)
        self.finished = True
        self.conn.answered(self)

    def abort(self) -> None:
        """The answer cannot be completed (the upstream cut it): the client's connection is
        closed, so that the client sees it cut too."""
        self.finished = True
        self.keep_alive = False
        self.conn.close()

    async def disconnected(self) -> None:
        """Until the client goes away (or the answer ended)."""
        if self.conn.closed or self.finished:
            return
        if self._gone_waiter is None:
            self._gone_waiter = asyncio.get_running_loop().create_future()
        await self._gone_waiter

    def _gone(self) -> None:
        waiter, self._gone_waiter = self._gone_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        callback, self.on_gone = self.on_gone, None
        if callback is not None and not self.finished:
            callback()


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as they come, answered in order."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.paused_writing = False
        self.current: Request | None = None
        self.waiting: deque[Request] = deque()
        #: since when the connection has had nothing to do (no request being read or answered)
        self.idle_since = time.monotonic()
        #: since when the request being read has been arriving (None: none is)
        self.reading_since: float | None = None
        self.peer: Any = None
        self.local: Any = None
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._parts: list[bytes] = []
        self._size = 0
        self._request: Request | None = None
        self._method = b""
        self._upgrade = False  # the head asked to switch protocols (ignored: _serve_upgrade)
        self._continue = False  # a "100 Continue" owed once the answers before this request are done

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # an answer must not wait for Nagle's algorithm
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):  # pragma: no cover - not TCP
                pass
        self.peer = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._serve_upgrade(data, exc.args[0] if exc.args else len(data))
        except httptools.HttpParserError as exc:
            self._refuse(400, b"malformed HTTP request: " + str(exc).encode("latin-1", "replace"))
        except _HeadTooLarge:
            self._refuse(431, b"request head too large")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        request = self.current
        if request is not None:
            request._gone()
        self.waiting.clear()

    def pause_writing(self) -> None:
        self.paused_writing = True
        request = self.current
        if request is not None and request.on_pause is not None:
            request.on_pause(True)

    def resume_writing(self) -> None:
        self.paused_writing = False
        request = self.current
        if request is not None and request.on_pause is not None:
            request.on_pause(False)

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        self._reset()
        self.reading_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge()

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._method = method = parser.get_method()
        if parser.should_upgrade():  # served as plain HTTP/1.1 once httptools says where the head ended
            self._upgrade = True
            return
        url = httptools.parse_url(self._url)
        version = parser.get_http_version()
        request = self._request = Request(self, method.decode("ascii"), url.path, url.query or b"",
                                          version, self._headers, parser.should_keep_alive())
        limit = self.server.max_body
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self._too_large(request)
        elif request.headers.get("expect", "").lower() == "100-continue" and not self.closed:
            if self.current is None and not self.waiting:
                self.transport.write(_CONTINUE)
            else:  # not inside the answer in progress: once the answers before it are done (answered())
                self._continue = True

    def on_body(self, body: bytes) -> None:
        request = self._request
        if request is None or request.too_large:
            return
        self._size += len(body)
        if self._size > self.server.max_body:
            self._parts = []
            self._too_large(request)
            return
        self._parts.append(body)

    def on_message_complete(self) -> None:
        request = self._request
        if request is None or request.too_large:
            return  # answered already
        parts = self._parts
        request.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._reset()
        self.reading_since = None
        self._queue(request)

    # ------------------------------------------------------------------ requests and answers
    def _too_large(self, request: Request) -> None:
        """A body over the limit: answered at once (by the handler), then the connection closes."""
        request.too_large = True
        request.keep_alive = False
        self.reading_since = None
        self.transport.pause_reading()  # nothing more of it is read
        self._queue(request)

    def _queue(self, request: Request) -> None:
        if self.current is None:
            self._dispatch(request)
        else:  # pipelined: answered after the ones before it; read no further meanwhile
            self.waiting.append(request)
            self.transport.pause_reading()

    def _dispatch(self, request: Request) -> None:
        self.current = request
        self.server.spawn(request)

    def answered(self, request: Request) -> None:
        """``request``'s answer is complete: the next one, or close, or wait idle."""
        if request is not self.current:
            return
        self.current = None
        if not request.keep_alive:
            self.close()
            return
        if self.waiting:
            self._dispatch(self.waiting.popleft())
            if not self.waiting and not self.closed:
                self.transport.resume_reading()
        else:
            self.idle_since = time.monotonic()
            if self.reading_since is not None:  # the next request is arriving: its time starts now
                self.reading_since = self.idle_since
                if self._continue:
                    self._continue = False
                    self.transport.write(_CONTINUE)

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def _refuse(self, status: int, message: bytes, counter: str = "gateway_refused.bad_http") -> None:
        if not self.closed and self.current is None:
            self.transport.write(_status_line(status) + b"content-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(message), message))
        _stats.incr(counter)
        self.close()

    def read_timeout(self) -> None:
        """The request being read did not arrive within :data:`READ_TIMEOUT_S`: 408, closed."""
        self._refuse(408, b"the request did not arrive within %g s" % READ_TIMEOUT_S,
                     "gateway_refused.request_timeout")

    def _serve_upgrade(self, data: bytes, at: int) -> None:
        """A request that asks to switch protocols (``Upgrade: h2c``, which ``curl --http2``
        sends) is served as HTTP/1.1, which a server may do (RFC 9110 7.8): httptools stops at
        the end of its head (``at`` in ``data``) and would skip its body, so its head is parsed
        again without the ``upgrade`` header, followed by the rest of what came."""
        if not self._upgrade or self._method == b"CONNECT":  # CONNECT always switches: not served
            self._refuse(405, b"CONNECT is not served")
            return
        head = [self._method, b" ", self._url, b" HTTP/", self.parser.get_http_version().encode("ascii"), b"\r\n"]
        for name, value in self._headers:
            if name != b"upgrade" and name != b"http2-settings":
                head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        self.parser = httptools.HttpRequestParser(self)
        self.data_received(b"".join(head) + data[at:])


class _HeadTooLarge(Exception):
    pass


class Server:
    """Serves ``handler(request)`` (a coroutine function that answers each :class:`Request`)
    on ``host:port`` in the running event loop.

    Args:
        handler: called for each request, in a task of its own; it must answer the request.
        max_body: request bodies over this many bytes are not read (``request.too_large``).
    """

    def __init__(self, handler: Callable[[Request], Awaitable[None]], max_body: int) -> None:
        self.handler = handler
        self.max_body = max_body
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self._server: Any = None
        self._sweeper: Any = None

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Start listening; returns the bound ``(host, port)``."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=2048)
        self._sweeper = loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[:2]

    def spawn(self, request: Request) -> None:
        task = asyncio.get_running_loop().create_task(self._run(request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, request: Request) -> None:
        try:
            await self.handler(request)
        except ClientGone:
            pass
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("gateway-handler", "rtrace gateway: a request failed inside the gateway",
                             exc_info=True)
            if not request.started and not request.gone:
                request.keep_alive = False
                request.respond(500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error")
            elif not request.finished:
                request.abort()
        else:
            if not request.finished and not request.gone:  # a handler that forgot to answer
                _stats.incr("internal_errors")
                request.abort()

    async def _sweep(self) -> None:
        """Every few seconds: idle keep-alive connections past :data:`KEEP_ALIVE_S` are closed,
        and so are those whose request has been arriving for more than :data:`READ_TIMEOUT_S`
        (408); a connection with an answer in progress is left alone."""
        while True:
            await asyncio.sleep(min(5.0, KEEP_ALIVE_S, READ_TIMEOUT_S))
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.current is not None or conn.waiting:
                    continue
                if conn.reading_since is None:
                    if now - conn.idle_since > KEEP_ALIVE_S:
                        conn.close()
                elif now - conn.reading_since > READ_TIMEOUT_S:
                    conn.read_timeout()

    async def stop(self, timeout_s: float) -> None:
        """Stop listening, close idle connections, give the requests being answered
        ``timeout_s`` to finish, then close everything."""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.current is None and not conn.waiting:
                conn.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            conn.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed (the gateway extra brings it)."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - Windows, or uvloop missing
        return asyncio.new_event_loop()


async def call_asgi(app: Any, request: Request) -> None:
    """Answer ``request`` with an ASGI application (the gateway's Starlette routes)."""
    conn = request.conn
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": request.http_version, "method": request.method, "scheme": "http",
             "path": request.path, "raw_path": request.raw_path, "query_string": request.query, "root_path": "",
             "headers": request.raw_headers, "client": conn.peer, "server": conn.local, "state": {}}
    received = False
    head: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await request.disconnected()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if request.gone:
            raise ClientGone("the client went away")
        kind = message["type"]
        if kind == "http.response.start":
            head[:] = [message["status"], list(message.get("headers") or ())]
            return
        if kind != "http.response.body" or not head or request.finished:
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if request.started:
            request.write(body) if more else request.end(body)
            return
        status, headers = head
        length = None
        kept = []
        for name, value in headers:
            low = name.lower()
            if low == b"content-length":
                length = int(value)
            elif low != b"transfer-encoding" and low != b"connection":
                kept.append((low, value))
        if not more and (length is None or length == len(body)):
            request.respond(status, kept, body)
        else:
            request.start(status, kept, body, length)
            if not more:
                request.end()

    try:
        await app(scope, receive, send)
    except Exception:
        if not request.gone:  # the client went away: whatever failed after it, nobody waits for it
            raise
