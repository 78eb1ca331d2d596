"""RL context: ``rollout_context``, ``record_reward`` and ``wrap_context``.

A ``rollout_context`` is one trajectory. Entering it merges its RL coordinates over the
enclosing context's (inner values win), decides sampling once, and opens the root span
of a new trace (an enclosing application span is linked, not used as the parent).
The coordinates live once, on the trajectory, and the worker stamps them as ``rl.*`` on
every span of it at export time, so nested calls pay nothing for them.

State lives in two ContextVars (rtrace's frame and OTel's current span): asyncio tasks
and ``asyncio.gather`` copy them, so concurrent rollouts never see each other's
coordinates. Threads do not inherit ContextVars; :func:`wrap_context` carries them.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, TypeVar

from .. import _stats
from . import _state
from ._otel_private import attach_span, detach
from .capture import snapshot
from .decorators import fail_span

__all__ = ["rollout_context", "record_reward", "wrap_context", "current_coordinates"]

T = TypeVar("T")


class RolloutContext:
    """The context manager returned by :func:`rollout_context` (sync and async ``with``)."""

    __slots__ = ("_coords", "_name", "_trace", "_span", "_frame", "_frame_token", "_span_token", "_trace_id")

    def __init__(self, coords: dict[str, Any], name: str, trace: bool = True) -> None:
        self._coords = coords
        self._name = name
        self._trace = trace
        self._span: Any = None
        self._frame: _state.Frame | None = None
        self._frame_token: Any = None
        self._span_token: Any = None
        self._trace_id: int | None = None

    # ------------------------------------------------------------------ public
    @property
    def coordinates(self) -> dict[str, Any]:
        """The merged RL coordinates of this trajectory."""
        return dict(self._frame.coords if self._frame else self._coords)

    @property
    def traced(self) -> bool:
        """True when this trajectory is recorded (tracing on, sampled in, under the caps)."""
        return self._trace_id is not None

    @property
    def trace_id(self) -> str | None:
        """The trajectory's OTel trace id (32 hex digits), or None when not traced."""
        return None if self._trace_id is None else format(self._trace_id, "032x")

    # ------------------------------------------------------------------ protocol
    def __enter__(self) -> "RolloutContext":
        outer = _state.FRAME.get()
        coords = {**outer.coords, **self._coords} if outer is not None else self._coords
        if outer is not None and "extra" in outer.coords and "extra" in self._coords:
            coords["extra"] = {**outer.coords["extra"], **self._coords["extra"]}
        frame = _state.Frame(coords, None)
        rt = _state.get_runtime() if self._trace else None
        if rt is not None:
            try:
                self._span, frame = _state.start_root(rt, self._name, "rollout", coords)
            except Exception:
                _stats.incr("internal_errors")
                _stats.warn_once("rollout_context", "rtrace could not open a trajectory; it runs untraced",
                                 exc_info=True)
        self._frame = frame
        self._frame_token = _state.FRAME.set(frame)
        if self._span is not None:
            self._trace_id = frame.state.trace_id  # the trace of the span just opened
            self._span_token = attach_span(self._span)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._span_token is not None:
            detach(self._span_token)
            self._span_token = None
        _state.FRAME.reset(self._frame_token)
        span, self._span = self._span, None
        if span is not None:
            if exc is not None:
                fail_span(span, exc)
            span.end()
        elif self._frame is not None and self._frame.tally is not None:  # recorded as a summary only
            tally = self._frame.tally
            try:
                if exc is not None:
                    tally.fail(exc)
                tally.end()
            except Exception:  # telemetry never breaks the traced program
                _stats.incr("internal_errors")
                _stats.warn_once("tally-end", "rtrace could not end a summarized rollout", exc_info=True)

    async def __aenter__(self) -> "RolloutContext":
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    def record_reward(self, value: Any, **outcome: Any) -> None:
        """Same as :func:`rtrace.record_reward`, for this trajectory."""
        _record(self._frame, value, outcome)


