"""The fleet in time, on the pipeline's side: run events in, versions onto rollouts.

* :func:`take_in`: the events a process marked (``rtrace.mark_weight_update``) or a collector
  received, checked and converted on the worker's thread (the hot path kept references);
* :class:`Versions`: the job's weight updates so far (:class:`~rtrace.events.VersionHistory`),
  and what they say of a finished rollout: the version it ended on (``policy_version_end``)
  and whether it ran across an update (``crossed_update``);
* the collector hop: an event travels as a one-span segment named :data:`EVENT_SPAN`
  (:func:`event_shell`), which the worker's collector sink sends to *every* collector of
  ``RTRACE_COLLECTOR_ENDPOINT`` (an update belongs to no rollout, and each collector
  completes its own rollouts with it; readers keep one row per ``event_id``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from .. import _ids, _stats
from .._serialize import Converter, json_text
from ..events import RunEvent, VersionHistory, plain_version
from ..summary import RolloutSummary, own_version
from ..trajectory import SpanRecord, Trajectory

__all__ = ["local_target", "take_in", "Versions", "EVENT_SPAN", "EVENT_ATTR", "event_shell", "event_of",
           "MAX_QUEUED_EVENTS"]

#: The collector running in this process, if any: ``mark_weight_update`` hands it its events.
local_target: Callable[[list[RunEvent]], None] | None = None

#: Name (and kind ``event``) of the span that carries a run event to the collectors, and its
#: attribute: the event's :meth:`~rtrace.events.RunEvent.to_wire` as JSON text.
EVENT_SPAN = "rtrace.event"
EVENT_ATTR = "rtrace.event"
#: Events waiting for the worker thread (a trainer marks one per step); beyond: dropped, counted.
MAX_QUEUED_EVENTS = 100_000
#: The longest an event's attributes may be as JSON text (they are a few short values).
MAX_ATTRIBUTE_CHARS = 4096


def take_in(events: Sequence[RunEvent], worker: str | None, conv: Converter) -> list[RunEvent]:
    """The events as the sinks get them: version and step ints (else dropped, counted:
    ``weight_updates_invalid``), the marking process's ``worker`` (``worker``: this process's,
    for events marked here), an ``event_id``, attributes converted as captured values."""
    out = []
    for event in events:
        version = plain_version(event.version)
        step = None if event.step is None else plain_version(event.step)
        if version is None or (event.step is not None and step is None):
            _stats.incr("weight_updates_invalid")
            _stats.warn_once("weight-update-invalid", "rtrace.mark_weight_update: the version (and step) must be "
                             "ints; got version=%r step=%r (dropped, counted)", event.version, event.step)
            continue
        event.version, event.step = version, step
        if event.worker is None:
            event.worker = worker
        if event.event_id is None:
            event.event_id = format(_ids.span_id(), "016x")
        if event.attributes:
            attrs = conv.convert_named(event.attributes)
            if len(json_text(attrs)) > MAX_ATTRIBUTE_CHARS:
                attrs = {"rtrace.truncated": True}
                _stats.incr("values_truncated")
            event.attributes = attrs
        out.append(event)
    if out:
        _stats.incr("weight_updates", len(out))
    return out


class Versions:
    """The weight updates the pipeline has seen, and what they say of finished rollouts."""

    def __init__(self) -> None:
        self.history = VersionHistory()

    def add(self, events: Sequence[RunEvent]) -> None:
        for event in events:
            self.history.add(event)

    def complete_trajectory(self, traj: Trajectory) -> None:
        """``policy_version_end`` and ``crossed_update`` of a trajectory (its ``worker`` set)."""
        spans = traj.spans
        end = max(s.end_ns for s in spans) if spans else 0
        traj.policy_version_end, traj.crossed_update = self._versions(
            traj.worker, spans[0].start_ns if spans else 0, end, traj.policy_version, own_version(spans))

    def complete_summary(self, summary: RolloutSummary) -> None:
        """The same for a summary (its own version, when a server gave one, is its
        ``policy_version_end`` already: :func:`rtrace.summary.fleet_fields`)."""
        summary.policy_version_end, summary.crossed_update = self._versions(
            summary.worker, summary.start_ns, summary.end_ns, summary.policy_version, summary.policy_version_end)

    def _versions(self, worker: str | None, start: int, end: int, version: Any,
                  own: int | None) -> tuple[int | None, bool | None]:
        history = self.history
        known = len(history) > 0
        end_version = own if own is not None else (history.version_at(worker, end) if known else None)
        if not known and own is None:
            return None, None
        # the server said which weights answered last, and they are not the ones it started on;
        # or the trainer marked an update while it ran
        crossed = (own is not None and type(version) is int and own != version) or (
            known and history.crossed(worker, start, end))
        return end_version, crossed


def event_shell(event: RunEvent) -> Trajectory:
    """An event as a one-span segment of a trace of its own, for the collector sink."""
    span = SpanRecord(span_id=format(_ids.span_id(), "016x"), parent_id=None, name=EVENT_SPAN, kind="event",
                      start_ns=event.time_ns, end_ns=event.time_ns,
                      attributes={EVENT_ATTR: json_text(event.to_wire())})
    return Trajectory(trace_id=format(_ids.trace_id(), "032x"), name=EVENT_SPAN, spans=[span])


def is_event_shell(segment: Trajectory) -> bool:
    spans = segment.spans
    return len(spans) == 1 and spans[0].kind == "event" and spans[0].name == EVENT_SPAN


def event_of(attrs: dict[str, Any]) -> RunEvent:
    """The event an :data:`EVENT_SPAN` carries; raises ValueError for anything else."""
    text = attrs.get(EVENT_ATTR)
    if not isinstance(text, str) or len(text) > MAX_ATTRIBUTE_CHARS + 1024:
        raise ValueError("not a run event")
    return RunEvent.from_wire(json.loads(text))
