"""Sessions: a trajectory opened over HTTP, for an agent that runs as a black box elsewhere.

The trainer (any language) opens a session with the rollout's coordinates; the gateway
opens the trajectory's root span exactly as ``rollout_context`` does (sampled once, a new
trace, registered in the open-trajectory table) and answers with the session's base URL
and key. Every model call made with the key is a generation span under that root. The
trainer sets the reward (AReaL's ``rl/set_reward``), then ends the session: the root
ends, and the trajectory is complete and written like any other.

A session that is never ended is written partial as an orphan is: its key dies after its
time to live (``RTRACE_GATEWAY_KEY_TTL_S``, or the ``ttl_s`` it was opened with), the
gateway forgets it and marks its root lost, and the next round of the pipeline writes
what it recorded as a ``partial`` trajectory (in the collector: after
``RTRACE_ORPHAN_TIMEOUT_S``, as every orphan). The table is bounded by the open-trajectory
table (``RTRACE_MAX_OPEN_TRAJECTORIES``), and by :data:`MAX_SESSIONS` for sessions that are
not traced (sampled out).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

from .. import _stats
from ..instrumentation import _state
from ..instrumentation.capture import snapshot

__all__ = ["Session", "Sessions", "SessionError", "MAX_SESSIONS"]

#: sessions held at most, traced or not
MAX_SESSIONS = 100_000


class SessionError(Exception):
    """A session request the gateway refuses: ``status`` and ``code`` of the OpenAI-style answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Session:
    """One open session: its trajectory (``state`` None when not traced) and root span; or,
    sampled out while summaries are on, its tally (``tally``: the rollout is counted in the
    step metrics with its reward and outcome, its calls go through unrecorded)."""

    __slots__ = ("id", "span", "state", "tally", "coords", "expires", "calls", "registry", "ended", "lock")

    def __init__(self, sid: str, span: Any, state: Any, coords: dict[str, Any], expires: float,
                 registry: Any, tally: Any = None) -> None:
        self.id = sid
        self.span = span
        self.state = state
        self.tally = tally
        self.coords = coords
        self.expires = expires
        self.calls = 0
        self.registry = registry
        self.ended = False
        self.lock = threading.Lock()

    @property
    def traced(self) -> bool:
        return self.state is not None

    @property
    def trace_id(self) -> str | None:
        return format(self.state.trace_id, "032x") if self.state is not None else None

    @property
    def alive(self) -> bool:
        """Not ended, not expired, and (traced) still in the open-trajectory table."""
        if self.ended or time.time() >= self.expires:
            return False
        return self.state is None or self.registry.lookup(self.state.trace_id) is self.state


class Sessions:
    """The open sessions of one gateway, by id (one lock; the app's loop and a sweep use it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, rt: Any, coords: dict[str, Any], name: str, ttl_s: float) -> Session:
        """Open a session's trajectory (``rt`` None: tracing is off, the session is untraced)."""
        with self._lock:
            if len(self._open) >= MAX_SESSIONS:
                _stats.incr("gateway_refused.sessions_full")
                raise SessionError(503, "too_many_sessions", f"rtrace gateway: {MAX_SESSIONS} sessions are open")
        span, state, registry, tally = None, None, None, None
        if rt is not None:
            span, frame = _state.start_root(rt, name, "rollout", coords)
            state, registry, tally = frame.state, rt.registry, frame.tally
            if span is None and state is None and len(registry) >= registry.max_open:
                _stats.incr("gateway_refused.sessions_full")
                raise SessionError(503, "too_many_sessions", "rtrace gateway: the open-trajectory table is full "
                                                             "(RTRACE_MAX_OPEN_TRAJECTORIES)")
        sid = secrets.token_urlsafe(12)
        session = Session(sid, span, state, coords, time.time() + ttl_s, registry, tally)
        with self._lock:
            self._open[sid] = session
        _stats.incr("gateway_sessions_opened")
        return session

    def get(self, sid: str) -> Session:
        """The open session ``sid``; :class:`SessionError` (404) when it ended or expired."""
        session = self._open.get(sid)
        if session is None or not session.alive:
            if session is not None:
                self._expire(session)
            raise SessionError(404, "session_not_found", f"rtrace gateway: session {sid!r} is not open (ended, "
                                                         "expired, or never opened here)")
        return session

    def reward(self, sid: str, value: Any, outcome: dict[str, Any]) -> Session:
        """Set the session's reward (and outcome attributes), as ``record_reward`` does."""
        session = self.get(sid)
        state = session.state if session.state is not None else session.tally
        if state is not None:
            state.reward = value
            state.has_reward = True
            if outcome:
                state.outcome.update({k: snapshot(v) for k, v in outcome.items()})
        return session

    def end(self, sid: str, error: str | None = None) -> Session:
        """End the session: its root span ends, its trajectory is complete."""
        session = self.get(sid)
        with session.lock:
            if session.ended:
                raise SessionError(404, "session_not_found", f"rtrace gateway: session {sid!r} has ended")
            session.ended = True
        with self._lock:
            self._open.pop(sid, None)
        span = session.span
        if span is not None:
            if error:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, error[:4096]))
            span.end()
        elif session.tally is not None:  # summarized: its summary is made and counted
            if error:
                session.tally.error = error[:4096]
            session.tally.end()
        _stats.incr("gateway_sessions_ended")
        return session

    def _expire(self, session: Session) -> None:
        with self._lock:
            if self._open.pop(session.id, None) is None:
                return
        if session.ended:
            return
        session.ended = True
        _stats.incr("gateway_sessions_expired")
        if session.tally is not None:  # a summarized session never ended: in no step metric
            _stats.incr("gateway_sessions_summary_lost")
        state = session.state
        if state is not None and session.registry is not None:
            # written partial by the pipeline's next expiry round, as an orphan is
            session.registry.mark_root_lost(state.trace_id, state.root_span_id)

    def sweep(self) -> int:
        """Forget sessions that expired (their trajectories are written partial); returns how many."""
        with self._lock:
            dead = [s for s in self._open.values() if not s.alive]
        for session in dead:
            self._expire(session)
        return len(dead)

    def close_all(self) -> None:
        """At shutdown: every open session is left to the pipeline, which writes it partial."""
        with self._lock:
            sessions, self._open = list(self._open.values()), {}
        for session in sessions:
            session.ended = True
            if session.tally is not None:  # a summarized session never ended: in no step metric
                _stats.incr("gateway_sessions_summary_lost")
