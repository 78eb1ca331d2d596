"""``rtrace.gateway_access()``: the base URL and key that put an agent's calls into this rollout.

::

    with rtrace.rollout_context(step=3, sample_index=17, rollout_n=2):
        gw = rtrace.gateway_access()
        run_agent(base_url=gw.base_url, api_key=gw.api_key)   # any OpenAI client
        subprocess.run(cmd, env={**os.environ, **gw.env})     # OPENAI_BASE_URL / OPENAI_API_KEY

The key is minted here, with no call to the gateway (rtrace/gateway/keys.py): it carries
the trajectory's trace id, the current span (the calls become its children), whether the
trajectory is recorded, and its coordinates, signed with ``RTRACE_GATEWAY_SECRET``. It needs
only the standard library and the hot path's state: importing it costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, Secret, env_setting
from ..instrumentation import _state
from ..instrumentation._otel_private import current_span
from . import keys as _keys

__all__ = ["GatewayAccess", "gateway_access"]

#: The gateway serving in this process (start_gateway / a collector's), if any: its URL and
#: secret are used when the environment names none.
local: Any = None


@dataclass(frozen=True)
class GatewayAccess:
    """What an agent needs to call the gateway as part of one rollout.

    Attributes:
        base_url: the OpenAI base URL (``http://host:port/v1``); give it with ``api_key``.
        api_key: the rollout key (a secret until it expires: do not log it).
        keyed_base_url: the same with the key in the path (``.../k/<key>/v1``), for an agent
            that can only be given a base URL (any API key then works).
        traceparent: the W3C ``traceparent`` of the span the calls join (None when not traced).
        expires_at: when the key stops working (Unix time).
        traced: the rollout is recorded (False: sampled out or tracing off; calls go through
            unrecorded).
    """

    base_url: str
    api_key: str
    keyed_base_url: str
    traceparent: str | None
    expires_at: float
    traced: bool

    @property
    def env(self) -> dict[str, str]:
        """``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` for an agent in a subprocess."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}

    @property
    def headers(self) -> dict[str, str]:
        """``Authorization`` (and ``traceparent``) for an HTTP client of your own."""
        out = {"Authorization": f"Bearer {self.api_key}"}
        if self.traceparent:
            out["traceparent"] = self.traceparent
        return out

    def __repr__(self) -> str:  # the key is a secret: never shown
        return f"GatewayAccess(base_url={self.base_url!r}, api_key='<secret>', traced={self.traced})"


def _where(url: str | None, secret: str | None) -> tuple[str, str]:
    if url is None:
        url = env_setting("gateway_url")
    if secret is None:
        secret = env_setting("gateway_secret") or None
    if (url is None or secret is None) and local is not None:
        url = url or local.url
        secret = secret or local.gateway.secret
    if not url or not secret:
        raise ConfigError("rtrace.gateway_access() needs the gateway: RTRACE_GATEWAY_URL and RTRACE_GATEWAY_SECRET "
                          "(collector.env and `rtrace gateway` give both), or a gateway started in this process; "
                          "accepted values: an http(s):// URL and the gateway's secret")
    return url.rstrip("/"), secret


def gateway_access(url: str | None = None, secret: str | None = None, ttl_s: float | None = None) -> GatewayAccess:
    """The gateway's base URL and a rollout key for the trajectory open in this context.

    Call it inside ``rtrace.rollout_context(...)`` (or a decorated rollout): the agent's
    model calls made with the key become generation spans of this trajectory, children of
    the span current here, with its coordinates. Outside any trajectory, or in one that is
    not recorded (sampled out, tracing off), the key lets calls through unrecorded.

    Args:
        url: the gateway's base URL (default ``RTRACE_GATEWAY_URL``, else the gateway
            running in this process).
        secret: the signing secret (default ``RTRACE_GATEWAY_SECRET``, else that gateway's).
        ttl_s: how long the key works (default ``RTRACE_GATEWAY_KEY_TTL_S``, 3600 s).

    Raises:
        ConfigError: no gateway is known (neither variable set, none running here).
    """
    url, secret = _where(url, secret)
    if ttl_s is None:
        ttl_s = env_setting("gateway_key_ttl_s")
    frame = _state.FRAME.get()
    state = frame.state if frame is not None else None
    traceparent = None
    if state is not None:
        ctx = current_span().get_span_context()
        trace_id, span_id = state.trace_id, (ctx.span_id if ctx.is_valid and ctx.trace_id == state.trace_id
                                             else state.root_span_id)
        coords = _plain(frame.coords)
        key, expires = _keys.mint(secret, trace_id, span_id, True, coords, ttl_s)
        traceparent = f"00-{trace_id:032x}-{span_id:016x}-01"
    else:
        key, expires = _keys.mint(secret, 1, 1, False, {}, ttl_s)
    return GatewayAccess(base_url=f"{url}/v1", api_key=Secret(key), keyed_base_url=f"{url}/k/{key}/v1",
                         traceparent=traceparent, expires_at=expires, traced=state is not None)


def _plain(coords: dict[str, Any]) -> dict[str, Any]:
    """Coordinates as JSON values (a numpy int step is an int)."""
    out: dict[str, Any] = {}
    for key, value in coords.items():
        if key == "extra" and isinstance(value, dict):
            out[key] = {k: _value(v) for k, v in value.items()}
        else:
            out[key] = _value(value)
    return out


def _value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return int(value)
    try:
        item = value.item()  # numpy / torch scalars
        if isinstance(item, (bool, int, float)):
            return item
    except Exception:
        pass
    return str(value)
