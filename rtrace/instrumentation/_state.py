"""Hot-path state: the installed runtime and the open trajectory of the current context.

Two pieces of state, both deliberately small:

* ``runtime``: a module global set by ``rtrace.configure()``. ``None`` means tracing is
  off and every decorated call is one check and a call; :data:`UNSET` means nobody has
  configured yet, and the first traced call configures from the environment.
* ``FRAME``: a ContextVar holding the open trajectory (RL coordinates and the
  :class:`~rtrace.pipeline.records.TrajectoryState`). ContextVars follow asyncio tasks and
  ``asyncio.gather`` by themselves; threads need :func:`rtrace.wrap_context`.
"""

from __future__ import annotations

from contextvars import ContextVar
from time import time_ns
from typing import Any, Callable, Protocol, Sequence

from opentelemetry.context import Context
from opentelemetry.trace import Link, Tracer

from .. import _stats
from ..pipeline.annotations import Annotation
from ..pipeline.records import Tally, TrajectoryState
from ..pipeline.registry import Registry
from .._ids import trace_id as _new_trace_id
from ._otel_private import current_span
from .spans import RSpan

__all__ = ["Runtime", "Frame", "FRAME", "UNSET", "get_runtime", "set_runtime", "start_root"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

#: The installed Runtime, None (off) or UNSET (configure from the environment on first use).
runtime: Any = UNSET

#: Called with no arguments to configure from the environment; set by rtrace._setup.
autoconfigure: Callable[[], Any] | None = None

#: Called with the new runtime by set_runtime(): modules that keep their own copy of
#: it in a module global (the decorators, whose off-path check is one global lookup).
_listeners: list[Callable[[Any], None]] = []


def set_runtime(rt: Any) -> None:
    """Install ``rt`` (a Runtime, None for off, or UNSET) everywhere it is read."""
    global runtime
    runtime = rt
    for listener in _listeners:
        listener(rt)


class Sampler(Protocol):
    """The admission decision, made once when a trajectory starts."""

    def admit(self, coords: dict[str, Any]) -> bool:
        """True when the trajectory with these coordinates is recorded."""


class Intake(Protocol):
    """What the hot path hands to the pipeline besides spans."""

    def submit_states(self, states: Sequence[TrajectoryState]) -> int:
        """Queue finished trajectories built without spans; returns how many were queued."""

    def submit_tallies(self, tallies: Sequence[Tally]) -> int:
        """Queue rollouts recorded as summaries only; returns how many were queued."""

    def annotate(self, annotations: Sequence[Annotation]) -> None:
        """Queue annotations for trajectories (by coordinates or trace id)."""

    def submit_events(self, events: Sequence[Any]) -> None:
        """Queue run events (``rtrace.mark_weight_update``'s :class:`~rtrace.events.RunEvent`)."""


class Runtime:
    """What the hot path needs from the configured pipeline (set by ``rtrace.configure``)."""

    __slots__ = ("tracer", "registry", "sampler", "intake", "capture", "experiment", "root_attributes",
                 "start_child", "start_root", "summaries")

    def __init__(self, tracer: Tracer, registry: Registry, sampler: Sampler, intake: Intake, capture: bool,
                 experiment: str | None, root_attributes: dict[str, Any] | None = None,
                 summaries: bool = False) -> None:
        self.tracer = tracer
        #: ``start_child(name)``: a span in the current context (rtrace's own tracer has a
        #: fast one; an application's SDK tracer is called as it is)
        self.start_child = getattr(tracer, "start_child", None) or tracer.start_span
        #: ``start_root(name, links, attributes)``: a span in a new trace
        self.start_root = getattr(tracer, "start_root", None) or (
            lambda name, links, attributes: tracer.start_span(name, context=Context(), links=links,
                                                              attributes=attributes))
        #: the open-trajectory table (register, lookup, set_root)
        self.registry = registry
        #: the per-step cap, decided at the trajectory start
        self.sampler = sampler
        #: finished states (log_rollout_batch) and annotations go here
        self.intake = intake
        self.capture = capture
        self.experiment = experiment
        #: attributes every root span starts with (collector mode: ``rtrace.root``)
        self.root_attributes = root_attributes
        #: a trajectory the sampler does not admit is recorded as a summary only (a Tally)
        self.summaries = summaries


class Frame:
    """The open trajectory as seen from a context. ``state`` is None when not traced
    (tracing off, sampled out, over a cap, or ``trace=False`` in the veRL shim); ``tally``
    is set when it is sampled out but counted: recorded as a summary only (its calls are
    :class:`~rtrace.pipeline.records.Mark` s, no spans; ``RTRACE_SUMMARIES``)."""

    __slots__ = ("coords", "state", "tally")

    def __init__(self, coords: dict[str, Any], state: TrajectoryState | None, tally: Tally | None = None) -> None:
        self.coords = coords
        self.state = state
        self.tally = tally


FRAME: ContextVar[Frame | None] = ContextVar("rtrace_frame", default=None)


def get_runtime() -> Any:
    """The installed runtime, configuring from the environment on first use."""
    rt = runtime
    if rt is UNSET and autoconfigure is not None:
        autoconfigure()
        rt = runtime
    return None if rt is UNSET else rt


def start_root(rt: Runtime, name: str, kind: str, coords: dict[str, Any]) -> tuple[Any, Frame]:
    """Start a trajectory: sample it, open its root span in a new trace, register it.

    Returns ``(span, frame)``; ``span`` is None when the trajectory is not traced
    (sampled out or over the open-trajectory cap), and then ``frame.state`` is None too.
    The root always starts a new trace; an application span that is current is linked,
    not used as the parent.
    """
    if not rt.sampler.admit(coords):
        if rt.summaries:  # counted all the same: its calls are tallied, its summary made in the worker
            return None, Frame(coords, None, Tally(_new_trace_id(), name, kind, coords, time_ns(), rt.intake))
        return None, Frame(coords, None)
    current = current_span().get_span_context()
    links = (Link(current),) if current.is_valid else None
    span = rt.start_root(name, links, rt.root_attributes)
    if not span.is_recording():  # the application's sampler said no
        _stats.incr("trajectories_dropped_provider_sampler")
        return None, Frame(coords, None)
    if type(span) is RSpan:  # its SpanContext is made when asked for
        state = TrajectoryState(span.trace_id, span.span_id, name, kind, coords)
    else:
        ctx = span.get_span_context()
        state = TrajectoryState(ctx.trace_id, ctx.span_id, name, kind, coords)
    if not rt.registry.register(state):
        span.end()
        return None, Frame(coords, None)
    return span, Frame(coords, state)
