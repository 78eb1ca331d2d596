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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import _stats
from ..instrumentation import _state
from ..instrumentation.propagation import baggage_coordinates
from . import keys as _keys
from .protocol import CHAT, COMPLETIONS, Capture, SseSplitter, dumps, event_data, loads, prepare, strip, strip_chunk
from .recorder import Join, open_call, remote_context
from .sessions import SessionError, Sessions
from .upstream import TooLarge, Upstream, UpstreamError

__all__ = ["Gateway", "SERVED", "error_response"]

#: What the gateway serves, named in its 404 answers.
SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models (the same under /k/<rollout key>/v1/), "
          "POST /rtrace/sessions, GET /rtrace/sessions/<id>, POST /rtrace/sessions/<id>/reward, "
          "POST /rtrace/sessions/<id>/end, GET /rtrace/stats, GET /rtrace/health")

_PATHS = {CHAT: "/chat/completions", COMPLETIONS: "/completions"}
#: request headers never passed upstream as they are (hop-by-hop, or replaced by the gateway)
_DROP_REQUEST = frozenset(("host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                           "trailer", "upgrade", "proxy-authorization", "proxy-connection", "expect",
                           "authorization", "accept-encoding", "traceparent", "tracestate"))
#: answer headers not passed to the client (hop-by-hop, or set again by the server)
_DROP_RESPONSE = frozenset((b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"date",
                            b"server"))
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 502: "api_error", 503: "api_error",
                504: "api_error"}


def error_response(status: int, code: str, message: str) -> Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    body = dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": None,
                            "code": code}})
    return Response(body, status, media_type="application/json")


