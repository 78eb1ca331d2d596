"""``rtrace report PATH.jsonl [...]`` or ``rtrace report DATASET``: a step at a glance from
JSONL files or from a run's dataset (the parquet exporter's; docs/report.md, docs/dataset.md).

- the per-step metrics table on stdout (the step metrics of docs/metrics.md, computed by
  :class:`~rtrace.pipeline.metrics.StepStats` over each step's sample; several files, one
  per worker, merge exactly);
- ``--html PAGE``: one static, self-contained page that shows a step: its metrics and
  histograms, GRPO groups side by side, failures, one prompt across steps, the latency
  ranking, rollout health, and any trajectory's conversation;
- ``--check``: the rollout health rates against thresholds, for CI (exit codes in
  :data:`rtrace.report.health.EXIT_CODES`).

Modules: ``load`` reads the files, ``table`` the text table, ``health`` the health rates
and the check, ``data`` the page's data, ``plots`` the SVG plots, ``page`` the HTML
(template, stylesheet and script in ``static/``), ``dataset`` the table and the check of a
dataset in SQL (DuckDB reads the files; nothing is loaded whole but for ``--html``).
"""

from __future__ import annotations

from typing import Sequence, TextIO

from .data import MAX_CHARS, MAX_MESSAGES
from .health import EXIT_CODES, USAGE, check

#: ``rtrace report`` (without --check) on files that hold no trajectory
EMPTY = 1
from .load import ReportInputError, read_records
from .table import COLUMNS, format_table, step_table

__all__ = ["COLUMNS", "EXIT_CODES", "MAX_CHARS", "step_table", "format_table", "write_report", "run"]


def write_report(paths: Sequence[str], out: TextIO, html_path: str | None = None, max_chars: int = MAX_CHARS,
                 max_messages: int = MAX_MESSAGES) -> int:
    """Print the per-step table of the JSONL ``paths``; with ``html_path``, also write the
    page. Returns the number of trajectories read.

    Raises:
        ReportInputError: a file cannot be read as rtrace JSONL.
    """
    records, notes = read_records(paths)
    _table(records, notes, paths, out)
    if html_path:
        _page(records, notes, paths, out, html_path, max_chars, max_messages)
    return len(records)


def run(paths: Sequence[str], out: TextIO, html_path: str | None = None, health_check: bool = False,
        max_rates: Sequence[str] = (), max_chars: int = MAX_CHARS, max_messages: int = MAX_MESSAGES,
        require_reward: bool = False) -> int:
    """The ``rtrace report`` command; returns its exit code. With ``health_check``, prints
    the health check instead of the table (the page is still written with ``html_path``).
    A path that is a folder or a URL is a run's dataset (alone: one run per report)."""
    from .dataset import is_dataset

    if any(is_dataset(p) for p in paths):
        if len(paths) != 1:
            out.write("rtrace report: give one dataset (a run's folder), or JSONL files\n")
            return USAGE
        return _run_dataset(paths[0], out, html_path, health_check, max_rates, max_chars, max_messages,
                            require_reward)
    try:
        records, notes = read_records(paths)
    except ReportInputError as exc:
        out.write(f"rtrace report: {exc}\n")
        return USAGE
    if not records and not health_check:
        for note in notes:
            out.write(f"note: {note}\n")
        out.write(f"rtrace report: no trajectory in {', '.join(map(str, paths))} (nothing written yet? the run "
                  "writes JSONL with RTRACE_EXPORTER=jsonl, to RTRACE_JSONL_PATH)\n")
        return EMPTY
    if not health_check:
        _table(records, notes, paths, out)
    if html_path:
        try:
            _page(records, notes, paths, out, html_path, max_chars, max_messages)
        except OSError as exc:
            out.write(f"rtrace report: cannot write {html_path}: {exc.strerror or exc}\n")
            return USAGE
    return check(records, max_rates, out, require_reward) if health_check else 0


def _run_dataset(path: str, out: TextIO, html_path: str | None, health_check: bool, max_rates: Sequence[str],
                 max_chars: int, max_messages: int, require_reward: bool = False) -> int:
    """``rtrace report DATASET``: the table and the check computed by DuckDB over the files."""
    from ..dataset.reader import DatasetError
    from . import dataset as ds
    from .health import check_steps

    try:
        run_ = ds.open_dataset(path)
        total = run_.sql("SELECT count(*) FROM trajectories").fetchall()[0][0]
    except (DatasetError, OSError, ImportError, ValueError) as exc:
        out.write(f"rtrace report: {exc}\n")
        return USAGE
    notes = [f"skipped {s.path}: {s.reason}" for s in run_.skipped]
    if not health_check:
        out.write(f"{total} trajectories from dataset {path}\n")
        for note in notes:
            out.write(f"note: {note}\n")
        no_step = run_.sql("SELECT count(*) FROM trajectories WHERE step IS NULL").fetchall()[0][0]
        if no_step:
            out.write(f"note: {no_step} trajectories have no integer step (not in the table; in the page)\n")
        out.write("\n" + format_table(ds.step_table_sql(run_)) + "\n")
    if html_path:
        try:
            _page(ds.load_records(run_), notes, [path], out, html_path, max_chars, max_messages)
        except OSError as exc:
            out.write(f"rtrace report: cannot write {html_path}: {exc.strerror or exc}\n")
            return USAGE
    if health_check:
        steps, traces, total = ds.step_health_sql(run_)
        rewarded = run_.sql("SELECT count(*) FROM trajectories WHERE reward IS NOT NULL").fetchall()[0][0] > 0
        return check_steps(steps, total, traces.__getitem__, max_rates, out, rewarded, require_reward)
    return 0


def _table(records, notes, paths, out: TextIO) -> None:
    out.write(f"{len(records)} trajectories from {len(paths)} file(s)\n")
    for note in notes:
        out.write(f"note: {note}\n")
    no_step = sum(1 for r in records if not isinstance(r.traj.step, int) or isinstance(r.traj.step, bool))
    if no_step:
        out.write(f"note: {no_step} trajectories have no integer step (not in the table; in the page)\n")
    out.write("\n" + format_table(step_table(r.traj for r in records)) + "\n")


def _page(records, notes, paths, out: TextIO, html_path: str, max_chars: int, max_messages: int) -> None:
    from .page import render  # the template and the data: only for --html

    text = render(records, paths, notes, max_chars, max_messages)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(text)
    out.write(f"wrote {html_path} ({len(text.encode('utf-8')) / 1e6:.1f} MB)\n")
