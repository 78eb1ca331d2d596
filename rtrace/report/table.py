"""The per-step metrics table of ``rtrace report`` (stdout), and the rows the page shows too.

The same statistics as the step metrics the sinks receive (:class:`StepStats`,
docs/metrics.md), over the same trajectories: those of the step's sample
(:func:`~rtrace.pipeline.metrics.in_sample`; the ones kept for the tail only are not
counted). Several files (one per worker) merge exactly.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence, Tuple

from ..pipeline.metrics import StepStats, in_sample
from ..trajectory import Trajectory
from .load import step_of

__all__ = ["COLUMNS", "Row", "step_stats", "step_table", "format_table", "cell"]

#: ``(validate, step, metrics without the prefix, slowest trace id)``
Row = Tuple[bool, int, Dict[str, float], Optional[str]]

#: The table's columns: (header, metric name after the prefix, format).
COLUMNS = (
    ("step", None, "{}"),
    ("n", "trajectories", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("± std", "reward_std", "{:.3f}"),
    ("min", "reward_min", "{:.3f}"),
    ("max", "reward_max", "{:.3f}"),
    ("0-var groups", "zero_variance_groups_frac", "{:.0%}"),
    ("turns", "turns_mean", "{:.2f}"),
    ("tools", "tool_calls_mean", "{:.2f}"),
    ("tok in", "tokens_in_mean", "{:.0f}"),
    ("tok out", "tokens_out_mean", "{:.0f}"),
    ("err", "error_rate", "{:.0%}"),
    ("trunc", "truncated_rate", "{:.0%}"),
    ("p50 ms", "latency_ms_p50", "{:.1f}"),
    ("p90 ms", "latency_ms_p90", "{:.1f}"),
    ("max ms", "latency_ms_max", "{:.1f}"),
    ("gen", "time_generation_frac", "{:.0%}"),
    ("tool", "time_tool_frac", "{:.0%}"),
    ("stale", "staleness_mean", "{:.2f}"),
    ("wait ms", "wait_ms_mean", "{:.1f}"),
)


def step_stats(trajectories: Iterable[Trajectory]) -> dict[tuple[bool, int | None], StepStats]:
    """:class:`StepStats` per ``(validate, step)`` over the trajectories of the sample
    (steps that are not ints are under ``None``), sorted: training first, steps ascending."""
    stats: dict[tuple[bool, int | None], StepStats] = {}
    for traj in trajectories:
        if in_sample(traj):
            stats.setdefault((traj.validate, step_of(traj)), StepStats()).add(traj)
    return dict(sorted(stats.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0)))


def step_table(trajectories: Iterable[Trajectory]) -> list[Row]:
    """``(validate, step, metrics without prefix, slowest trace id)`` per integer step, in order."""
    rows: list[Row] = []
    for (validate, step), st in step_stats(trajectories).items():
        if step is not None:
            values = {k.split("/", 1)[1]: v for k, v in st.values("x").items()}
            rows.append((validate, step, values, st.slowest[1] or None))
    return rows


def cell(values: dict[str, float], name: str | None, fmt: str, step: int) -> str:
    """One cell of the table: ``-`` for a metric the step does not have."""
    if name is None:
        return str(step)
    value = values.get(name)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table (training first, then validation)."""
    out: list[str] = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        out.append("validation" if validate else "training")
        cells = [[h for h, _, _ in COLUMNS] + ["slowest trace"]]
        for _, step, values, slowest in part:
            cells.append([cell(values, name, fmt, step) for _, name, fmt in COLUMNS] + [slowest or "-"])
        widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
        for row in cells:
            out.append("  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip())
        out.append("")
    return "\n".join(out)
