"""Console sink: a readable tree per trajectory on stderr.

::

    rollout  step=3 sample=17 n=2  reward=1.0  ok  812.4 ms  trace 4bf92f35...
    └─ agent ToolAgentLoop.run  806.1 ms
       ├─ generation generate  401.0 ms  "Let me compute 17*3 ..."
       ├─ tool calculator  2.1 ms  -> "51"
       └─ generation generate  399.8 ms  "The answer is 51."
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, TextIO

from ..config import Settings
from ..trajectory import SpanRecord, Trajectory
from .base import Sink
from ..trajectory import response_text

__all__ = ["ConsoleSink", "format_trajectory"]

_PREVIEW = 60


def _preview(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."


def _detail(span: SpanRecord) -> str:
    if span.status == "error":
        return f"  ERROR {span.error}"
    if span.kind == "generation":
        text = response_text(span)
        return f'  "{_preview(text)}"' if text else ""
    if span.kind == "tool" and span.output is not None:
        return f"  -> {_preview(span.output)}"
    return ""


def format_trajectory(traj: Trajectory) -> str:
    """The tree of one trajectory as text (what the console sink prints)."""
    coords = " ".join(f"{label}={value}" for label, value in (
        ("step", traj.step), ("sample", traj.sample_index), ("n", traj.rollout_n),
        ("group", traj.group_id)) if value is not None)
    flags = " validate" if traj.validate else ""
    flags += " PARTIAL" if traj.partial else ""
    reward = f"  reward={traj.reward}" if traj.reward is not None else ""
    lines = [f"{traj.name}  {coords}{flags}{reward}  {traj.status}  {traj.duration_ms:.1f} ms  "
             f"trace {traj.trace_id}"]
    # Prefix per depth: whether the ancestor at that depth has siblings still to come.
    spans = traj.spans
    ids = {s.span_id for s in spans}
    last_child: dict[str | None, str] = {}
    for span in spans[1:]:
        last_child[span.parent_id if span.parent_id in ids else spans[0].span_id] = span.span_id
    open_levels: list[bool] = []
    for depth, span in traj.walk():
        if depth == 0:
            continue
        del open_levels[depth - 1:]
        parent = span.parent_id if span.parent_id in ids else spans[0].span_id
        is_last = last_child.get(parent) == span.span_id
        prefix = "".join("│  " if more else "   " for more in open_levels)
        lines.append(f"{prefix}{'└─' if is_last else '├─'} {span.kind} {span.name}  "
                     f"{span.duration_ms:.1f} ms{_detail(span)}")
        open_levels.append(not is_last)
    return "\n".join(lines)


class ConsoleSink(Sink):
    """Prints each trajectory as a tree to stderr (or the given stream)."""

    name = "console"

    def __init__(self, settings: Settings, stream: TextIO | None = None) -> None:
        super().__init__(settings)
        self.stream = stream

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        stream = self.stream or sys.stderr
        stream.write("".join(format_trajectory(t) + "\n\n" for t in trajectories))
        stream.flush()
