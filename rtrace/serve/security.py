"""Who may read the served runs: loopback by default, the collector's token beyond it.

- Bound to loopback (the default), the server answers requests whose ``Host`` is
  ``127.0.0.1``, ``localhost`` or ``[::1]`` only: a web page elsewhere cannot make the
  browser read the runs through a name that resolves to this machine (DNS rebinding).
- Bound beyond loopback, every request needs the token (``RTRACE_COLLECTOR_TOKEN``, the
  collector's): ``Authorization: Bearer <token>`` (scripts, ``curl``), or a cookie set by
  signing in once at ``/-/login`` (browsers). The cookie holds an HMAC of the token, not
  the token; it is ``HttpOnly`` and ``SameSite=Strict`` (``Secure`` under TLS). Tokens are
  compared in constant time and never logged.
- Every response carries a content security policy that allows no inline script and
  nothing from elsewhere: even text that got past escaping could not run.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs, quote

__all__ = ["Guard", "session_value", "LOOPBACK_HOSTS", "SECURITY_HEADERS", "COOKIE"]

COOKIE = "rtrace_session"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                                 b"form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]
#: paths served without the token: the sign-in page and its stylesheets
_OPEN = ("/-/login", "/static/report.css", "/static/serve.css")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def session_value(token: str) -> str:
    """The cookie's value for ``token``: an HMAC of it (the cookie never holds the token)."""
    return hmac.new(token.encode(), b"rtrace-serve-session", hashlib.sha256).hexdigest()


def _host(headers: dict[bytes, bytes]) -> str:
    raw = headers.get(b"host", b"").decode("latin-1").strip().lower()
    if raw.startswith("["):
        return raw[: raw.find("]") + 1] if "]" in raw else raw
    return raw.rsplit(":", 1)[0] if raw.count(":") == 1 else raw


class Guard:
    """ASGI middleware: the host check (loopback), the token (beyond it), the headers."""

    def __init__(self, app: Any, token: str | None, loopback: bool, secure: bool = False) -> None:
        self.app = app
        self.token = token or None
        self.loopback = loopback
        self.secure = secure
        self._bearer = f"Bearer {token}".encode() if token else b""
        self._session = session_value(token).encode() if token else b""

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.token is None:
            return True
        auth = headers.get(b"authorization")
        if auth is not None and hmac.compare_digest(auth, self._bearer):
            return True
        for part in headers.get(b"cookie", b"").split(b";"):
            name, _, value = part.strip().partition(b"=")
            if name == COOKIE.encode() and hmac.compare_digest(value, self._session):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers") or []) + SECURITY_HEADERS
            await send(message)

        if self.loopback and _host(headers) not in LOOPBACK_HOSTS:
            await _plain(send_with_headers, 403, "this server answers requests to 127.0.0.1 / localhost only "
                                                 "(it is bound to loopback)")
            return
        path = scope.get("path", "/")
        if path == "/-/login" and scope.get("method") == "POST" and self.token is not None:
            await self._login(scope, receive, send_with_headers)
            return
        if not path.startswith(_OPEN) and not self._authorized(headers):
            wants_html = b"text/html" in headers.get(b"accept", b"") and scope.get("method") == "GET"
            if wants_html:
                target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
                await _redirect(send_with_headers, "/-/login?next=" + quote(target, safe=""))
            else:
                await _plain(send_with_headers, 401, "a bearer token is required (RTRACE_COLLECTOR_TOKEN)",
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send_with_headers)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > 8192:
                await _plain(send, 413, "too large")
                return
            if not message.get("more_body"):
                break
        form = parse_qs(body.decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0]
        target = (form.get("next") or ["/"])[0]
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = "/"  # only this server's own pages
        if not hmac.compare_digest(given.encode(), (self.token or "").encode()):
            await _redirect(send, "/-/login?failed=1&next=" + quote(target, safe=""))
            return
        cookie = f"{COOKIE}={session_value(self.token or '')}; Path=/; HttpOnly; SameSite=Strict"
        if self.secure:
            cookie += "; Secure"
        await _redirect(send, target, [(b"set-cookie", cookie.encode())])


async def _plain(send: Send, status: int, text: str, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")] + (headers or [])})
    await send({"type": "http.response.body", "body": text.encode()})


async def _redirect(send: Send, location: str, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode("latin-1", "replace"))] + (headers or [])})
    await send({"type": "http.response.body", "body": b""})