class _Refused(Exception):
    """A request answered with an OpenAI-style error (counted as ``gateway_refused.<code>``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self) -> Response:
        _stats.incr(f"gateway_refused.{self.code}")
        return error_response(self.status, self.code, str(self))


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


class Gateway:
    """The capture gateway's state and ASGI app (``gateway.app``).

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
        self._upstream: Upstream | None = None  # made on the serving loop (its connections belong to it)
        #: the base URL clients reach this gateway at (set by the server once it listens)
        self.url: str | None = None
        self.app = Starlette(routes=self.routes(), exception_handlers={404: self._not_found, 405: self._not_allowed},
                             lifespan=self._lifespan)

    def routes(self) -> list[Route]:
        """Every route the gateway serves."""
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/k/{key}/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/k/{key}/v1/completions", self.completions, methods=["POST"]),
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

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> Any:
        sweeper = asyncio.get_running_loop().create_task(self._sweep())
        yield
        sweeper.cancel()
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
        limit = self.settings.gateway_max_request_bytes
        length = _headers_of(request).get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refused(413, "request_too_large", f"rtrace gateway: the request body ({length} bytes) is larger "
                                                     f"than {limit} bytes (RTRACE_GATEWAY_MAX_REQUEST_BYTES)")
        parts, size = [], 0
        receive, more = request.receive, True
        while more:  # the ASGI messages as they come (Starlette's request.stream() adds layers)
            message = await receive()
            if message["type"] != "http.request":
                raise _Refused(400, "client_disconnected", "rtrace gateway: the client went away")
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > limit:
                raise _Refused(413, "request_too_large", f"rtrace gateway: the request body is larger than {limit} "
                                                         "bytes (RTRACE_GATEWAY_MAX_REQUEST_BYTES)")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _key(self, request: Request) -> str | None:
        key = request.path_params.get("key")
        if key:
            return key
        auth = _headers_of(request).get("authorization")
        if not auth:
            return None
        return auth[7:].strip() if auth[:7].lower() == "bearer " else auth.strip()

    def _join(self, request: Request, key: str | None) -> Join:
        """How this call joins a trajectory, from its key, ``traceparent`` and ``baggage``."""
        headers = _headers_of(request)
        tp = headers.get("traceparent")
        remote = _traceparent(tp) if tp else None
        if key is not None and _keys.is_rollout_key(key):
            try:
                claims = self.verify(key)
            except _keys.KeyRefused as exc:
                raise _Refused(401, f"key_{exc.code}", f"rtrace gateway: {exc}") from None
            if claims.session is not None:
                try:
                    session = self.sessions.get(claims.session)
                except SessionError:
                    raise _Refused(401, "session_ended", "rtrace gateway: the session of this key has ended or "
                                                         "expired") from None
                session.calls += 1
                if not session.traced:
                    return Join("untraced", "session")
                return Join("session", "session", remote, session.coords, session)
            if self.finished is not None and self.finished(claims.trace_id):
                raise _Refused(401, "rollout_ended", "rtrace gateway: the rollout of this key has ended (its "
                                                     "trajectory was written)")
            if not claims.sampled:
                return Join("untraced", "key")  # the trainer does not record this rollout
            parent = remote if remote is not None and remote.trace_id == claims.trace_id and \
                remote.trace_flags.sampled else remote_context(claims.trace_id, claims.span_id)
            return Join("segment", "key", parent, claims.coords)
        if remote is not None:
            if self.token and key != self.token:
                raise _Refused(401, "token_required", "rtrace gateway: a call that joins by traceparent alone must "
                                                      "carry the job's token as its API key (the gateway listens "
                                                      "beyond loopback)")
            if not remote.trace_flags.sampled:
                return Join("untraced", "traceparent")  # the caller does not record this trace
            coords = baggage_coordinates(headers) if "baggage" in headers else {}
            return Join("segment", "traceparent", remote, coords)
        mode = self.settings.gateway_untraced
        if mode == "refuse":
            raise _Refused(401, "no_rollout", "rtrace gateway: this call names no rollout: use the key of "
                                              "rtrace.gateway_access() or of a session (POST /rtrace/sessions), or "
                                              "send a traceparent; RTRACE_GATEWAY_UNTRACED=forward|record lets "
                                              "such calls through")
        return Join("own" if mode == "record" else "untraced", "none")

    def _headers(self, request: Request, key: str | None, traceparent: str | None) -> list[tuple[str, str]]:
        """The headers sent upstream: the client's (less hop-by-hop ones), the upstream's
        key as configured, and the call span's ``traceparent``."""
        out: list[tuple[str, str]] = [("accept-encoding", "identity")]
        headers = _headers_of(request)
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
    async def chat_completions(self, request: Request) -> Response:
        return await self._model_call(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._model_call(request, COMPLETIONS)

    async def _model_call(self, request: Request, kind: str) -> Response:
        _stats.incr("gateway_calls")
        try:
            body = await self._body(request)
            try:
                payload = loads(body)
            except ValueError:
                raise _Refused(400, "invalid_json", "rtrace gateway: the request body is not JSON") from None
            if type(payload) is not dict:
                raise _Refused(400, "invalid_body", "rtrace gateway: the request body is not a JSON object")
            key = self._key(request)
            join = self._join(request, key)
        except _Refused as refused:
            return refused.response()
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
            return await self._forward(request, kind, body, self._headers(request, key, None))
        _stats.incr("gateway_calls_recorded")
        s = self.settings
        sent, asked = prepare(payload, kind, s.gateway_token_ids, s.gateway_logprobs)
        headers = self._headers(request, key, call.traceparent)
        data = dumps(sent) if sent is not payload else body
        record = _Record(self, call, kind, payload, asked)
        try:
            reply = await self.upstream.request("POST", _PATHS[kind], headers, data)
        except UpstreamError as exc:
            record.finish(error=f"upstream {exc.kind}: {exc}")
            return self._upstream_error(exc)
        except BaseException:
            record.finish(error="the client went away")
            raise
        if reply.status != 200 or payload.get("stream") is not True or \
                not (reply.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return await self._whole(reply, record)
        return self._stream(reply, record)

    def _upstream_error(self, exc: UpstreamError) -> Response:
        status = 504 if exc.kind == "timeout" else 502
        _stats.incr(f"gateway_upstream_errors.{exc.kind}")
        return error_response(status, f"upstream_{exc.kind}", f"rtrace gateway: upstream {self.upstream_url}: {exc}")

    async def _whole(self, reply: Any, record: "_Record") -> Response:
        """A whole answer: read, recorded, stripped of what the gateway asked for."""
        limit = self.settings.gateway_max_response_bytes
        headers = _response_headers(reply.headers)
        parts: list[bytes] = []
        size = 0
        chunks = reply.chunks()
        try:
            async for chunk in chunks:
                size += len(chunk)
                parts.append(chunk)
                if size > limit:
                    break
        except UpstreamError as exc:
            record.finish(error=f"upstream {exc.kind}: {exc}")
            return self._upstream_error(exc)
        except BaseException:
            record.finish(error="the client went away")
            await chunks.aclose()
            raise
        if size > limit:  # too large to hold: passed through as it comes, not recorded
            _stats.incr("gateway_responses_too_large")
            record.gap("too_large", f"the answer is larger than {limit} bytes (RTRACE_GATEWAY_MAX_RESPONSE_BYTES): "
                                    "passed through, not recorded")
            record.status = reply.status

            async def rest() -> Any:
                try:
                    for part in parts:
                        yield part
                    async for chunk in chunks:
                        yield chunk
                finally:
                    reply.close()
                    record.finish(error=None if reply.status == 200 else f"upstream answered {reply.status}")

            return StreamingResponse(rest(), reply.status, headers=headers)
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        record.status = reply.status
        # The span ends before the answer leaves: the client may end its rollout as soon as it has
        # the answer, and a span that ends after its trajectory's root would come too late.
        if reply.status != 200:
            _stats.incr("gateway_upstream_errors.status")
            record.finish(error=_error_text(reply.status, raw))
            return Response(raw, reply.status, headers=headers)
        try:
            data = loads(raw)
        except ValueError:
            data = None
        if type(data) is not dict:
            record.gap("unreadable", "the upstream's answer is not a JSON object")
            record.finish()
            return Response(raw, reply.status, headers=headers)
        record.capture.response(data)
        if record.asked:
            strip(data, record.asked)
            raw = dumps(data)
        record.finish()
        return Response(raw, reply.status, headers=headers)

    def _stream(self, reply: Any, record: "_Record") -> Response:
        """A streamed answer: each chunk passed on as soon as it is whole (an event cut
        between two network reads waits for its end when something must be taken out)."""
        asked = record.asked
        capture = record.capture
        limit = self.settings.gateway_max_response_bytes

        async def events() -> Any:
            splitter = SseSplitter()
            size = 0
            error = None
            try:
                async for chunk in reply.chunks():
                    size += len(chunk)
                    if size > limit and record.capturing:
                        record.capturing = False
                        _stats.incr("gateway_responses_too_large")
                        record.gap("too_large", f"the streamed answer is larger than {limit} bytes "
                                                "(RTRACE_GATEWAY_MAX_RESPONSE_BYTES): recorded up to there")
                    if not asked:
                        yield chunk  # as it came; read beside, once the chunk is on its way
                        if record.capturing:
                            record.read_events(splitter.feed(chunk))
                        continue
                    out = []
                    for event in splitter.feed(chunk):
                        data = event_data(event)
                        obj = None
                        if data is not None and data != b"[DONE]":
                            try:
                                obj = loads(data)
                            except ValueError:
                                obj = None
                        if type(obj) is dict:
                            if record.capturing:
                                capture.chunk(obj)
                            if strip_chunk(obj, asked):
                                out.append(b"data: " + dumps(obj) + b"\n\n")
                        else:
                            if data == b"[DONE]":
                                capture.done = True
                            out.append(event + b"\n\n")
                    if out:
                        yield b"".join(out)
                rest = splitter.rest()
                if rest:
                    yield rest
            except UpstreamError as exc:
                error = f"upstream {exc.kind} during the stream: {exc}"
                _stats.incr(f"gateway_upstream_errors.{exc.kind}")
                raise  # the client's stream is cut too (no final chunk), as the upstream cut it
            except BaseException:
                error = "the client went away during the stream"
                raise
            finally:
                reply.close()
                record.finish(error=error)

        record.status = reply.status
        return StreamingResponse(events(), reply.status, headers=_response_headers(reply.headers))

    async def _forward(self, request: Request, kind: str | None, body: bytes, headers: list[tuple[str, str]],
                       method: str = "POST", path: str | None = None) -> Response:
        """An untraced call: to the upstream and back as it is."""
        try:
            reply = await self.upstream.request(method, path or _PATHS[kind], headers, body)  # type: ignore[index]
        except UpstreamError as exc:
            return self._upstream_error(exc)
        if reply.status != 200:
            _stats.incr("gateway_upstream_errors.status")

        async def body_of() -> Any:
            try:
                async for chunk in reply.chunks():
                    yield chunk
            finally:
                reply.close()  # also when the client went away (the generator is not finished then)

        return StreamingResponse(body_of(), reply.status, headers=_response_headers(reply.headers))

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the upstream's answer (any call that may reach the upstream may ask)."""
        try:
            key = self._key(request)
            self._join(request, key)
        except _Refused as refused:
            return refused.response()
        return await self._forward(request, None, b"", self._headers(request, key, None), "GET", "/models")

    # ------------------------------------------------------------------ sessions
    def _admin(self, request: Request) -> None:
        if self.token:
            auth = _headers_of(request).get("authorization") or ""
            if auth[:7].lower() != "bearer " or auth[7:].strip() != self.token:
                raise _Refused(401, "token_required", "rtrace gateway: the session API needs the job's token "
                                                      "(Authorization: Bearer $RTRACE_COLLECTOR_TOKEN)")

    async def _json(self, request: Request, required: bool = True) -> dict[str, Any]:
        body = await self._body(request)
        if not body.strip() and not required:
            return {}
        try:
            data = loads(body)
        except ValueError:
            raise _Refused(400, "invalid_json", "rtrace gateway: the request body is not JSON") from None
        if type(data) is not dict:
            raise _Refused(400, "invalid_body", "rtrace gateway: the request body is not a JSON object")
        return data

    async def open_session(self, request: Request) -> Response:
        """``POST /rtrace/sessions`` with the rollout's coordinates: the trajectory is opened;
        the answer has its ``session_id``, ``base_url``, ``api_key`` and ``trace_id``."""
        try:
            self._admin(request)
            data = await self._json(request, required=False)
            coords, name, ttl = _session_request(data, self.settings.gateway_key_ttl_s)
            session = self.sessions.open(self.runtime(), coords, name, ttl)
        except _Refused as refused:
            return refused.response()
        except SessionError as exc:
            return error_response(exc.status, exc.code, str(exc))
        state = session.state
        key, expires = _keys.mint(self.secret, state.trace_id if state else 1, state.root_span_id if state else 1,
                                  state is not None, {}, ttl, session=session.id)
        return _json_response({"session_id": session.id, "traced": session.traced, "trace_id": session.trace_id,
                               "base_url": f"{self.url}/v1" if self.url else None, "api_key": key,
                               "keyed_base_url": f"{self.url}/k/{key}/v1" if self.url else None,
                               "expires_at": expires, "coordinates": coords})

    async def session_info(self, request: Request) -> Response:
        try:
            self._admin(request)
            session = self.sessions.get(request.path_params["sid"])
        except _Refused as refused:
            return refused.response()
        except SessionError as exc:
            return error_response(exc.status, exc.code, str(exc))
        return _json_response({"session_id": session.id, "traced": session.traced, "trace_id": session.trace_id,
                               "calls": session.calls, "expires_at": session.expires, "coordinates": session.coords})

    async def set_reward(self, request: Request) -> Response:
        """``POST /rtrace/sessions/<id>/reward`` ``{"reward": 1.0, "outcome": {...}}``."""
        try:
            self._admin(request)
            data = await self._json(request)
            if "reward" not in data:
                raise _Refused(400, "missing_reward", "rtrace gateway: the body needs a 'reward'")
            session = self.sessions.reward(request.path_params["sid"], data["reward"], _outcome(data))
        except _Refused as refused:
            return refused.response()
        except SessionError as exc:
            return error_response(exc.status, exc.code, str(exc))
        return _json_response({"session_id": session.id, "reward": data["reward"]})

    async def end_session(self, request: Request) -> Response:
        """``POST /rtrace/sessions/<id>/end``, optionally with ``reward``, ``outcome``, ``error``:
        the session's trajectory ends and is written."""
        try:
            self._admin(request)
            data = await self._json(request, required=False)
            sid = request.path_params["sid"]
            if "reward" in data:
                self.sessions.reward(sid, data["reward"], _outcome(data))
            error = data.get("error")
            session = self.sessions.end(sid, error if isinstance(error, str) and error else None)
        except _Refused as refused:
            return refused.response()
        except SessionError as exc:
            return error_response(exc.status, exc.code, str(exc))
        return _json_response({"session_id": session.id, "trace_id": session.trace_id, "calls": session.calls})

    async def stats(self, request: Request) -> Response:
        """``GET /rtrace/stats``: rtrace's counters in this process (``rtrace.stats()``'s)."""
        try:
            self._admin(request)
        except _Refused as refused:
            return refused.response()
        out = dict(_stats.snapshot())
        out["gateway_sessions_open"] = len(self.sessions)
        return _json_response(out)

    async def health(self, request: Request) -> Response:
        """``GET /rtrace/health``: 200 while the gateway serves."""
        return _json_response({"status": "ok", "upstream": self.upstream_url})


class _Record:
    """What one recorded call collects, and its end (once, whatever happens)."""

    __slots__ = ("gateway", "call", "kind", "payload", "asked", "capture", "gaps", "status", "capturing", "done",
                 "started", "splitter")

    def __init__(self, gateway: Gateway, call: Any, kind: str, payload: dict[str, Any], asked: Any) -> None:
        self.gateway = gateway
        self.call = call
        self.kind = kind
        self.payload = payload
        self.asked = asked
        self.capture = Capture(kind)
        self.gaps: list[tuple[str, str]] = []
        self.status = 0
        self.capturing = True
        self.done = False
        self.started = time.time_ns()

    def gap(self, code: str, detail: str) -> None:
        self.gaps.append((code, detail))

    def read_events(self, events: list[bytes]) -> None:
        """Read whole SSE events beside a stream passed on as it came (never raises)."""
        capture = self.capture
        for event in events:
            data = event_data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                capture.done = True
                continue
            try:
                obj = loads(data)
            except ValueError:
                continue
            if type(obj) is dict:
                try:
                    capture.chunk(obj)
                except Exception:
                    _stats.incr("gateway_record_errors")

    def finish(self, error: str | None = None) -> None:
        """End the call's span with what was collected (called once; never raises)."""
        if self.done:
            return
        self.done = True
        try:
            inputs, output, attrs = self._record(error)
        except Exception:
            _stats.incr("gateway_record_errors")
            _stats.warn_once("gateway-capture", "rtrace gateway could not read a call's answer (it went through)",
                             exc_info=True)
            inputs, output, attrs = None, None, {}
        rt_capture = True
        try:
            rt_capture = bool(self.gateway.runtime().capture)
        except Exception:
            pass
        self.call.finish(inputs, output, attrs, error, rt_capture)

    def _record(self, error: str | None) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        cap = self.capture
        s = self.gateway.settings
        attrs: dict[str, Any] = {"rtrace.gateway.join": self.call.join.how}
        inputs = dict(self.payload)
        stream = self.payload.get("stream") is True
        if stream:
            attrs["rtrace.gateway.stream"] = True
        if self.status and self.status != 200:
            attrs["http.response.status_code"] = self.status
        if cap.prompt_ids is not None:
            inputs["prompt_ids"] = cap.prompt_ids
        answered = error is None and self.status == 200 and (cap.done or cap.chunks or cap.text or cap.tool_calls)
        output = cap.output() if answered or cap.chunks else None
        if cap.model is not None:
            attrs["gen_ai.response.model"] = cap.model
        if cap.response_id is not None:
            attrs["gen_ai.response.id"] = str(cap.response_id)
        usage = cap.usage if type(cap.usage) is dict else {}
        for key, attr in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                          ("completion_tokens", "gen_ai.usage.output_tokens")):
            if type(usage.get(key)) is int:
                attrs[attr] = usage[key]  # token ids, when there are, give the same (the pipeline sets them)
        if cap.logprobs:
            # one per response token id: floats as the upstream wrote them (the worker's conversion
            # counts a value that is not one, as for any attribute)
            attrs["rtrace.response_logprobs"] = cap.logprobs
        if cap.version is not None:
            attrs["rtrace.weight_version"] = str(cap.version)
            version = cap.version
            if type(version) is str and version.lstrip("-").isdigit():
                version = int(version)
            if type(version) is int:
                attrs["rl.policy_version"] = version  # the span's own version over the rollout's
        if stream and cap.first_token_ns is not None:
            attrs["rtrace.time_to_first_token_ms"] = (cap.first_token_ns - self.started) / 1e6
        if answered or cap.chunks:
            gaps = list(self.gaps)
            if cap.prompt_ids is None or cap.response_ids is None:
                if not (s.gateway_token_ids or self.payload.get("return_token_ids")):
                    gaps.append(("not_requested", "token ids were not asked of the upstream "
                                                  "(RTRACE_GATEWAY_TOKEN_IDS=false)"))
                elif not gaps:
                    gaps.append(("not_returned", "the upstream returned no token ids (not vLLM / SGLang, or an "
                                                 "older version)"))
            if error is not None or (stream and not cap.done):
                gaps.append(("incomplete", "the answer was cut before its end: "
                                           + (error or "the stream ended without [DONE]")))
            if cap.choices > 1:
                gaps.append(("choices", f"n={cap.choices}: only the first choice is recorded"))
            if gaps:
                attrs["rtrace.capture_gap"] = "; ".join(detail for _, detail in gaps)
                attrs["rtrace.capture_gap.codes"] = [code for code, _ in gaps]
                _stats.incr("gateway_capture_gaps")
                for code, _ in gaps:
                    _stats.incr(f"gateway_capture_gaps.{code}")
        return inputs, output, attrs


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


def _response_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() not in _DROP_RESPONSE}


