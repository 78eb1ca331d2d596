"""The gateway's ASGI app: the routes in one list, the proxy to the upstream, the session API.

::

    agent (any OpenAI client)        Gateway (this app)                            upstream (vLLM ...)
    POST /v1/chat/completions  --->  read the body (bounded); join (key, session,  --->  + return_token_ids,
      Authorization: Bearer rtk-...    traceparent); open the generation span          logprobs (asked for
      (or traceparent, or a session)   chunks passed on as they come; what the   <---    the gateway only)
                               <---    gateway asked for is taken out again
                                       beside the stream: ids, text, tool calls,
                                       logprobs, version, TTFT -> the span's record

Recording never stands in the call's way: the span is opened and closed on the event loop
(a few microseconds, the same hot path as a decorated call), everything else (conversion,
token2text, health, the sinks) happens in rtrace's threads, and a failure to record is
counted and the call goes on (``gateway_record_errors``). What the client sees is what the
upstream answered it: errors, status codes and bodies pass through unchanged; an upstream
that is down or too slow is a 502 / 504 with an OpenAI-style error, counted.

The model calls are answered by :meth:`Gateway.handle` itself on the gateway's own HTTP
server (rtrace/gateway/http.py: a whole answer in one write, a stream piped chunk by chunk
from the upstream's read callback to the client); the other routes (the session API,
``models``, stats, health, the 404 and 405 answers) are a Starlette app (``gateway.app``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import _stats
from ..instrumentation import _state
from ..instrumentation.propagation import baggage_coordinates
from . import keys as _keys
from .errors import Refused, error_body, error_response
from .http import Request as HttpRequest, call_asgi
from .protocol import (CHAT, COMPLETIONS, RESPONSES, SseSplitter, chunk_kept, dumps, edit, ends_stream, event_data,
                       loads, prepare, strip)
from .recorder import Join, Record, open_call, remote_context
from .session_api import SessionAPI
from .sessions import SessionError, Sessions
from .upstream import Upstream, UpstreamError, identify, shown_url

__all__ = ["Gateway", "SERVED", "error_response"]

#: What the gateway serves, named in its 404 answers.
SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models (the same under "
          "/k/<rollout key>/v1/), "
          "POST /rtrace/sessions, GET /rtrace/sessions/<id>, POST /rtrace/sessions/<id>/reward, "
          "POST /rtrace/sessions/<id>/end, GET /rtrace/stats, GET /rtrace/health")

_PATHS = {CHAT: "/chat/completions", COMPLETIONS: "/completions", RESPONSES: "/responses"}
#: the model calls' routes (POST), answered by Gateway.handle itself
_MODEL_ROUTES = {"/v1" + path: kind for kind, path in _PATHS.items()}
_KEYED_ROUTES = {"v1" + path: kind for kind, path in _PATHS.items()}
#: request headers never passed upstream as they are (hop-by-hop, or replaced by the gateway)
_DROP_REQUEST = frozenset(("host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                           "trailer", "upgrade", "proxy-authorization", "proxy-connection", "expect",
                           "authorization", "accept-encoding", "traceparent", "tracestate"))
#: answer headers not passed to the client (hop-by-hop, or set again by the server)
_DROP_RESPONSE = frozenset((b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"date",
                            b"server"))
_JSON = [(b"content-type", b"application/json")]
#: what _pipe returns when the client closed its connection before the upstream's body ended
CLIENT_GONE = "the client went away during the stream"
#: a whole answer the gateway must strip (it asked for ids or logprobs the client did not) is held
#: up to this many times RTRACE_GATEWAY_MAX_RESPONSE_BYTES (recorded only up to 1x); past it: 502
HOLD_FACTOR = 4


#: while the upstream has not said what it is, it is asked again at most this often (seconds)
IDENTIFY_EVERY_S = 10.0


class UpstreamIdentity:
    """What the upstream is, shared with the calls' records (read in the worker)."""

    __slots__ = ("provider", "address", "port")

    def __init__(self, url: str | None = None) -> None:
        #: ``gen_ai.provider.name`` (``vllm``, ``sglang``, ``openai``); None: not known
        self.provider: str | None = None
        #: OTel's ``server.address`` / ``server.port`` of the calls: the inference server that
        #: answered (the timeline's server track, docs/timeline.md); None: not known
        self.address, self.port = _server_of(url)