def rollout_context(step: int | None = None, sample_index: int | None = None,
                    rollout_n: int | None = None, validate: bool | None = None,
                    group_id: Any = None, policy_version: int | None = None, *,
                    name: str = "rollout", trace: bool = True, **extra: Any) -> RolloutContext:
    """Open one trajectory with its RL coordinates.

    Use as ``with rtrace.rollout_context(step=3, sample_index=17, rollout_n=2): ...``
    (or ``async with``). Every span made inside, in this task, in tasks it creates, and
    in threads reached through :func:`wrap_context`, belongs to this trajectory and
    carries ``rl.step``, ``rl.sample_index``, ``rl.rollout_n``, ``rl.validate``,
    ``rl.experiment``, ``rl.group_id``, ``rl.policy_version`` and ``rl.extra.<key>``.

    Nested contexts start their own trajectory; their coordinates are the enclosing
    ones overridden by the inner values. Arguments left as ``None`` inherit (``validate``
    defaults to ``False``). Sampling (``max_traces_per_step``) is decided here, once.

    Args:
        name: the root span's name (default ``rollout``).
        trace: ``False`` opens the context without a trajectory: its coordinates are
            visible (``current_coordinates``) but nothing inside is traced (veRL's
            ``trace=False``).
        **extra: more coordinates, exported as ``rl.extra.<key>``.
    """
    coords: dict[str, Any] = {}
    if step is not None:
        coords["step"] = step
    if sample_index is not None:
        coords["sample_index"] = sample_index
    if rollout_n is not None:
        coords["rollout_n"] = rollout_n
    if validate is not None:
        coords["validate"] = validate
    if group_id is not None:
        coords["group_id"] = group_id
    if policy_version is not None:
        coords["policy_version"] = policy_version
    if extra:
        coords["extra"] = extra
    return RolloutContext(coords, name, trace)


def _record(frame: _state.Frame | None, value: Any, outcome: dict[str, Any]) -> None:
    if frame is None:
        if _state.runtime is not None and _state.runtime is not _state.UNSET:
            _stats.incr("rewards_outside_trajectory")
            _stats.warn_once("reward_outside", "rtrace.record_reward() called outside any trajectory; ignored")
        return
    state: Any = frame.state
    if state is None:
        state = frame.tally  # recorded as a summary only: the reward is counted all the same
        if state is None:  # not traced: nothing to do
            return
    state.reward = value
    state.has_reward = True
    if outcome:
        state.outcome.update({k: snapshot(v) for k, v in outcome.items()})


def record_reward(value: Any, **outcome: Any) -> None:
    """Put the reward and outcome attributes on the current trajectory's root.

    Works anywhere inside the ``rollout_context`` (also after the decorated agent loop
    returned). The value is converted to float in the worker thread; a value that is not
    a number (or NaN) is exported in each sink's documented form and counted, never
    raised. Outcome keyword arguments become ``rl.outcome.<key>``. Outside any
    trajectory the call is ignored and counted (``rewards_outside_trajectory``).
    """
    _record(_state.FRAME.get(), value, outcome)


def current_coordinates() -> dict[str, Any]:
    """The RL coordinates of the trajectory open in this context ({} when none)."""
    frame = _state.FRAME.get()
    return dict(frame.coords) if frame is not None else {}


def wrap_context(fn: Callable[..., T]) -> Callable[..., T]:
    """Bind ``fn`` to the current context (trajectory and span) for another thread.

    ``executor.submit(rtrace.wrap_context(run_tool), args)``: spans made by ``run_tool``
    in the pool's thread join the trajectory that was current when ``wrap_context`` was
    called. Each call runs in its own copy of that context, so the wrapped function may
    be called many times, also concurrently.
    """
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run_in_context(*args: Any, **kwargs: Any) -> T:
        return ctx.copy().run(fn, *args, **kwargs)

    return run_in_context
