"""JSONL sink: one trajectory per line, schema ``rtrace.trajectory/1`` (docs/jsonl-schema.md).

Lines are compact, strict JSON in UTF-8: NaN and infinities (a NaN reward, say) are
written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.

When ``orjson`` is installed (trackio and the ``otlp`` extra bring it), a trajectory of
plain data (no NaN, no objects given as they are) is encoded by it
(:func:`rtrace._serialize.fast_json`): the check and the encoding take a third of the
json module's time (36 vs 117 µs for a 6-span trajectory). The values written are the
same; only the spelling of a float's exponent can differ (``1e-7`` for ``1e-07``).
Anything else goes through the json module as below. The check is skipped for a
trajectory the one-process worker vouched for (:func:`rtrace._serialize.vouched`: built
from converted values only, none of them NaN or kept as it was): 19 instead of 40 µs.

Lines are encoded in :meth:`JsonlSink.prepare`, on the pipeline's worker thread right
after it built the batch (the trajectories are still in the CPU's caches there; on the
sink's thread the same encoding took 2-4x as long), and :meth:`JsonlSink.export` writes
them; it encodes itself what prepare did not (a trajectory given to ``export`` directly).

Each trajectory is encoded on its own: one that does not encode as it is (a lone
surrogate or a 5,000-digit int that reached it without the converter) is encoded again
with only the bad values degraded (:func:`rtrace._serialize.json_safe`, counted in
``sink.jsonl.degraded_trajectories``), and never fails the rest of its batch.

Each batch is appended with one ``os.write`` of whole lines to a descriptor opened with
``O_APPEND``: lines of concurrent writers (several sinks, several processes on one
file) never interleave, and the file never ends in half a line because of rtrace.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Sequence

from .. import _stats
from .._serialize import fast_json, json_default, json_safe, plain_json, strict_json, vouched
from ..config import ConfigError, Settings, writable_path
from ..events import RunEvent, is_event_line
from ..trajectory import Trajectory
from .base import Sink

__all__ = ["JsonlSink", "read_jsonl", "read_events", "encode_line"]

#: Where :meth:`JsonlSink.prepare` keeps a trajectory's ``(line, degraded)`` for export.
_LINE = "_rtrace_jsonl_line"


def _dumps(data: Any) -> bytes:
    # check_circular=False: a trajectory is converted data, acyclic; a cycle in something
    # given as is (log_rollout_batch messages) raises RecursionError, and encode_line
    # writes the degraded form (json_safe is depth-bounded)
    return (json.dumps(data, ensure_ascii=False, allow_nan=False, default=json_default, check_circular=False,
                       separators=(",", ":")) + "\n").encode("utf-8")


def encode_line(traj: Trajectory) -> tuple[bytes, bool]:
    """One trajectory as a JSONL line (UTF-8 bytes), and whether it had to be degraded.

    Raises:
        Exception: only if even the degraded form cannot be encoded.
    """
    data = traj.to_dict()
    line = plain_json(data, newline=True) if vouched(traj) else fast_json(data, newline=True)
    if line is not None:
        return line, False
    try:
        return _dumps(data), False  # C speed: most trajectories have no NaN to rewrite
    except RecursionError:  # a cycle (or absurd nesting) in something given as is
        return _dumps(json_safe(data)), True
    except ValueError:
        data = strict_json(data)  # NaN / infinities as their strings, the rest as is
    try:
        return _dumps(data), False
    except (ValueError, TypeError, UnicodeError, RecursionError):
        return _dumps(json_safe(data)), True


class JsonlSink(Sink):
    """Appends trajectories to ``RTRACE_JSONL_PATH`` (default ``rtrace_traces.jsonl``)."""

    name = "jsonl"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.path = os.path.abspath(settings.jsonl_path)
        try:  # the default path was not checked by the settings: it is relative to the cwd
            writable_path(self.path)
        except ValueError as exc:
            raise ConfigError(f"RTRACE_JSONL_PATH: {exc}; accepted values: a writable file path") from None
        self._fd: int | None = None
        self._lock = threading.Lock()

    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Encode each line on the pipeline's thread, while the trajectory is hot (a
        trajectory that does not encode is left to :meth:`export`, which counts it)."""
        for traj in trajectories:
            try:
                traj.__dict__[_LINE] = encode_line(traj)
            except Exception:
                pass

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Encode each trajectory (unless :meth:`prepare` did), then append the batch
        with one write.

        Raises:
            OSError: the file could not be opened or written (the batch counts as failed).
        """
        lines: list[bytes] = []
        degraded = unwritable = 0
        for traj in trajectories:
            try:
                # the line prepare() made, let go of here: other sinks may hold the trajectory longer
                own = getattr(traj, "__dict__", None)
                prepared = own.pop(_LINE, None) if own is not None else None
                line, was_degraded = prepared if prepared is not None else encode_line(traj)
            except Exception:
                unwritable += 1
                _stats.warn_once("jsonl-encode", "rtrace jsonl sink could not encode a trajectory; it is "
                                 "skipped", exc_info=True)
                continue
            degraded += was_degraded
            lines.append(line)
        if degraded:
            _stats.incr("sink.jsonl.degraded_trajectories", degraded)
        if unwritable:
            _stats.incr("sink.jsonl.unwritable_trajectories", unwritable)
        self._append(b"".join(lines))

    def export_events(self, events: Sequence[RunEvent]) -> None:
        """Append the run's events as lines of their own schema (``rtrace.event/1``,
        docs/jsonl-schema.md), which readers of trajectories skip.

        Raises:
            OSError: the file could not be opened or written (counted as failed events).
        """
        self._append(b"".join(_dumps(strict_json(e.to_line())) for e in events))

    def _append(self, data: bytes) -> None:
        """One write of whole lines (``O_APPEND``: writers never interleave)."""
        with self._lock:
            if self._fd is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                # 0600 (less the umask): trajectories hold prompts and answers; an
                # existing file keeps its mode
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            view = memoryview(data)
            while view:  # a regular file takes it in one call; a short write is finished here
                written = os.write(self._fd, view)
                view = view[written:]

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    """Read a JSONL file written by this sink back into Trajectory objects (the run's event
    lines, ``rtrace.event/1``, are skipped: :func:`read_events` reads them)."""
    with open(path, encoding="utf-8") as f:
        lines = (json.loads(line) for line in f if line.strip())
        return [Trajectory.from_dict(data) for data in lines if not is_event_line(data)]


def read_events(path: str | os.PathLike) -> list[RunEvent]:
    """The run's events of a JSONL file (weight updates: ``rtrace.mark_weight_update``)."""
    with open(path, encoding="utf-8") as f:
        lines = (json.loads(line) for line in f if line.strip() and '"rtrace.event/' in line)
        return [RunEvent.from_wire(data) for data in lines if is_event_line(data)]
