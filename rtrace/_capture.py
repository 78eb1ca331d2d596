"""Records shared by the hot path (instrumentation) and the worker thread (exporters).

Neither side imports the other: the instrumentation fills these records, the exporters
read them. Keeping them here, below both, is what lets a sink depend on the Trajectory
model and never on the decorators.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CallSpec", "CallRecord", "TrajectoryState"]


class CallSpec:
    """What a decorator knows about its function, decided once at decoration time."""

    __slots__ = ("kind", "name", "capture", "param_names", "skip_first", "options")

    def __init__(self, kind: str, name: str, capture: bool, param_names: tuple[str, ...],
                 skip_first: bool, options: dict[str, Any]) -> None:
        self.kind = kind
        self.name = name
        self.capture = capture
        self.param_names = param_names
        #: the first positional argument is ``self`` / ``cls`` and is not captured
        self.skip_first = skip_first
        #: kind-specific options (generation: prompt_field, response_field, model;
        #: tool: tool_name) — read by the worker only
        self.options = options


class CallRecord:
    """One decorated call as the hot path saw it: references and snapshots, no conversion."""

    __slots__ = ("spec", "args", "kwargs", "output", "has_output", "owner_name")

    def __init__(self, spec: CallSpec, args: tuple | None, kwargs: dict | None) -> None:
        self.spec = spec
        self.args = args
        self.kwargs = kwargs
        self.output: Any = None
        self.has_output = False
        #: ``self.name`` of a method's instance (tool classes name themselves this way)
        self.owner_name: str | None = None


class TrajectoryState:
    """One open trajectory, shared by the hot path (writes) and the worker (reads at the end).

    The hot path creates it when a root span starts, adds a :class:`CallRecord` per
    decorated call and the reward; the worker collects the trajectory's ended spans into
    ``spans`` and builds the Trajectory when the root span arrives (or at the orphan
    timeout).
    """

    __slots__ = ("trace_id", "root_span_id", "name", "kind", "coords", "captures", "reward",
                 "has_reward", "outcome", "created", "created_ns", "spans", "dropped_spans",
                 "partial")

    def __init__(self, trace_id: int, root_span_id: int, name: str, kind: str,
                 coords: dict[str, Any]) -> None:
        self.trace_id = trace_id
        self.root_span_id = root_span_id
        self.name = name
        self.kind = kind
        self.coords = coords
        self.captures: dict[int, CallRecord] = {}
        self.reward: Any = None
        self.has_reward = False
        self.outcome: dict[str, Any] = {}
        self.created = time.monotonic()
        self.created_ns = time.time_ns()
        self.spans: list[Any] = []  # ReadableSpan, filled by the worker
        self.dropped_spans = 0
        #: set by the worker when the root never arrived (orphan timeout or shutdown)
        self.partial = False
