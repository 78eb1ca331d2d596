"""Rollout keys: an API key that *is* the join, signed, so the gateway needs no registration.

A trainer inside ``rollout_context`` gets a key (:func:`rtrace.gateway_access`) and hands it
to the agent as its ``OPENAI_API_KEY``. The key carries what ``rtrace.inject`` would put in
``traceparent`` and ``baggage`` (the trace id, the span the calls become children of, the
sampled flag, the RL coordinates), an expiry time and, for a session, its id; it is
signed with HMAC-SHA256 under the secret the trainer and the gateway share through the
environment (``RTRACE_GATEWAY_SECRET``, carried by ``collector.env`` or the env file that
``rtrace gateway`` writes). So:

* no round trip: a worker mints keys locally, as many as it has rollouts, and the gateway
  verifies each one with one HMAC (the verified claims are kept in a small bounded memo);
* unguessable: without the secret nobody can make a key the gateway accepts, nor change
  the coordinates or the trace of one (the MAC covers every byte of the claims);
* expiring: a key carries its expiry time (``RTRACE_GATEWAY_KEY_TTL_S`` after it was
  made) and a gateway that sees the trajectory end (in the collector, or in the trainer's
  own process) refuses it from then on; a session key dies with its session.

Format: ``rtk-<claims>.<mac>``, both base64url without padding; the claims are compact
JSON ``{"v":1,"t":trace hex,"s":span hex,"f":0|1,"c":{coordinates},"e":expiry,"n":nonce}``
(plus ``"k"``: a session id). The key is a secret for as long as it lives: rtrace never
logs one, and the gateway never forwards one upstream.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from typing import Any

__all__ = ["PREFIX", "Claims", "KeyRefused", "mint", "verify", "is_rollout_key", "new_secret"]

#: Every rollout key starts with this: a key without it is not one of rtrace's.
PREFIX = "rtk-"
_MAC_BYTES = 16  # 128 bits: forging one is 2**128 tries
#: verified keys remembered (a rollout's calls repeat its key): verifying costs ~10 µs
_MEMO_SIZE = 4096


class KeyRefused(Exception):
    """A rollout key the gateway does not accept; ``code`` is the reason (``malformed``,
    ``bad_signature``, ``expired``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Claims:
    """What a verified key says."""

    __slots__ = ("trace_id", "span_id", "sampled", "coords", "expires", "session")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, coords: dict[str, Any], expires: float,
                 session: str | None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled
        self.coords = coords
        self.expires = expires
        #: the session id, for a key the session API issued
        self.session = session


def new_secret() -> str:
    """A fresh signing secret (256 bits, URL-safe text)."""
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: str, claims: bytes) -> bytes:
    return hmac.new(secret.encode(), claims, hashlib.sha256).digest()[:_MAC_BYTES]


def mint(secret: str, trace_id: int, span_id: int, sampled: bool, coords: dict[str, Any], ttl_s: float,
         session: str | None = None) -> tuple[str, float]:
    """A signed key for the trajectory ``trace_id`` (calls become children of ``span_id``)
    with ``coords``; returns ``(key, expiry as a Unix time)``."""
    expires = time.time() + ttl_s
    body: dict[str, Any] = {"v": 1, "t": format(trace_id, "032x"), "s": format(span_id, "016x"),
                            "f": 1 if sampled else 0, "c": coords, "e": round(expires, 3),
                            "n": _b64(os.urandom(6))}
    if session is not None:
        body["k"] = session
    claims = json.dumps(body, separators=(",", ":"), default=str, ensure_ascii=True).encode()
    return f"{PREFIX}{_b64(claims)}.{_b64(_mac(secret, claims))}", expires


def is_rollout_key(key: str) -> bool:
    """True when ``key`` is shaped like one of rtrace's rollout keys (not that it is valid)."""
    return key.startswith(PREFIX)


class Verifier:
    """Verifies keys under one secret, remembering the last :data:`_MEMO_SIZE` good ones."""

    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._memo: dict[str, Claims] = {}

    def __call__(self, key: str, now: float | None = None) -> Claims:
        """The claims of ``key``; raises :class:`KeyRefused` when it is not valid now."""
        claims = self._memo.get(key)
        if claims is None:
            claims = verify(self._secret, key)
            memo = self._memo
            if len(memo) >= _MEMO_SIZE:
                del memo[next(iter(memo))]  # the oldest: a rollout's key is used while it runs
            memo[key] = claims
        if (time.time() if now is None else now) >= claims.expires:
            raise KeyRefused("expired", "the rollout key has expired (RTRACE_GATEWAY_KEY_TTL_S)")
        return claims


def verify(secret: str, key: str) -> Claims:
    """The claims of ``key`` if its signature is good (expiry is the caller's check);
    raises :class:`KeyRefused` otherwise."""
    if not key.startswith(PREFIX) or key.count(".") != 1 or len(key) > 8192:
        raise KeyRefused("malformed", "not an rtrace rollout key")
    body, _, mac = key[len(PREFIX):].partition(".")
    try:
        claims, given = _unb64(body), _unb64(mac)
    except (ValueError, TypeError):
        raise KeyRefused("malformed", "not an rtrace rollout key") from None
    if not hmac.compare_digest(_mac(secret, claims), given):
        raise KeyRefused("bad_signature", "the rollout key was not made with this gateway's secret "
                                         "(RTRACE_GATEWAY_SECRET)")
    try:
        data = json.loads(claims)
        session = data.get("k")
        return Claims(int(data["t"], 16), int(data["s"], 16), bool(data["f"]), dict(data["c"]), float(data["e"]),
                      session if isinstance(session, str) else None)
    except (ValueError, KeyError, TypeError, AttributeError):  # signed but not ours (another version)
        raise KeyRefused("malformed", "an rtrace rollout key of an unknown version") from None
