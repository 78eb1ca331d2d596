"""The capture gateway: any agent's model calls, through an OpenAI-compatible endpoint, as
generation spans of the trainer's trajectories (docs/gateway.md).

``rtrace gateway --upstream URL`` runs it as a process; ``rtrace.start_collector(...,
gateway_upstream=URL)`` / ``rtrace collect --gateway-upstream URL`` serve it beside the job's
collector; :func:`start_gateway` on a thread of this process. Inside ``rollout_context``,
:func:`rtrace.gateway_access` gives an agent its base URL and rollout key.

Only :mod:`rtrace.gateway.access` and :mod:`rtrace.gateway.keys` are imported with rtrace
(standard library and the hot path); the server's dependencies (the ``gateway`` extra:
starlette, httptools, uvloop) are imported when a gateway starts.
"""

from __future__ import annotations

from typing import Any

from .access import GatewayAccess, gateway_access

__all__ = ["GatewayAccess", "gateway_access", "start_gateway", "Gateway", "GatewayServer", "open_session"]


def __getattr__(name: str) -> Any:
    if name in ("start_gateway", "GatewayServer"):
        from . import server

        return getattr(server, name)
    if name == "Gateway":
        from .app import Gateway

        return Gateway
    if name == "open_session":
        from .client import open_session

        return open_session
    raise AttributeError(f"module 'rtrace.gateway' has no attribute {name!r}")
