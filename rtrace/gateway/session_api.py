"""The session API's routes (``/rtrace/sessions``): open a session with the rollout's coordinates,
read it, set its reward, end it (rtrace/gateway/sessions.py holds the table). A mixin of
:class:`~rtrace.gateway.app.Gateway`, whose route list names these handlers."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import keys as _keys
from .errors import Refused, error_response
from .protocol import dumps
from .sessions import SessionError

__all__ = ["SessionAPI"]


class SessionAPI:
    """The session handlers; the gateway supplies ``sessions``, ``settings``, ``secret``, ``url``,
    ``runtime``, ``_admin`` and ``_json``."""

    async def open_session(self, request: Request) -> Response:
        """``POST /rtrace/sessions`` with the rollout's coordinates: the trajectory is opened;
        the answer has its ``session_id``, ``base_url``, ``api_key`` and ``trace_id``."""
        try:
            self._admin(request)
            data = await self._json(request, required=False)
            coords, name, ttl = _session_request(data, self.settings.gateway_key_ttl_s)
            session = self.sessions.open(self.runtime(), coords, name, ttl)
        except Refused as refused:
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
        except Refused as refused:
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
                raise Refused(400, "missing_reward", "rtrace gateway: the body needs a 'reward'")
            session = self.sessions.reward(request.path_params["sid"], data["reward"], _outcome(data))
        except Refused as refused:
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
        except Refused as refused:
            return refused.response()
        except SessionError as exc:
            return error_response(exc.status, exc.code, str(exc))
        return _json_response({"session_id": session.id, "trace_id": session.trace_id, "calls": session.calls})



def _outcome(data: dict[str, Any]) -> dict[str, Any]:
    outcome = data.get("outcome")
    if outcome is not None and type(outcome) is not dict:
        raise Refused(400, "invalid_outcome", "rtrace gateway: 'outcome' must be a JSON object")
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
            raise Refused(400, "invalid_coordinates", f"rtrace gateway: '{name}' must be "
                                                       f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
        coords[name] = value
    extra = data.get("extra")
    if extra is not None:
        if type(extra) is not dict:
            raise Refused(400, "invalid_coordinates", "rtrace gateway: 'extra' must be a JSON object")
        coords["extra"] = extra
    name = data.get("name") or "rollout"
    if not isinstance(name, str) or len(name) > 200:
        raise Refused(400, "invalid_name", "rtrace gateway: 'name' must be a string of at most 200 characters")
    ttl = data.get("ttl_s", default_ttl)
    if type(ttl) not in (int, float) or not 0 < ttl <= 7 * 24 * 3600:
        raise Refused(400, "invalid_ttl", "rtrace gateway: 'ttl_s' must be seconds from 0 to 604800")
    return coords, name, float(ttl)




def _json_response(data: dict[str, Any], status: int = 200) -> Response:
    return Response(dumps(data), status, media_type="application/json")
