"""JSONL sink: one trajectory per line, schema ``rtrace.trajectory/1`` (docs/jsonl-schema.md).

Lines are strict JSON: NaN and infinities (a NaN reward, say) are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``. Each batch is appended with one write and
flushed, so a reader sees whole lines only.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Sequence

from .._serialize import json_default, strict_json
from ..config import Settings
from ..trajectory import Trajectory
from .base import Sink

__all__ = ["JsonlSink", "read_jsonl"]


class JsonlSink(Sink):
    """Appends trajectories to ``RTRACE_JSONL_PATH`` (default ``rtrace_traces.jsonl``)."""

    name = "jsonl"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.path = os.path.abspath(settings.jsonl_path)
        self._file = None
        self._lock = threading.Lock()

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        text = "".join(
            json.dumps(strict_json(t.to_dict()), ensure_ascii=False, allow_nan=False, default=json_default) + "\n"
            for t in trajectories)
        with self._lock:
            if self._file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(text)
            self._file.flush()

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    """Read a JSONL file written by this sink back into Trajectory objects."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]
