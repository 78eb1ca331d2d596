"""Reading JSONL trajectory files for the report: trajectories, with what the model does not keep.

``health`` is read from the line itself: a line written before rtrace's health checks has
no ``health`` key, and its health is *unknown* (``None``), never "healthy" (``[]``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..events import is_event_line
from ..trajectory import Trajectory

try:  # the same values as the json module, ~3x faster; trackio and the otlp extra bring it
    import orjson

    _loads: Any = orjson.loads
except ImportError:  # pragma: no cover - depends on the installed extras
    _loads = json.loads

__all__ = ["Record", "ReportInputError", "read_records", "step_of", "group_of", "by_step"]


class ReportInputError(Exception):
    """A file could not be read as rtrace JSONL (the message names the file and line)."""


@dataclass
class Record:
    """One trajectory of the files, and its health findings as written."""

    traj: Trajectory
    #: ``[{"check": name, "detail": text}, ...]``, empty when healthy; ``None`` when the
    #: line has no ``health`` (written before the checks existed): unknown
    health: list[dict[str, Any]] | None


def _health(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list):
        return None
    out = []
    for finding in value:
        if isinstance(finding, dict) and finding.get("check") is not None:
            out.append({"check": str(finding["check"]), "detail": "" if finding.get("detail") is None
                        else str(finding["detail"])})
        elif finding is not None:  # a bare name: still a finding
            out.append({"check": str(finding), "detail": ""})
    return out


def read_records(paths: Sequence[str | os.PathLike]) -> tuple[list[Record], list[str]]:
    """Every trajectory of the JSONL ``paths``, in file order; and notes about lines skipped.

    A last line without its newline that does not parse is skipped with a note (the file is
    being written: readers consume up to the last ``\\n``, docs/jsonl-schema.md).

    Raises:
        ReportInputError: a file is missing, or a complete line is not an rtrace trajectory.
    """
    records: list[Record] = []
    notes: list[str] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ReportInputError(f"{path}: {exc.strerror or exc}") from None
        lines = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                raw = _loads(line)
                if is_event_line(raw):  # the run's events (docs/jsonl-schema.md): not a trajectory
                    continue
                records.append(Record(Trajectory.from_dict(raw), _health(raw.get("health", None))))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                if number == len(lines):  # no newline after it: a line still being written
                    notes.append(f"{path}:{number}: incomplete last line skipped")
                    continue
                raise ReportInputError(f"{path}:{number}: not an rtrace trajectory ({exc})") from None
    return records, notes


def step_of(traj: Trajectory) -> int | None:
    """The trajectory's step when it is an int (the step metrics' rule), else ``None``."""
    step = traj.step
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def group_of(traj: Trajectory) -> str | None:
    """The GRPO group, as the step metrics name it: ``group_id``, else ``sample_index``."""
    group = traj.group_id if traj.group_id is not None else traj.sample_index
    return None if group is None else str(group)


def by_step(records: Iterable[Record]) -> dict[tuple[bool, int | None], list[Record]]:
    """Records per ``(validate, step)``: training first, steps ascending, ``None`` last."""
    out: dict[tuple[bool, int | None], list[Record]] = {}
    for rec in records:
        out.setdefault((rec.traj.validate, step_of(rec.traj)), []).append(rec)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0)))