def _json_response(data: dict[str, Any], status: int = 200) -> Response:
    return Response(dumps(data), status, media_type="application/json")


def _outcome(data: dict[str, Any]) -> dict[str, Any]:
    outcome = data.get("outcome")
    if outcome is not None and type(outcome) is not dict:
        raise _Refused(400, "invalid_outcome", "rtrace gateway: 'outcome' must be a JSON object")
    return outcome or {}


#: coordinates a session may be opened with: name -> accepted types
_COORDS = {"step": (int,), "sample_index": (int,), "rollout_n": (int,), "validate": (bool,),
           "group_id": (str, int), "policy_version": (int,)}


def _session_request(data: dict[str, Any], default_ttl: float) -> tuple[dict[str, Any], str, float]:
    """``(coordinates, root span name, time to live)`` of a session request; refuses
    coordinates of the wrong type (they would break sampling and step metrics)."""
    coords: dict[str, Any] = {}
    for name, types in _COORDS.items():
        value = data.get(name)
        if value is None:
            continue
        if type(value) not in types:
            raise _Refused(400, "invalid_coordinates", f"rtrace gateway: '{name}' must be "
                                                       f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
        coords[name] = value
    extra = data.get("extra")
    if extra is not None:
        if type(extra) is not dict:
            raise _Refused(400, "invalid_coordinates", "rtrace gateway: 'extra' must be a JSON object")
        coords["extra"] = extra
    name = data.get("name") or "rollout"
    if not isinstance(name, str) or len(name) > 200:
        raise _Refused(400, "invalid_name", "rtrace gateway: 'name' must be a string of at most 200 characters")
    ttl = data.get("ttl_s", default_ttl)
    if type(ttl) not in (int, float) or not 0 < ttl <= 7 * 24 * 3600:
        raise _Refused(400, "invalid_ttl", "rtrace gateway: 'ttl_s' must be seconds from 0 to 604800")
    return coords, name, float(ttl)
