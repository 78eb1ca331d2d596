"""Trajectories to Arrow tables (the two tables of :mod:`rtrace.dataset.schema`) and back.

Columns are built as Python lists, one per column, in one pass over a batch, and handed
to Arrow once per column: that is what makes the sink cheap (Arrow's conversion of a
list is C++). A value Arrow refuses (a lone surrogate in a string given as it was, an int
past 64 bits) fails the whole column: the batch is then encoded one trajectory at a time
and a trajectory that still fails is written with its bad values degraded
(:func:`rtrace._serialize.json_safe`), counted by the caller.

:func:`to_trajectories` reads rows back into :class:`~rtrace.trajectory.Trajectory` objects
(``rtrace report --html`` on a dataset). What does not come back exactly, by design:
``group_id`` is its text form, a non-finite reward is ``None``, and JSON values (inputs,
outputs, tool call arguments) come back parsed.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Sequence

import pyarrow as pa

from .._serialize import fast_json, json_default, json_safe, plain_json, vouched
from ..events import RunEvent
from ..summary import RolloutSummary, fleet_fields
from ..trajectory import Trajectory
from .schema import EVENTS, SPANS, TRAJECTORIES, TABLES, cached_schema

__all__ = ["encode", "encode_safely", "rows_of", "tables", "Rows", "to_trajectories", "partition_of", "COORD_ATTRS", "json_text",
           "events_table"]

#: span attributes that are columns of the spans table (not repeated in its maps)
COORD_ATTRS = {"rl.step": "step", "rl.validate": "validate", "rl.sample_index": "sample_index",
               "rl.rollout_n": "rollout_n", "rl.group_id": "group_id", "rl.policy_version": "policy_version"}
_GEN_ATTRS = {"gen_ai.request.model": "model", "gen_ai.tool.name": "tool_name", "gen_ai.tool.call.id": "tool_call_id",
              "gen_ai.usage.input_tokens": "input_tokens", "gen_ai.usage.output_tokens": "output_tokens",
              "gen_ai.response.finish_reasons": "finish_reasons"}
_SKIP = {**COORD_ATTRS, **_GEN_ATTRS}


def json_text(value: Any) -> str | None:
    """JSON text of a value (orjson when it can, the json module else); None stays None."""
    if value is None:
        return None
    raw = fast_json(value)
    if raw is not None:
        return raw.decode("utf-8")
    return json.dumps(value, ensure_ascii=False, default=json_default, separators=(",", ":"))


def _plain_text(value: Any) -> str | None:
    """:func:`json_text` of a value from a trajectory the worker vouched for (no NaN, no
    object given as it was: orjson without the walk that checks it)."""
    if value is None:
        return None
    raw = plain_json(value)
    return raw.decode("utf-8") if raw is not None else json_text(value)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json_text(value) if isinstance(value, (list, dict)) else str(value)


def _maps(d: dict[str, Any] | None, skip: dict[str, str] | None = None) -> tuple[list, list, list, list, list]:
    """A dict split by value type: (bool, int, double, str, json) ``(key, value)`` lists."""
    flag: list = []
    ints: list = []
    num: list = []
    text: list = []
    other: list = []
    if d:
        for key, value in d.items():
            if skip is not None and key in skip:
                continue
            kind = type(value)
            if kind is str:
                text.append((key, value))
            elif kind is int:
                if -(1 << 63) <= value < (1 << 63):
                    ints.append((key, value))
                else:
                    other.append((key, str(value)))
            elif kind is float:
                num.append((key, value))
            elif kind is bool:
                flag.append((key, value))
            elif isinstance(value, bool):
                flag.append((key, bool(value)))
            elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
                ints.append((key, int(value)))
            elif isinstance(value, float):
                num.append((key, float(value)))
            elif isinstance(value, str):
                text.append((key, str(value)))
            else:
                other.append((key, json_text(value)))
    return flag, ints, num, text, other


def _tool_calls(calls: Any) -> list | None:
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append({"id": None, "type": None, "function": {"name": None, "arguments": _str(call)}})
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        args = fn.get("arguments")
        out.append({"id": _str(call.get("id")), "type": _str(call.get("type", "function")),
                    "function": {"name": _str(fn.get("name")),
                                 "arguments": args if isinstance(args, str) or args is None else json_text(args)}})
    return out


def _message(m: Any) -> dict[str, Any]:
    """A message in the column's shape, whatever it was given as."""
    if not isinstance(m, dict):
        return {"role": None, "content": _str(m)}
    content = m.get("content")
    return {"role": _str(m.get("role")), "content": content if content is None or isinstance(content, str)
            else json_text(content), "name": _str(m.get("name")), "tool_call_id": _str(m.get("tool_call_id")),
            "tool_calls": _tool_calls(m.get("tool_calls"))}