def _server_of(url: str | None) -> tuple[str | None, int | None]:
    """``(host, port)`` of an upstream URL (the port its scheme implies when none is written)."""
    if not url:
        return None, None
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None, None
    return parts.hostname or None, port


def _model_route(path: str) -> tuple[str | None, str | None]:
    """``(kind, key in the path)`` of a model call's route; ``(None, None)`` for any other."""
    kind = _MODEL_ROUTES.get(path)
    if kind is not None:
        return kind, None
    if path.startswith("/k/"):
        key, _, rest = path[3:].partition("/")
        kind = _KEYED_ROUTES.get(rest)
        if kind is not None and key:
            return kind, key
    return None, None


def _headers_of(request: Request) -> dict[str, str]:
    """The request's headers as one dict, made once per request (ASGI gives them lower-case;
    Starlette's ``Headers`` scans its list on every lookup)."""
    scope = request.scope
    headers = scope.get("rtrace.headers")
    if headers is None:
        headers = scope["rtrace.headers"] = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    return headers


def _traceparent(value: str) -> Any:
    """The SpanContext of a W3C ``traceparent`` value (None when it is not a valid one)."""
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 \
            or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return remote_context(trace_id, span_id, bool(flags & 1))


class Gateway(SessionAPI):
    """The capture gateway's state, its request handler (:meth:`handle`, served by
    rtrace/gateway/http.py) and the ASGI app of its other routes (``gateway.app``).

    Args:
        settings: rtrace settings (``gateway_*`` ones; ``load_settings()``).
        runtime: returns the runtime calls are recorded with (default: the configured
            one, ``rtrace.configure``); None: not recorded.
        token: the job's bearer token: required on the session API and on calls that join
            by ``traceparent`` alone (the collector's rule: generated when bound beyond loopback).
        finished: ``finished(trace_id) -> bool``: the trajectory was written already (a key of
            it is refused as expired); the collector knows.
        secret: the rollout keys' signing secret (default: ``settings.gateway_secret``, else
            a fresh one; read ``gateway.secret``).
    """

    def __init__(self, settings: Any, runtime: Callable[[], Any] | None = None, token: str | None = None,
                 finished: Callable[[int], bool] | None = None, secret: str | None = None) -> None:
        if not settings.gateway_upstream:
            from ..config import ConfigError

            raise ConfigError("the gateway needs an upstream (RTRACE_GATEWAY_UPSTREAM / --upstream); accepted "
                              "values: an http(s):// URL of an OpenAI-compatible server")
        self.settings = settings
        self.runtime = runtime or _state.get_runtime
        self.token = token or None
        self.finished = finished
        self.secret = secret or settings.gateway_secret or _keys.new_secret()
        self.verify = _keys.Verifier(self.secret)
        self.sessions = Sessions()
        self.upstream_url = settings.gateway_upstream
        #: the upstream as answers show it: without credentials (shown_url)
        self.upstream_shown = shown_url(self.upstream_url)
        self._upstream: Upstream | None = None  # made on the serving loop (its connections belong to it)
        self._sweeper: Any = None
        #: what the upstream is (``gen_ai.provider.name`` of the calls: ``vllm``, ``sglang``, ``openai``),
        #: once it said (identify); asked at start and, while unknown, again with a call at most every
        #: IDENTIFY_EVERY_S
        self.identity = UpstreamIdentity(self.upstream_url)
        self._identifying: Any = None
        self._identified_at = -IDENTIFY_EVERY_S
        #: the base URL clients reach this gateway at (set by the server once it listens)
        self.url: str | None = None
        self.app = Starlette(routes=self.routes(), exception_handlers={404: self._not_found, 405: self._not_allowed})

    def routes(self) -> list[Route]:
        """Every route the gateway serves. The model calls (POST) are answered by
        :meth:`handle` before the app is asked: their entries here answer other methods (405)."""
        return [
            Route("/v1/chat/completions", self._served_natively, methods=["POST"]),
            Route("/v1/completions", self._served_natively, methods=["POST"]),
            Route("/v1/responses", self._served_natively, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/k/{key}/v1/chat/completions", self._served_natively, methods=["POST"]),
            Route("/k/{key}/v1/completions", self._served_natively, methods=["POST"]),
            Route("/k/{key}/v1/responses", self._served_natively, methods=["POST"]),
            Route("/k/{key}/v1/models", self.models, methods=["GET"]),
            Route("/rtrace/sessions", self.open_session, methods=["POST"]),
            Route("/rtrace/sessions/{sid}", self.session_info, methods=["GET"]),
            Route("/rtrace/sessions/{sid}/reward", self.set_reward, methods=["POST"]),
            Route("/rtrace/sessions/{sid}/end", self.end_session, methods=["POST"]),
            Route("/rtrace/stats", self.stats, methods=["GET"]),
            Route("/rtrace/health", self.health, methods=["GET"]),
        ]

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            s = self.settings
            self._upstream = Upstream(self.upstream_url, timeout_s=s.gateway_timeout_s,
                                      connect_timeout_s=min(10.0, s.gateway_timeout_s))
        return self._upstream

    def startup(self) -> None:
        """Called by the server on its loop once it listens."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._identify(self._headers({}, None, None))

    def _identify(self, headers: list[tuple[str, str]]) -> None:
        """Ask the upstream what it is, in a task of its own, unless it said already, is being
        asked, or was asked within IDENTIFY_EVERY_S (an upstream still starting answers later)."""
        loop = asyncio.get_running_loop()
        if self.identity.provider is not None or self._identifying is not None \
                or loop.time() - self._identified_at < IDENTIFY_EVERY_S:
            return
        self._identified_at = loop.time()

        async def ask() -> None:
            try:
                self.identity.provider = await identify(self.upstream, headers)
            except Exception:
                _stats.incr("internal_errors")
            finally:
                self._identifying = None

        self._identifying = loop.create_task(ask())

    async def shutdown(self) -> None:
        """Called by the server on its loop once it stopped serving."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._identifying is not None:
            self._identifying.cancel()
        if self._upstream is not None:  # its connections belong to the loop that ends now
            self._upstream.close()
            self._upstream = None
        self.sessions.close_all()

    async def _sweep(self) -> None:
        """Once a second: sessions past their time to live are forgotten and written partial."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self.sessions.sweep()
            except Exception:
                _stats.incr("internal_errors")

    # ------------------------------------------------------------------ serving
    async def handle(self, request: HttpRequest) -> None:
        """Answer one request (rtrace/gateway/http.py calls it)."""
        kind, key = _model_route(request.path) if request.method == "POST" else (None, None)
        if kind is not None:
            _stats.incr("gateway_calls")
        if request.too_large:
            limit = self.settings.gateway_max_request_bytes
            length = request.headers.get("content-length")
            self._refuse(request, Refused(413, "request_too_large", (
                f"rtrace gateway: the request body ({length} bytes) is larger than {limit} bytes "
                if length is not None and length.isdigit() else
                f"rtrace gateway: the request body is larger than {limit} bytes ")
                + "(RTRACE_GATEWAY_MAX_REQUEST_BYTES)"))
            return
        if kind is not None:
            await self._model_call(request, kind, key)
        else:
            await call_asgi(self.app, request)

    @staticmethod
    def _refuse(request: HttpRequest, refused: Refused) -> None:
        request.respond(refused.status, _JSON, refused.body())

    async def _served_natively(self, request: Request) -> Response:  # pragma: no cover - handle() answers them
        raise RuntimeError("model calls are answered by Gateway.handle")

    # ------------------------------------------------------------------ errors
    async def _not_found(self, request: Request, exc: Exception) -> Response:
        _stats.incr("gateway_refused.not_found")
        return error_response(404, "not_found", f"rtrace gateway: {request.method} {request.url.path} is not "
                                                f"served; served: {SERVED}")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        _stats.incr("gateway_refused.method_not_allowed")
        return error_response(405, "method_not_allowed", f"rtrace gateway: {request.method} {request.url.path} is "
                                                         f"not served; served: {SERVED}")

    # ------------------------------------------------------------------ the request
    async def _body(self, request: Request) -> bytes:
        """The body of a request to the Starlette routes (bounded by the server already)."""
        return await request.body()

    def _key(self, headers: dict[str, str], path_key: str | None = None) -> str | None:
        if path_key:
            return path_key
        auth = headers.get("authorization")
        if not auth:
            return None
        return auth[7:].strip() if auth[:7].lower() == "bearer " else auth.strip()

    def _join(self, headers: dict[str, str], key: str | None) -> Join:
        """How this call joins a trajectory, from its key, ``traceparent`` and ``baggage``."""
        tp = headers.get("traceparent")
        remote = _traceparent(tp) if tp else None
        if key is not None and _keys.is_rollout_key(key):
            try:
                claims = self.verify(key)
            except _keys.KeyRefused as exc:
                raise Refused(401, f"key_{exc.code}", f"rtrace gateway: {exc}") from None
            if claims.session is not None:
                try:
                    session = self.sessions.get(claims.session)
                except SessionError:
                    raise Refused(401, "session_ended", "rtrace gateway: the session of this key has ended or "
                                                         "expired") from None
                session.calls += 1
                if not session.traced:
                    return Join("untraced", "session")
                return Join("session", "session", remote, session.coords, session)
            if self.finished is not None and self.finished(claims.trace_id):
                raise Refused(401, "rollout_ended", "rtrace gateway: the rollout of this key has ended (its "
                                                     "trajectory was written)")
            if not claims.sampled:
                return Join("untraced", "key")  # the trainer does not record this rollout
            parent = remote if remote is not None and remote.trace_id == claims.trace_id and \
                remote.trace_flags.sampled else remote_context(claims.trace_id, claims.span_id)
            return Join("segment", "key", parent, claims.coords)
        if remote is not None:
            if self.token and key != self.token:
                raise Refused(401, "token_required", "rtrace gateway: a call that joins by traceparent alone must "
                                                      "carry the job's token as its API key (the gateway listens "
                                                      "beyond loopback)")
            if not remote.trace_flags.sampled:
                return Join("untraced", "traceparent")  # the caller does not record this trace
            coords = baggage_coordinates(headers) if "baggage" in headers else {}
            return Join("segment", "traceparent", remote, coords)
        mode = self.settings.gateway_untraced
        if mode == "refuse":
            raise Refused(401, "no_rollout", "rtrace gateway: this call names no rollout: use the key of "
                                              "rtrace.gateway_access() or of a session (POST /rtrace/sessions), or "
                                              "send a traceparent; RTRACE_GATEWAY_UNTRACED=forward|record lets "
                                              "such calls through")
        return Join("own" if mode == "record" else "untraced", "none")

    def _headers(self, headers: dict[str, str], key: str | None, traceparent: str | None) -> list[tuple[str, str]]:
        """The headers sent upstream: the client's (less hop-by-hop ones), the upstream's
        key as configured, and the call span's ``traceparent``."""
        out: list[tuple[str, str]] = [("accept-encoding", "identity")]
        for name, value in headers.items():
            if name not in _DROP_REQUEST:
                out.append((name, value))
        upstream_key = self.settings.gateway_upstream_key
        if upstream_key:
            out.append(("authorization", f"Bearer {upstream_key}"))
        elif key and not _keys.is_rollout_key(key) and key != self.token:
            out.append(("authorization", f"Bearer {key}"))  # the client's own key for the upstream
        if traceparent is not None:
            out.append(("traceparent", traceparent))
        elif "traceparent" in headers:  # untraced: the caller's context passes as it came
            out.append(("traceparent", headers["traceparent"]))
            if "tracestate" in headers:
                out.append(("tracestate", headers["tracestate"]))
        return out

    # ------------------------------------------------------------------ model calls
    async def _model_call(self, request: HttpRequest, kind: str, path_key: str | None) -> None:
        headers = request.headers
        try:
            body = request.body
            try:
                payload = loads(body)
            except ValueError:
                raise Refused(400, "invalid_json", "rtrace gateway: the request body is not JSON") from None
            if type(payload) is not dict:
                raise Refused(400, "invalid_body", "rtrace gateway: the request body is not a JSON object")
            key = self._key(headers, path_key)
            join = self._join(headers, key)
        except Refused as refused:
            return self._refuse(request, refused)
        call = None
        if join.mode != "untraced":
            rt = self.runtime()
            if rt is not None:
                try:
                    call = open_call(rt, join, kind, payload.get("model"))
                except Exception:
                    _stats.incr("gateway_record_errors")
                    _stats.warn_once("gateway-open", "rtrace gateway could not open a call's span; it goes through "
                                                     "untraced", exc_info=True)
            if call is None:
                _stats.incr("gateway_calls_not_recorded")
        if call is None:
            _stats.incr("gateway_calls_untraced")
            return await self._forward(request, _PATHS[kind], body, self._headers(headers, key, None))
        _stats.incr("gateway_calls_recorded")
        s = self.settings
        sent, asked = prepare(payload, kind, s.gateway_token_ids, s.gateway_logprobs)
        up_headers = self._headers(headers, key, call.traceparent)
        data = dumps(sent) if sent is not payload else body
        record = Record(call, kind, payload, asked, self.settings, self.runtime, self.identity)
        if self.identity.provider is None:
            self._identify(self._headers(headers, key, None))
        try:
            reply = await self.upstream.request("POST", _PATHS[kind], up_headers, data)
        except UpstreamError as exc:
            record.finish(error=f"upstream {exc.kind}: {exc}")
            return self._upstream_error(request, exc)
        except BaseException:
            record.finish(error="the client went away")
            raise
        if reply.status != 200 or payload.get("stream") is not True or \
                not (reply.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return await self._whole(request, reply, record)
        return await self._stream(request, reply, record)

    def _upstream_error(self, request: HttpRequest, exc: UpstreamError) -> None:
        status = 504 if exc.kind == "timeout" else 502
        _stats.incr(f"gateway_upstream_errors.{exc.kind}")
        request.respond(status, _JSON, error_body(status, f"upstream_{exc.kind}",
                                                  f"rtrace gateway: upstream {self.upstream_shown}: {exc}"))

    async def _whole(self, request: HttpRequest, reply: Any, record: "Record") -> None:
        """A whole answer: read, recorded, stripped of what the gateway asked for, sent in one write."""
        limit = self.settings.gateway_max_response_bytes
        # What the gateway asked for must come out at any size (the client sees what the upstream
        # answers it), so such an answer is held whole up to a hard bound; one with nothing to
        # take out is passed on as it comes once it is over the cap.
        strips = bool(record.asked) and reply.status == 200
        hold = limit * HOLD_FACTOR if strips else limit
        headers = _response_headers(reply.headers)
        parts: list[bytes] = []
        size = 0
        chunks = reply.chunks()
        try:
            async for chunk in chunks:
                size += len(chunk)
                parts.append(chunk)
                if size > hold:
                    break
        except UpstreamError as exc:
            record.finish(error=f"upstream {exc.kind}: {exc}")
            return self._upstream_error(request, exc)
        except BaseException:
            record.finish(error="the client went away")
            await chunks.aclose()
            raise
        if size > hold:
            _stats.incr("gateway_responses_too_large")
            record.status = reply.status
            if strips:  # it cannot be stripped within bounds, and must not reach the client unstripped
                reply.abort()
                _stats.incr("gateway_responses_refused_too_large")
                record.gap("too_large", f"the answer is larger than {hold} bytes ({HOLD_FACTOR} x "
                                        "RTRACE_GATEWAY_MAX_RESPONSE_BYTES): refused (502), not recorded")
                message = (f"rtrace gateway: the upstream's answer is larger than {hold} bytes, the most the "
                           f"gateway holds ({HOLD_FACTOR} x RTRACE_GATEWAY_MAX_RESPONSE_BYTES) to take out the "
                           "token ids / logprobs it asked for on its own behalf; raise "
                           "RTRACE_GATEWAY_MAX_RESPONSE_BYTES, or ask for them in the request (return_token_ids, "
                           "logprobs) so that the gateway passes the answer through")
                record.finish(error=message)
                return request.respond(502, _JSON, error_body(502, "upstream_response_too_large", message))
            # too large to hold, nothing to take out: passed through as it comes, not recorded
            record.gap("too_large", f"the answer is larger than {limit} bytes (RTRACE_GATEWAY_MAX_RESPONSE_BYTES): "
                                    "passed through, not recorded")
            error = await self._relay(request, reply, headers, parts)
            record.finish(error=error if error is not None else
                          None if reply.status == 200 else f"upstream answered {reply.status}")
            return
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        del parts
        record.status = reply.status
        # The span ends before the answer leaves: the client may end its rollout as soon as it has
        # the answer, and a span that ends after its trajectory's root would come too late.
        if reply.status != 200:
            _stats.incr("gateway_upstream_errors.status")
            record.finish(error=_error_text(reply.status, raw))
            return request.respond(reply.status, headers, raw)
        recorded = size <= limit
        if recorded:
            record.raw = raw  # read in the worker (recorder.Reading)
        else:  # held only to be stripped
            _stats.incr("gateway_responses_too_large")
            record.gap("too_large", f"the answer is larger than {limit} bytes (RTRACE_GATEWAY_MAX_RESPONSE_BYTES): "
                                    "stripped and passed on, not recorded")
        if record.asked:
            out, _ = edit(raw, record.asked)
            if out is None:  # not something edit() can tell: parsed, stripped, encoded again
                try:
                    data = loads(raw)
                except ValueError:
                    data = None
                if type(data) is dict:
                    if recorded:
                        record.data, record.raw = data, None  # (the worker reads it before it is stripped)
                        data = dict(data)  # stripped as a copy: the worker reads the original
                        if type(data.get("choices")) is list:
                            data["choices"] = [dict(c) if type(c) is dict else c for c in data["choices"]]
                    strip(data, record.asked)
                    out = dumps(data)
                else:
                    out = raw  # not JSON: as it came (the worker notes the gap)
            raw = out
        record.finish()
        request.respond(reply.status, headers, raw)

    async def _relay(self, request: HttpRequest, reply: Any, headers: list[tuple[bytes, bytes]],
                     parts: list[bytes]) -> str | None:
        """Pass an answer on as it comes (chunked), after ``parts`` read already; returns the
        error that cut it, if any (the client's connection is then cut too)."""
        request.start(reply.status, headers, b"".join(parts))
        error = await self._pipe(request, reply, request.write)
        request.end()
        return error

    async def _pipe(self, request: HttpRequest, reply: Any, on_data: Callable[[bytes], None]) -> str | None:
        """Hand each chunk of ``reply`` to ``on_data`` as it arrives (from the upstream's read
        callback: no task wakes per chunk), the client's flow control pausing the upstream,
        until the body ends; returns the error that cut it (None: complete; the caller ends
        the client's answer). An upstream that cut its answer cuts the client's too."""
        done = asyncio.get_running_loop().create_future()

        def on_end(error: Any) -> None:
            if not done.done():
                done.set_result(error)

        def on_gone() -> None:
            reply.abort()  # the upstream sees the request cancelled (vLLM stops generating)
            on_end("gone")

        request.on_gone = on_gone
        request.on_pause = reply.pause
        try:
            if request.gone:  # it went away before the answer started: nothing is read for nobody
                on_gone()
            else:
                if request.conn.paused_writing:
                    reply.pause(True)
                reply.pipe(on_data, on_end)
            error = await done
        except BaseException:  # cancelled (the server stops)
            reply.abort()
            request.abort()
            raise
        finally:
            request.on_gone = request.on_pause = None
        if error == "gone":
            return CLIENT_GONE
        reply.close()
        if error is not None:
            _stats.incr(f"gateway_upstream_errors.{error.kind}")
            request.abort()  # the client's answer is cut (no final chunk), as the upstream cut it
            return f"upstream {error.kind} during the stream: {error}"
        return None

    async def _stream(self, request: HttpRequest, reply: Any, record: "Record") -> None:
        """A streamed answer: each chunk passed on as soon as it is whole (an event cut
        between two network reads waits for its end when something must be taken out)."""
        asked = record.asked
        limit = self.settings.gateway_max_response_bytes
        hold = limit * HOLD_FACTOR  # the most of one event held to strip it
        splitter = SseSplitter()
        size = 0
        #: the last bytes passed to the client: did they end the answer? (a client that closes then
        #: closes a complete answer: see below)
        tail = b""

        events = record.events
        now = time.time_ns

        def on_data(chunk: bytes) -> None:
            nonlocal size, tail
            size += len(chunk)
            if size > limit and record.capturing:
                record.capturing = False
                _stats.incr("gateway_responses_too_large")
                record.gap("too_large", f"the streamed answer is larger than {limit} bytes "
                                        "(RTRACE_GATEWAY_MAX_RESPONSE_BYTES): recorded up to there")
            if not asked:
                request.write(chunk)  # as it came; kept beside, once the chunk is on its way
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
                if record.capturing:
                    at = now()
                    for event in splitter.feed(chunk):
                        data = event_data(event)
                        if data is not None:
                            events.append((at, data))
                return
            out = []
            at = now()
            for event in splitter.feed(chunk):
                data = event_data(event)
                if data is None:
                    out.append(event + b"\n\n")
                    continue
                if record.capturing:
                    events.append((at, data))  # as it came: read in the worker
                if data == b"[DONE]":
                    out.append(event + b"\n\n")
                    continue
                # (a chunk is small: orjson's parse and encoding take ~4 µs, edit() ~15)
                try:
                    obj = loads(data)
                except ValueError:
                    obj = None
                if type(obj) is not dict or not strip(obj, asked):
                    out.append(event + b"\n\n")  # nothing taken out: the event's bytes as they came
                elif chunk_kept(obj):
                    out.append(_event_with(event, dumps(obj)))
            if out:
                data = b"".join(out)
                request.write(data)
                tail = data[-_TAIL:] if len(data) >= _TAIL else (tail + data)[-_TAIL:]
            if splitter.pending > hold:  # an event too large to hold and strip: the stream is cut, not leaked
                _stats.incr("gateway_responses_refused_too_large")
                reply.fail(f"a streamed event larger than {hold} bytes ({HOLD_FACTOR} x "
                           "RTRACE_GATEWAY_MAX_RESPONSE_BYTES): too large to take out what the gateway asked for")

        record.status = reply.status
        request.start(reply.status, _response_headers(reply.headers))
        try:
            error = await self._pipe(request, reply, on_data)
        except BaseException:
            record.finish(error="the gateway stopped during the stream")
            raise
        if error == CLIENT_GONE and (_done(tail) or (events and ends_stream(
                events[-1][1], record.payload.get("n") in (None, 1)))):
            # The client closed after the answer's end had reached it: the openai SDK closes as soon
            # as it reads `data: [DONE]`, which may come before the upstream's body has ended (its
            # last chunk a little later). What it got is the whole answer, not a cut one.
            record.ended = True
            error = None
        # the span ends before the client's answer does (see _whole)
        record.finish(error=error)
        # an unterminated last event: held back only when something had to be taken out
        request.end(splitter.rest() if error is None and asked else b"")

    async def _forward(self, request: HttpRequest, path: str, body: bytes, headers: list[tuple[str, str]]) -> None:
        """An untraced call: to the upstream and back as it is."""
        try:
            reply = await self.upstream.request("POST", path, headers, body)
        except UpstreamError as exc:
            return self._upstream_error(request, exc)
        if reply.status != 200:
            _stats.incr("gateway_upstream_errors.status")
        await self._relay(request, reply, _response_headers(reply.headers), [])

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the upstream's answer (any call that may reach the upstream may ask)."""
        headers = _headers_of(request)
        try:
            key = self._key(headers, request.path_params.get("key"))
            self._join(headers, key)
        except Refused as refused:
            return refused.response()
        try:
            reply = await self.upstream.request("GET", "/models", self._headers(headers, key, None), b"")
        except UpstreamError as exc:
            status = 504 if exc.kind == "timeout" else 502
            _stats.incr(f"gateway_upstream_errors.{exc.kind}")
            return error_response(status, f"upstream_{exc.kind}", f"rtrace gateway: upstream {self.upstream_shown}: "
                                                                  f"{exc}")
        if reply.status != 200:
            _stats.incr("gateway_upstream_errors.status")

        async def body_of() -> Any:
            try:
                async for chunk in reply.chunks():
                    yield chunk
            finally:
                reply.close()  # also when the client went away (the generator is not finished then)

        headers_out = {k.decode("latin-1"): v.decode("latin-1") for k, v in _response_headers(reply.headers)}
        return StreamingResponse(body_of(), reply.status, headers=headers_out)

    def _admin(self, request: Request) -> None:
        if self.token:
            auth = _headers_of(request).get("authorization") or ""
            if auth[:7].lower() != "bearer " or auth[7:].strip() != self.token:
                raise Refused(401, "token_required", "rtrace gateway: the session API needs the job's token "
                                                      "(Authorization: Bearer $RTRACE_COLLECTOR_TOKEN)")

    async def _json(self, request: Request, required: bool = True) -> dict[str, Any]:
        body = await self._body(request)
        if not body.strip() and not required:
            return {}
        try:
            data = loads(body)
        except ValueError:
            raise Refused(400, "invalid_json", "rtrace gateway: the request body is not JSON") from None
        if type(data) is not dict:
            raise Refused(400, "invalid_body", "rtrace gateway: the request body is not a JSON object")
        return data

    async def stats(self, request: Request) -> Response:
        """``GET /rtrace/stats``: rtrace's counters in this process (``rtrace.stats()``'s)."""
        try:
            self._admin(request)
        except Refused as refused:
            return refused.response()
        out = dict(_stats.snapshot())
        out["gateway_sessions_open"] = len(self.sessions)
        rt = self.runtime()
        gauges = getattr(getattr(rt, "intake", None), "gauges", None)
        if callable(gauges):  # the recording pipeline's open trajectories and queued spans
            out.update(gauges())
        return _json_response(out)

    async def health(self, request: Request) -> Response:
        """``GET /rtrace/health``: 200 while the gateway serves."""
        return _json_response({"status": "ok", "upstream": self.upstream_shown})


#: the bytes of the answer's end kept to tell whether a closing client had it (``data: [DONE]``)
_TAIL = 32


def _done(tail: bytes) -> bool:
    """The stream passed on so far ends with a whole ``data: [DONE]`` event."""
    tail = tail.replace(b"\r\n", b"\n")
    return tail.endswith(b"\n\n") and event_data(tail.rstrip().rsplit(b"\n", 1)[-1]) == b"[DONE]"


def _error_text(status: int, raw: bytes) -> str:
    """The span's error for an upstream that answered ``status``: its OpenAI error message
    when it sent one (bounded)."""
    message = None
    try:
        data = loads(raw)
        err = data.get("error") if type(data) is dict else None
        message = err.get("message") if type(err) is dict else (err if isinstance(err, str) else None)
    except ValueError:
        pass
    return f"upstream answered {status}" + (f": {str(message)[:2000]}" if message else "")


def _event_with(event: bytes, data: bytes) -> bytes:
    """An SSE ``event`` (without its blank line) with ``data`` as its data, ended: its other
    lines (``event:``, ``id:``, ``retry:``, comments) kept in place."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return b"data: " + data + b"\n\n"
    out, placed = [], False
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            out.append(line)
        elif not placed:
            out.append(b"data: " + data)
            placed = True
    return b"\n".join(out) + b"\n\n"


def _response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in _DROP_RESPONSE]


def _json_response(data: dict[str, Any], status: int = 200) -> Response:
    return Response(dumps(data), status, media_type="application/json")
