"""A small client of the session API (standard library only), for trainers written in Python.

::

    session = rtrace.gateway.open_session("http://127.0.0.1:8100", step=3, sample_index=17, rollout_n=2)
    subprocess.run(agent_cmd, env={**os.environ, **session.env})   # OPENAI_BASE_URL / OPENAI_API_KEY
    session.set_reward(1.0, correct=True)
    session.end()                                                   # the trajectory is complete

Any other language does the same with three HTTP requests (docs/gateway.md, "Sessions").
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["SessionHandle", "open_session", "SessionAPIError"]


class SessionAPIError(RuntimeError):
    """The gateway refused a session request (``status`` and its OpenAI-style ``code``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code


def _post(url: str, body: dict[str, Any] | None, token: str | None, timeout_s: float,
          method: str = "POST") -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read()).get("error") or {}
        except ValueError:
            err = {}
        raise SessionAPIError(exc.code, err.get("code", "error"), err.get("message", str(exc))) from None


class SessionHandle:
    """An open session: give the agent :attr:`env` (or :attr:`base_url` and :attr:`api_key`),
    then :meth:`set_reward` and :meth:`end`."""

    def __init__(self, gateway_url: str, info: dict[str, Any], token: str | None, timeout_s: float) -> None:
        self.gateway_url = gateway_url
        self.session_id: str = info["session_id"]
        self.trace_id: str | None = info.get("trace_id")
        self.traced: bool = bool(info.get("traced"))
        self.base_url: str = info.get("base_url") or f"{gateway_url}/v1"
        self.api_key: str = info["api_key"]
        self.expires_at: float = info.get("expires_at", 0.0)
        self._token = token
        self._timeout_s = timeout_s

    @property
    def env(self) -> dict[str, str]:
        """``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` for the agent."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}

    def _url(self, what: str = "") -> str:
        return f"{self.gateway_url}/rtrace/sessions/{self.session_id}{what}"

    def set_reward(self, reward: float, **outcome: Any) -> None:
        """The trajectory's reward (and ``rl.outcome.<key>`` attributes)."""
        _post(self._url("/reward"), {"reward": reward, "outcome": outcome}, self._token, self._timeout_s)

    def info(self) -> dict[str, Any]:
        """The session as the gateway sees it (calls made so far, expiry, coordinates)."""
        return _post(self._url(), None, self._token, self._timeout_s, method="GET")

    def end(self, reward: float | None = None, error: str | None = None, **outcome: Any) -> dict[str, Any]:
        """End the session: its trajectory is complete and written (with ``reward`` when given;
        ``error`` marks the rollout failed)."""
        body: dict[str, Any] = {}
        if reward is not None:
            body["reward"] = reward
            body["outcome"] = outcome
        if error:
            body["error"] = error
        return _post(self._url("/end"), body, self._token, self._timeout_s)

    def __repr__(self) -> str:
        return f"SessionHandle(session_id={self.session_id!r}, trace_id={self.trace_id!r}, api_key='<secret>')"


def open_session(gateway_url: str, *, step: int | None = None, sample_index: int | None = None,
                 rollout_n: int | None = None, validate: bool | None = None, group_id: Any = None,
                 policy_version: int | None = None, name: str = "rollout", ttl_s: float | None = None,
                 token: str | None = None, timeout_s: float = 30.0, **extra: Any) -> SessionHandle:
    """Open a session on the gateway at ``gateway_url`` (``http://host:port``) with the
    rollout's coordinates (``**extra``: ``rl.extra.<key>``).

    Args:
        token: the job's token, when the gateway listens beyond loopback
            (``RTRACE_COLLECTOR_TOKEN``).
        ttl_s: how long the session may stay open (default: the gateway's
            ``RTRACE_GATEWAY_KEY_TTL_S``); a session not ended by then is written partial.

    Raises:
        SessionAPIError: the gateway refused (bad coordinates, full, token missing).
    """
    body: dict[str, Any] = {"name": name}
    for key, value in (("step", step), ("sample_index", sample_index), ("rollout_n", rollout_n),
                       ("validate", validate), ("group_id", group_id), ("policy_version", policy_version),
                       ("ttl_s", ttl_s)):
        if value is not None:
            body[key] = value
    if extra:
        body["extra"] = extra
    gateway_url = gateway_url.rstrip("/")
    if gateway_url.endswith("/v1"):
        gateway_url = gateway_url[:-3]
    info = _post(f"{gateway_url}/rtrace/sessions", body, token, timeout_s)
    return SessionHandle(gateway_url, info, token, timeout_s)
