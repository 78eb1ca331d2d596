"""``rtrace report DATASET``: the same table and health check from a run's dataset
(docs/dataset.md), computed by DuckDB over the files instead of loading every trajectory.

The SQL computes what :class:`~rtrace.pipeline.metrics.StepStats` computes over the same
trajectories (those of the step's sample: ``in_sample``), so a run written to JSONL and to
Parquet prints the same table (``tests/test_report_dataset.py``). ``--html`` loads the
trajectories one step at a time (:meth:`rtrace.dataset.Run.load`) for the page.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from .health import StepHealth
from .load import Record
from .table import Row

__all__ = ["is_dataset", "open_dataset", "step_table_sql", "step_health_sql", "load_records", "STEP_SQL", "step_sql", "step_rows_of"]

#: one row per (validate, step) of the sample: the values the table shows (``{where}``
#: narrows it to some steps: ``rtrace serve`` computes again only the steps that changed)
_STEP_SQL = """
WITH t AS (SELECT * FROM trajectories WHERE in_sample AND step IS NOT NULL AND ({where})),
g AS (SELECT validate, step, group_key, count(*) AS n, min(reward) AS lo, max(reward) AS hi
      FROM t WHERE reward IS NOT NULL AND group_key IS NOT NULL GROUP BY ALL),
z AS (SELECT validate, step, count(*) FILTER (WHERE n >= 2) AS multi,
             count(*) FILTER (WHERE n >= 2 AND lo = hi) AS flat FROM g GROUP BY ALL)
SELECT t.validate, t.step, count(*) AS n,
       count(reward) AS rn, avg(reward) AS r_mean, var_pop(reward) AS r_var, min(reward) AS r_min,
       max(reward) AS r_max, sum(num_turns) AS turns, sum(num_tool_calls) AS tools,
       sum(input_tokens) AS tok_in, sum(output_tokens) AS tok_out,
       count(*) FILTER (WHERE status = 'error') AS errors, count(*) FILTER (WHERE truncated) AS trunc,
       count(*) FILTER (WHERE partial) AS part,
       quantile_cont(duration_ms, 0.5) AS p50, quantile_cont(duration_ms, 0.9) AS p90,
       max(duration_ms) AS dmax, avg(duration_ms) AS dmean, sum(duration_ms) AS total,
       sum(generation_ms) AS gen, sum(tool_ms) AS tool, arg_max(trace_id, duration_ms) AS slowest,
       sum(coalesce({wait_ms}, 0)) AS wait, count(t.step - policy_version) AS stale_n,
       avg(t.step - policy_version) AS stale_mean, max(t.step - policy_version) AS stale_max,
       any_value(z.multi) AS multi, any_value(z.flat) AS flat
FROM t LEFT JOIN z ON t.validate = z.validate AND t.step = z.step
GROUP BY t.validate, t.step ORDER BY t.validate, t.step
"""


def step_sql(where: str = "true", columns: Any = None) -> str:
    """:data:`STEP_SQL` over the trajectories ``where`` (SQL over the trajectories view) selects;
    ``columns``: the view's, when a run written before schema 1.2 may lack ``wait_ms`` (then 0, as
    :class:`~rtrace.pipeline.metrics.StepStats` counts a summary that has none)."""
    wait = "wait_ms" if columns is None or "wait_ms" in columns else "NULL"
    return _STEP_SQL.replace("{where}", where).replace("{wait_ms}", wait)


STEP_SQL = step_sql()


def is_dataset(path: str) -> bool:
    """A run's dataset (a folder, or a URL) rather than a JSONL file."""
    from ..dataset.layout import is_url

    return is_url(str(path)) or os.path.isdir(path)


def open_dataset(path: str) -> Any:
    from ..dataset.reader import open_run

    return open_run(path)


def step_table_sql(run: Any) -> list[Row]:
    """The report's rows (:func:`rtrace.report.table.step_table`) from the dataset."""
    rel = run.sql(step_sql("true", run.sql("SELECT * FROM trajectories LIMIT 0").columns))
    return step_rows_of(rel.columns, rel.fetchall())