def _task_answer(messages: Any) -> tuple[str | None, str | None]:
    task = answer = None
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                role = m.get("role")
                if role == "user" and task is None:
                    task = _str(m.get("content"))
                elif role == "assistant":
                    answer = m.get("content")
    return task, _str(answer)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def partition_of(traj: Trajectory) -> tuple[bool, int | None]:
    """``(validate, step)``: the partition folder a trajectory goes to (a step that is not
    an int goes to the ``step=__HIVE_DEFAULT_PARTITION__`` folder, NULL to every reader)."""
    step = traj.step
    return bool(traj.validate), step if type(step) is int else None


def _health(health: Any) -> list | None:
    if health is None:
        return None
    return [{"check": _str(f.get("check")), "detail": _str(f.get("detail"))} if isinstance(f, dict)
            else {"check": _str(f), "detail": None} for f in health]


def _events(events: list) -> list:
    return [{"name": _str(e.get("name")), "time": _int(e.get("time_ns")), "attributes": json_text(e.get("attributes"))}
            if isinstance(e, dict) else {"name": _str(e), "time": None, "attributes": None} for e in events]


#: One trajectory's rows: (its trajectories row, its spans rows, its messages as given).
Rows = tuple


def rows_of(traj: Trajectory | RolloutSummary, run: str, every_rollout: bool = False) -> Rows:
    """A trajectory's row and its spans' rows, in the tables' column order (the messages
    column apart: given as they are, see :func:`_messages_column`). Pure Python, no Arrow:
    the sink computes it on the pipeline's thread (``Sink.prepare``). A rollout's summary
    (:class:`~rtrace.summary.RolloutSummary`) is a row without spans (:func:`summary_rows`).
    ``every_rollout``: the run counts every rollout (one row each): every row is
    ``in_sample``."""
    if type(traj) is RolloutSummary:
        return summary_rows(traj, run)
    srows: list[tuple] = []
    validate, step = partition_of(traj)
    sample_index, rollout_n = _int(traj.sample_index), _int(traj.rollout_n)
    group_id = _str(traj.group_id)
    policy_version = _int(traj.policy_version)
    trace_id = traj.trace_id
    spans = traj.spans
    dumps = _plain_text if vouched(traj) else json_text
    turns = tools = tokens_in = tokens_out = gen_ns = tool_ns = end = 0
    truncated = False
    counted: dict[str, int] = {}
    for span in spans:
        attrs = span.attributes
        kind = span.kind
        start_ns, end_ns = span.start_ns, span.end_ns
        if end_ns > end:
            end = end_ns
        reasons = attrs.get("gen_ai.response.finish_reasons")
        t_in = attrs.get("gen_ai.usage.input_tokens")
        t_out = attrs.get("gen_ai.usage.output_tokens")
        t_in = t_in if type(t_in) is int else None
        t_out = t_out if type(t_out) is int else None
        if reasons is not None:
            reasons = [r if type(r) is str else _str(r) for r in (
                reasons if isinstance(reasons, (list, tuple)) else (reasons,))]
        if kind == "generation":
            turns += 1
            gen_ns += end_ns - start_ns
            tokens_in += t_in or 0
            tokens_out += t_out or 0
            if reasons:
                truncated = truncated or "length" in reasons
                for r in reasons:
                    counted[r] = counted.get(r, 0) + 1
        elif kind == "tool":
            tools += 1
            tool_ns += end_ns - start_ns
        maps = _maps(attrs, _SKIP)
        srows.append((  # the columns of SPANS but the trajectory's own (_FROM_TRAJECTORY: taken in Arrow)
            span.span_id, span.parent_id, span.name, kind, start_ns, end_ns,
            (end_ns - start_ns) / 1e6, span.status, _str(span.error),
            _str(attrs.get("gen_ai.request.model")), _str(attrs.get("gen_ai.tool.name")),
            _str(attrs.get("gen_ai.tool.call.id")), t_in, t_out, reasons,
            *maps, dumps(span.input), dumps(span.output),
            _events(span.events) if span.events else [], span.prompt_ids, span.response_ids,
            [{"name": k, "values": v} for k, v in span.token_values.items()] if span.token_values else None))
    root_start = spans[0].start_ns if spans else 0
    wait_ms, server_ms, own_version = fleet_fields(spans, root_start, end)
    version_end = traj.policy_version_end if traj.policy_version_end is not None else own_version
    group = traj.group_id if traj.group_id is not None else traj.sample_index
    kept = [k if type(k) is str else str(k) for k in traj.kept]
    task, answer = _task_answer(traj.messages)
    root_attrs = spans[0].attributes if spans else {}
    trow = (
        run, trace_id, traj.name, step, validate, sample_index, rollout_n, group_id, policy_version,
        _str(traj.experiment), None if group is None else str(group), _finite(traj.reward),
        _finite(traj.annotations.get("advantage")), traj.verdict(), traj.status, _str(traj.error),
        bool(traj.partial), traj.finish_reason, truncated, kept, every_rollout or not kept or "sampled" in kept,
        _health(traj.health), turns, tools, len(spans), int(traj.dropped_spans), tokens_in, tokens_out,
        root_start, end, (end - root_start) / 1e6, gen_ns / 1e6, tool_ns / 1e6, task, answer, None,
        *_maps(traj.extra), *_maps(traj.outcome), *_maps(traj.annotations), _str(root_attrs.get("rtrace.job_id")),
        traj.health_checks, True, _finite(traj.priority), list(counted.items()), _str(traj.worker),
        _int(version_end), traj.crossed_update, wait_ms, list(server_ms.items()))
    return trow, srows, traj.messages


