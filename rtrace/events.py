"""Events of the run that belong to no rollout: the trainer's weight updates.

``rtrace.mark_weight_update(version, step=..., **attributes)`` records one :class:`RunEvent`
(kind ``weight_update``): when the trainer published new weights, the policy version they
are, the step, the process that said so (its *worker* identity) and a few attributes. It
travels like an annotation (this process's pipeline; in collector mode the job's collectors,
every one of them: an update belongs to no rollout, and each collector needs the job's
updates for its own rollouts' ``policy_version_end``), and reaches the sinks that implement
``Sink.export_events``: the dataset's ``events`` table (docs/dataset.md), JSONL lines of their
own schema (:data:`EVENT_SCHEMA`, which every JSONL reader skips or uses). docs/timeline.md.

A process's *worker* identity names it on the timeline: ``RTRACE_WORKER_NAME`` when the
trainer gives one, else ``<host>:<pid>`` (:func:`worker_identity`). In collector mode a
worker's spans carry it on their OTLP resource (``service.instance.id``, beside the standard
``host.name`` and ``process.pid``): :func:`worker_of_resource` reads it back.

:class:`VersionHistory` answers what a rollout's version was when it ended, and whether an
update came while it ran, from the updates seen so far.
"""

from __future__ import annotations

import bisect
import math
import os
import socket
from typing import Any

__all__ = ["RunEvent", "WEIGHT_UPDATE", "EVENT_SCHEMA", "worker_identity", "worker_of_resource", "VersionHistory",
           "is_event_line"]

#: The kind of a weight update (the only kind so far; the wire form and the table say the kind).
WEIGHT_UPDATE = "weight_update"
#: The ``schema`` of an event's JSONL line (a trajectory's is ``rtrace.trajectory/1``).
EVENT_SCHEMA = "rtrace.event/1"


class RunEvent:
    """One event of the run (see the module docstring). Plain values only."""

    __slots__ = ("kind", "time_ns", "version", "step", "worker", "attributes", "event_id")

    def __init__(self, kind: str, time_ns: int, version: int | None = None, step: int | None = None,
                 worker: str | None = None, attributes: dict[str, Any] | None = None,
                 event_id: str | None = None) -> None:
        self.kind = kind
        #: wall time (``time.time_ns()``) of the call that marked it
        self.time_ns = time_ns
        self.version = version
        self.step = step
        #: the marking process's worker identity (set by the pipeline that takes it in)
        self.worker = worker
        self.attributes = attributes or {}
        #: 16 hex digits, drawn once: an event several collectors got is one row to readers
        self.event_id = event_id

    def __repr__(self) -> str:
        return f"RunEvent({self.kind}, version={self.version}, step={self.step}, worker={self.worker!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunEvent) and self.to_wire() == other.to_wire()

    def to_wire(self) -> dict[str, Any]:
        """The JSON form (a JSONL line's fields, the collector hop's attribute)."""
        return {"kind": self.kind, "time_ns": self.time_ns, "version": self.version, "step": self.step,
                "worker": self.worker, "attributes": self.attributes, "event_id": self.event_id}

    def to_line(self) -> dict[str, Any]:
        """The JSONL line (:data:`EVENT_SCHEMA`)."""
        return {"schema": EVENT_SCHEMA, **self.to_wire()}

    @classmethod
    def from_wire(cls, data: Any) -> "RunEvent":
        """Read :meth:`to_wire`'s (or :meth:`to_line`'s) form; raises ValueError on anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise ValueError("not a run event")
        time_ns = data.get("time_ns")
        if type(time_ns) is not int:
            raise ValueError("a run event's time_ns is an int")
        for key in ("version", "step"):
            if data.get(key) is not None and type(data[key]) is not int:
                raise ValueError(f"a run event's {key} is an int")
        for key in ("worker", "event_id"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"a run event's {key} is a string")
        attributes = data.get("attributes") or {}
        if not isinstance(attributes, dict):
            raise ValueError("a run event's attributes are a dict")
        return cls(data["kind"], time_ns, data.get("version"), data.get("step"), data.get("worker"), attributes,
                   data.get("event_id"))


def is_event_line(data: Any) -> bool:
    """A parsed JSONL line that is a run event (readers of trajectories skip it)."""
    return isinstance(data, dict) and data.get("schema") == EVENT_SCHEMA


_IDENTITY: tuple[int, str] | None = None


def worker_identity(name: str | None = None) -> str:
    """This process's worker identity: ``name`` (``RTRACE_WORKER_NAME``) when given, else
    ``<host>:<pid>`` (the pid read again in a forked child)."""
    global _IDENTITY
    if name:
        return name
    pid = os.getpid()
    if _IDENTITY is None or _IDENTITY[0] != pid:
        _IDENTITY = (pid, f"{socket.gethostname()}:{pid}")
    return _IDENTITY[1]


def worker_of_resource(attrs: dict[str, Any]) -> str | None:
    """A sender's worker identity from its OTLP resource attributes: ``service.instance.id``
    (rtrace's workers set it to :func:`worker_identity`), else ``host.name:process.pid`` (any
    OTel SDK's resource detectors), else None."""
    instance = attrs.get("service.instance.id")
    if isinstance(instance, str) and instance:
        return instance
    host, pid = attrs.get("host.name"), attrs.get("process.pid")
    if isinstance(host, str) and type(pid) is int:
        return f"{host}:{pid}"
    return None


class VersionHistory:
    """The weight updates seen so far, by time: the job's, and each marking process's.

    A rollout's updates are its own worker's when that process marked any (a rollout worker
    told of new weights), else the job's (the trainer's). Bounded: the latest
    :data:`MAX_UPDATES` of each list (a trainer marks one per step)."""

    MAX_UPDATES = 100_000

    def __init__(self) -> None:
        self._job: tuple[list[int], list[int]] = ([], [])
        self._by_worker: dict[str, tuple[list[int], list[int]]] = {}

    def __len__(self) -> int:
        return len(self._job[0])

    def add(self, event: RunEvent) -> None:
        if event.kind != WEIGHT_UPDATE or type(event.version) is not int:
            return
        lists = [self._job]
        if event.worker is not None:
            lists.append(self._by_worker.setdefault(event.worker, ([], [])))
        for times, versions in lists:
            i = bisect.bisect_right(times, event.time_ns)  # events arrive nearly in order
            times.insert(i, event.time_ns)
            versions.insert(i, event.version)
            if len(times) > self.MAX_UPDATES:
                del times[0], versions[0]

    def _of(self, worker: str | None) -> tuple[list[int], list[int]]:
        own = self._by_worker.get(worker) if worker is not None else None
        return own if own is not None and own[0] else self._job

    def version_at(self, worker: str | None, time_ns: int) -> int | None:
        """The version of the latest update at or before ``time_ns``; None before the first."""
        times, versions = self._of(worker)
        i = bisect.bisect_right(times, time_ns)
        return versions[i - 1] if i else None

    def crossed(self, worker: str | None, start_ns: int, end_ns: int) -> bool:
        """Was an update marked after ``start_ns`` and at or before ``end_ns``?"""
        times, _ = self._of(worker)
        return bisect.bisect_right(times, end_ns) > bisect.bisect_right(times, start_ns)


def plain_version(value: Any) -> int | None:
    """A policy version as an int (an int, a whole float, a 0-d tensor / numpy int), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return plain_version(item())
        except Exception:
            return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None