def step_rows_of(names: Sequence[str], result: Sequence[tuple]) -> list[Row]:
    """The report's rows from :func:`step_sql`'s result (its column names and rows)."""
    rows: list[Row] = []
    for raw in result:
        r = dict(zip(names, raw))
        n = r["n"]
        values: dict[str, float] = {"trajectories": n}
        if r["rn"]:
            values["reward_mean"] = r["r_mean"]
            values["reward_std"] = math.sqrt(max(0.0, r["r_var"] or 0.0))
            values["reward_min"] = r["r_min"]
            values["reward_max"] = r["r_max"]
        if r["multi"]:
            values["zero_variance_groups_frac"] = r["flat"] / r["multi"]
        values.update(turns_mean=r["turns"] / n, tool_calls_mean=r["tools"] / n, tokens_in_mean=r["tok_in"] / n,
                      tokens_out_mean=r["tok_out"] / n, error_rate=r["errors"] / n, truncated_rate=r["trunc"] / n,
                      partial_rate=r["part"] / n, latency_ms_mean=r["dmean"], latency_ms_p50=r["p50"],
                      latency_ms_p90=r["p90"], latency_ms_max=r["dmax"])
        # the fleet in time, as StepStats gives them (docs/metrics.md): staleness over the rollouts
        # that have a policy version, time in generation / tools / neither per rollout
        if r["stale_n"]:
            values.update(staleness_mean=r["stale_mean"], staleness_max=r["stale_max"])
        values.update(generation_ms_mean=(r["gen"] or 0.0) / n, tool_ms_mean=(r["tool"] or 0.0) / n,
                      wait_ms_mean=r["wait"] / n)
        total = r["total"]
        if total and total > 0:
            gen, tool = min(r["gen"], total), min(r["tool"], total)
            values["time_generation_frac"] = gen / total
            values["time_tool_frac"] = min(tool, total - gen) / total
            values["time_other_frac"] = max(0.0, total - gen - tool) / total
        rows.append((bool(r["validate"]), int(r["step"]), {k: float(v) for k, v in values.items()}, r["slowest"]))
    return rows


def step_health_sql(run: Any) -> tuple[list[StepHealth], list[str], int]:
    """Each step's :class:`StepHealth` from the dataset, the trace ids its findings refer
    to (``findings`` hold indices into that list: one example per step and check), and
    the number of trajectories."""
    total = run.sql("SELECT count(*) FROM trajectories").fetchall()[0][0]
    steps: dict[tuple[bool, Any], StepHealth] = {}
    for validate, step, checked, unknown in run.sql(
            "SELECT validate, step, count(*) FILTER (WHERE in_sample AND health IS NOT NULL), "
            "count(*) FILTER (WHERE in_sample AND health IS NULL) FROM trajectories GROUP BY ALL").fetchall():
        steps[(bool(validate), step)] = StepHealth(bool(validate), step, checked=checked, unknown=unknown)
    for validate, step, ran in run.sql(
            "SELECT validate, step, list_distinct(flatten(list(health_checks))) FROM trajectories "
            "WHERE health_checks IS NOT NULL GROUP BY ALL").fetchall():
        steps[(bool(validate), step)].ran = set(ran)  # (files of schema 1.0 have none: unknown)
    traces: list[str] = []
    for validate, step, check, failing, trace_id, detail in run.sql(
            "WITH f AS (SELECT validate, step, in_sample, trace_id, unnest(health) AS h FROM trajectories "
            "WHERE len(health) > 0) "
            "SELECT validate, step, h.check, count(DISTINCT trace_id) FILTER (WHERE in_sample), "
            "min(trace_id), arg_min(coalesce(h.detail, ''), trace_id || chr(1) || coalesce(h.detail, '')) "
            "FROM f GROUP BY ALL").fetchall():
        h = steps[(bool(validate), step)]
        if failing:
            h.failing[str(check)] = failing
        h.findings.append((len(traces), str(check), "" if detail is None else str(detail)))
        traces.append(trace_id)
    ordered = sorted(steps.values(), key=lambda h: (h.validate, h.step is None, h.step or 0))
    return ordered, traces, total


def load_records(run: Any) -> list[Record]:
    """Every trajectory of the run as report records, read one step at a time."""
    records: list[Record] = []
    for validate, step in run.steps():
        where = "validate = ? AND " + ("step IS NULL" if step is None else "step = ?")
        params = [validate] if step is None else [validate, step]
        for traj in run.load(where, params):
            records.append(Record(traj, traj.health))
    return records