def summary_rows(s: RolloutSummary, run: str) -> Rows:
    """A rollout counted by its summary only: its trajectories row (``recorded`` false: no
    spans, no conversation), in the order of :func:`rows_of`'s."""
    step = s.step if type(s.step) is int else None
    group = s.group
    kept = [k if type(k) is str else str(k) for k in s.kept]
    trow = (
        run, s.trace_id, _str(s.name), step, bool(s.validate), _int(s.sample_index), _int(s.rollout_n),
        _str(s.group_id), _int(s.policy_version), _str(s.experiment), None if group is None else str(group),
        _finite(s.reward), _finite(s.annotations.get("advantage")), s.verdict(), s.status, _str(s.error),
        bool(s.partial), s.finish_reason, s.truncated, kept, True, _health(s.health), s.turns, s.tool_calls, 0,
        int(s.dropped_spans), s.tokens_in, s.tokens_out, s.start_ns, s.end_ns, (s.end_ns - s.start_ns) / 1e6,
        s.generation_ms, s.tool_ms, None, None, None, *_maps(s.extra), *_maps(s.outcome), *_maps(s.annotations),
        None, None, False, _finite(s.priority), list(s.finish_reasons.items()), _str(s.worker),
        _int(s.policy_version_end), s.crossed_update if isinstance(s.crossed_update, bool) else None,
        _finite(s.wait_ms) or 0.0, [(str(k), float(v)) for k, v in s.server_ms.items()])
    return trow, [], None


def events_table(events: Sequence[RunEvent], run: str) -> pa.Table:
    """The run's events as a table of :data:`~rtrace.dataset.schema.EVENTS`."""
    schema = cached_schema(EVENTS)
    rows = [(run, e.event_id, e.kind, e.time_ns, _int(e.version), _int(e.step), _str(e.worker), *_maps(e.attributes))
            for e in events]
    columns = list(zip(*rows)) if rows else [() for _ in schema]
    return pa.Table.from_arrays([pa.array(col, type=f.type) for f, col in zip(schema, columns)], schema=schema)


_MESSAGES_AT = [name for name, _, _ in TABLES[TRAJECTORIES]].index("messages")


def _messages_column(messages: list[Any], dtype: pa.DataType) -> pa.Array:
    """The conversations as given (Arrow reads the dicts' fields by name, C++ speed); when
    Arrow refuses one (a content given as parts, arguments as a dict, a message that is
    not a dict), every conversation normalised by :func:`_message`."""
    try:
        return pa.array(messages, type=dtype)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return pa.array([None if not isinstance(ms, list) else [_message(m) for m in ms] for ms in messages],
                        type=dtype)


#: spans columns that are their trajectory's: not in a span's row, taken from the
#: trajectories table in Arrow (one C++ ``take`` instead of a Python value per span)
_FROM_TRAJECTORY = ("run", "trace_id", "step", "validate", "sample_index", "rollout_n", "group_id", "policy_version")


def _trajectories_table(rows: list[tuple], messages: list[Any]) -> pa.Table:
    schema = cached_schema(TRAJECTORIES)
    columns = list(zip(*rows)) if rows else [() for _ in schema]
    arrays = []
    for i, f in enumerate(schema):
        if i == _MESSAGES_AT:
            arrays.append(_messages_column(messages, f.type))
        else:
            arrays.append(pa.array(columns[i], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _spans_table(rows: list[tuple], owners: pa.Array, trajectories: pa.Table) -> pa.Table:
    schema = cached_schema(SPANS)
    own = [f for f in schema if f.name not in _FROM_TRAJECTORY]
    columns = list(zip(*rows)) if rows else [() for _ in own]
    built = {f.name: pa.array(col, type=f.type) for f, col in zip(own, columns)}
    for name in _FROM_TRAJECTORY:
        built[name] = trajectories.column(name).take(owners)
    return pa.Table.from_arrays([built[f.name] for f in schema], schema=schema)


def tables(rows: Sequence[Rows]) -> tuple[pa.Table, pa.Table]:
    """The trajectories and spans tables of trajectories' :func:`rows_of`.

    Raises:
        Exception: a value Arrow cannot take (see :func:`encode_safely`).
    """
    trajectories = _trajectories_table([r[0] for r in rows], [r[2] for r in rows])
    owners = pa.array([i for i, r in enumerate(rows) for _ in r[1]], type=pa.int32())
    return trajectories, _spans_table([s for r in rows for s in r[1]], owners, trajectories)


def encode(trajs: Sequence[Trajectory], run: str, every_rollout: bool = False) -> tuple[pa.Table, pa.Table]:
    """The trajectories and spans tables of a batch (``every_rollout``: see :func:`rows_of`).

    Raises:
        Exception: a value Arrow cannot take (see :func:`encode_safely`).
    """
    return tables([rows_of(t, run, every_rollout) for t in trajs])


def encode_safely(trajs: Sequence[Trajectory], run: str,
                  every_rollout: bool = False) -> tuple[pa.Table, pa.Table, int, int]:
    """:func:`encode`, and when the batch does not encode, one trajectory at a time: one
    that still fails is encoded with its bad values degraded (:func:`json_safe`).

    Returns:
        (trajectories, spans, degraded, unwritable): unwritable ones are left out.
    """
    try:
        t, s = encode(trajs, run, every_rollout)
        return t, s, 0, 0
    except Exception:
        pass
    tables: list[tuple[pa.Table, pa.Table]] = []
    degraded = unwritable = 0
    for traj in trajs:
        try:
            tables.append(encode([traj], run, every_rollout))
            continue
        except Exception:
            pass
        try:
            safe = (RolloutSummary.from_wire(json_safe(traj.to_wire())) if type(traj) is RolloutSummary
                    else Trajectory.from_dict(json_safe(traj.to_dict())))
            tables.append(encode([safe], run, every_rollout))
            degraded += 1
        except Exception:
            unwritable += 1
    if not tables:
        t, s = tables([])
        return t, s, degraded, unwritable
    return (pa.concat_tables([a for a, _ in tables]), pa.concat_tables([b for _, b in tables]), degraded,
            unwritable)


# ----------------------------------------------------------------------------- back to Trajectory
def _unmap(row: dict[str, Any], name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("bool", "int", "double", "str"):
        for key, value in row.get(f"{name}_{kind}") or ():
            out[key] = value
    for key, value in row.get(f"{name}_json") or ():
        out[key] = None if value is None else json.loads(value)
    return out


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _message_back(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [{"id": c["id"], "type": c["type"], "function": dict(c["function"] or {})}
                             for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def to_trajectories(traj_rows: Iterable[dict[str, Any]], span_rows: Iterable[dict[str, Any]]) -> list[Trajectory]:
    """Rebuild trajectories from rows of the two tables (``pa.Table.to_pylist()`` with
    timestamps as ints). Spans keep the order given (the sink writes them in tree order)."""
    from ..trajectory import SpanRecord

    by_trace: dict[str, list] = {}
    for r in span_rows:
        attrs: dict[str, Any] = {}
        for key, col in COORD_ATTRS.items():
            if r.get(col) is not None:
                attrs[key] = r[col]
        for key, col in _GEN_ATTRS.items():
            if r.get(col) is not None:
                attrs[key] = r[col]
        attrs.update(_unmap(r, "attributes"))
        by_trace.setdefault(r["trace_id"], []).append(SpanRecord(
            span_id=r["span_id"], parent_id=r["parent_span_id"], name=r["name"], kind=r["kind"],
            start_ns=_ns(r["start_time"]), end_ns=_ns(r["end_time"]), status=r["status_code"] or "ok",
            error=r["status_message"], attributes=attrs, input=_loads(r["input"]), output=_loads(r["output"]),
            events=[{"name": e["name"], "time_ns": _ns(e["time"]), "attributes": _loads(e["attributes"]) or {}}
                    for e in r["events"] or ()],
            prompt_ids=r.get("prompt_ids"), response_ids=r.get("response_ids"),
            token_values={t["name"]: t["values"] for t in r["token_values"]} if r.get("token_values") else None))
    out = []
    for r in traj_rows:
        out.append(Trajectory(
            trace_id=r["trace_id"], name=r["name"], spans=_tree_order(by_trace.get(r["trace_id"], [])), step=r["step"],
            sample_index=r["sample_index"], rollout_n=r["rollout_n"], validate=bool(r["validate"]),
            experiment=r["experiment"], group_id=r["group_id"], policy_version=r["policy_version"],
            extra=_unmap(r, "extra"), reward=r["reward"], outcome=_unmap(r, "outcome"),
            annotations=_unmap(r, "annotations"), kept=list(r["kept"] or []), status=r["status"] or "ok",
            error=r["error"], partial=bool(r["partial"]), dropped_spans=r["dropped_spans"] or 0,
            messages=[_message_back(m) for m in r["messages"] or ()], health=r["health"],
            health_checks=r.get("health_checks"), priority=r.get("priority"), worker=r.get("worker"),
            policy_version_end=r.get("policy_version_end"), crossed_update=r.get("crossed_update")))
    return out


def summary_of_row(r: dict[str, Any]) -> RolloutSummary:
    """A trajectories row (``pa.Table.to_pylist()`` with timestamps as ints) as the
    :class:`~rtrace.summary.RolloutSummary` it was written from: the step metrics of a run
    are those of its rows (``rtrace publish``). A row of a file before 1.2 has no
    ``finish_reasons``: its last generation's counts for all."""
    reasons = r.get("finish_reasons")
    if reasons is None:
        reasons = {r["finish_reason"]: r.get("num_turns") or 1} if r.get("finish_reason") else {}
    else:
        reasons = dict(reasons)
    recorded = r.get("recorded")
    return RolloutSummary(
        r["trace_id"], r["name"], step=r["step"], sample_index=r["sample_index"], rollout_n=r["rollout_n"],
        validate=bool(r["validate"]), experiment=r["experiment"], group_id=r["group_id"],
        policy_version=r["policy_version"], extra=_unmap(r, "extra"), reward=r["reward"],
        outcome=_unmap(r, "outcome"), annotations=_unmap(r, "annotations"), status=r["status"] or "ok",
        error=r["error"], partial=bool(r["partial"]), turns=r["num_turns"] or 0, tool_calls=r["num_tool_calls"] or 0,
        tokens_in=r["input_tokens"] or 0, tokens_out=r["output_tokens"] or 0, finish_reasons=reasons,
        finish_reason=r["finish_reason"], start_ns=_ns(r["start_time"]), end_ns=_ns(r["end_time"]),
        generation_ms=r["generation_ms"] or 0.0, tool_ms=r["tool_ms"] or 0.0, health=r["health"],
        recorded=recorded is not False, kept=list(r["kept"] or []), priority=r.get("priority"),
        dropped_spans=r["dropped_spans"] or 0, worker=r.get("worker"), policy_version_end=r.get("policy_version_end"),
        crossed_update=r.get("crossed_update"), wait_ms=r.get("wait_ms") or 0.0,
        server_ms=dict(r.get("server_ms") or ()))


def _tree_order(spans: list) -> list:
    """Root first, then each span's children by start time, depth first, as the pipeline
    orders them; spans whose parent is missing (dropped) follow, each with its subtree."""
    if len(spans) < 2:
        return spans
    ids = {s.span_id for s in spans}
    tops = sorted((s for s in spans if s.parent_id is None or s.parent_id not in ids),
                  key=lambda s: (s.parent_id is not None, s.start_ns))
    children: dict[str, list] = {}
    for s in spans:
        if s.parent_id is not None and s.parent_id in ids:
            children.setdefault(s.parent_id, []).append(s)
    out: list = []
    for top in tops:
        stack = [top]
        while stack:
            span = stack.pop()
            out.append(span)
            stack.extend(sorted(children.get(span.span_id, ()), key=lambda s: s.start_ns, reverse=True))
    return out


def _ns(value: Any) -> int:
    """A timestamp from Arrow's ``to_pylist`` (a datetime, or an int with ``timestamp_as_int``)."""
    if value is None or isinstance(value, int):
        return value or 0
    if hasattr(value, "value"):  # pandas.Timestamp
        return int(value.value)
    import datetime as _dt

    delta = value - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
