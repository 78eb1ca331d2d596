"""Summaries of rollouts: every finished rollout is counted, recorded in full or not.

The pipeline makes one :class:`~rtrace.summary.RolloutSummary` per finished rollout:

* a trajectory it exports: ``summarize(trajectory)`` (rtrace/summary.py);
* a trajectory the per-step selection drops: :func:`summary_of_state`, from its converted
  spans, without building the Trajectory (the collector drops most of what it assembles);
* a rollout recorded as a summary only (a :class:`~rtrace.pipeline.records.Tally` from the hot
  path): :func:`state_of_tally` makes a light state of it (its root and one record per
  generation and tool call, with the token counts and finish reasons a recorded call's
  conversion gives: the same code), which then waits for its annotations and gets the
  first phase of the health checks like any other, and :func:`summary_of_state` reads it.

The three agree: the summary of a rollout is the same whether it was kept, dropped or
recorded as a summary only (``tests/test_summaries.py``), so step metrics over summaries
equal those of recording everything.
"""

from __future__ import annotations

import time
from typing import Any

from .. import _ids, _stats
from .._serialize import Converter, unsnap
from ..config import Settings
from ..summary import ERROR_CHARS, RolloutSummary, fleet_fields, summarize
from ..trajectory import SpanRecord
from .builder import SpanConverter, _reward, call_inputs, coordinates, finish, results
from .records import Tally, TrajectoryState

__all__ = ["summary_of_state", "state_of_tally", "summary_state", "summarize"]

_SUMMED = ("generation", "tool")


def summary_of_state(state: TrajectoryState, settings: Settings, conv: Converter,
                     priority: float | None = None) -> RolloutSummary:
    """The summary of a finished state (its records converted), without building its
    Trajectory. ``recorded`` is False: nothing of it is written in full."""
    if state.summary is not None:  # the collector: a worker's summary, with what joined it here
        return _completed(state, settings, conv, priority)
    records = state.records
    root_id = format(state.root_span_id, "016x") if state.root_span_id is not None else None
    root = next((r for r in records if r.span_id == root_id), None) if root_id is not None else None
    if root is None or state.partial:  # the root never ended: finish() stands in for it (rare)
        summary = summarize(finish(state, settings, conv), priority)
        summary.recorded = False
        summary.kept = []
        return summary
    coords, extra, _ = state.coordinates if state.coordinates is not None else coordinates(state, settings, conv)
    reward, outcome, annotations = results(state, conv)
    turns = tools = tokens_in = tokens_out = 0
    gen_ns = tool_ns = 0
    reasons: dict[str, int] = {}
    last_reason = last_start = None
    end = root.end_ns
    for r in records:
        if r.end_ns > end:
            end = r.end_ns
        kind = r.kind
        if kind == "generation":
            attrs = r.attributes
            turns += 1
            gen_ns += r.end_ns - r.start_ns
            tokens_in += _int(attrs.get("gen_ai.usage.input_tokens"))
            tokens_out += _int(attrs.get("gen_ai.usage.output_tokens"))
            found = attrs.get("gen_ai.response.finish_reasons")
            if found:
                for reason in found if isinstance(found, (list, tuple)) else (found,):
                    reasons[str(reason)] = reasons.get(str(reason), 0) + 1
                # the last one in the trajectory's tree order: siblings by start time
                if last_start is None or r.start_ns >= last_start:
                    last_start = r.start_ns
                    last_reason = str(found[0] if isinstance(found, (list, tuple)) else found)
        elif kind == "tool":
            tools += 1
            tool_ns += r.end_ns - r.start_ns
    name = root.name
    error = root.error if root.status == "error" else None
    wait_ms, server_ms, own_version = fleet_fields(records, root.start_ns, end)
    return RolloutSummary(
        format(state.trace_id, "032x"), name if isinstance(name, str) else str(name),
        step=coords.get("step"), sample_index=coords.get("sample_index"), rollout_n=coords.get("rollout_n"),
        validate=coords["validate"], experiment=coords.get("experiment"), group_id=coords.get("group_id"),
        policy_version=coords.get("policy_version"), extra=extra, reward=reward, outcome=outcome,
        annotations=annotations, status="error" if root.status == "error" else "ok",
        error=error[:ERROR_CHARS] if isinstance(error, str) else None, partial=False, turns=turns, tool_calls=tools,
        tokens_in=tokens_in, tokens_out=tokens_out, finish_reasons=reasons, finish_reason=last_reason,
        start_ns=root.start_ns, end_ns=end, generation_ms=gen_ns / 1e6, tool_ms=tool_ns / 1e6,
        health=list(state.health) if settings.health_checks else None, recorded=False, kept=[],
        priority=priority, dropped_spans=state.dropped_spans, worker=state.worker, policy_version_end=own_version,
        wait_ms=wait_ms, server_ms=server_ms)


def _completed(state: TrajectoryState, settings: Settings, conv: Converter,
               priority: float | None) -> RolloutSummary:
    """A worker's summary with the annotations joined and the checks run in the collector."""
    summary: RolloutSummary = state.summary
    if state.annotations:
        notes = conv.convert_named({k: v for k, v in state.annotations.items() if k != "reward"})
        summary.annotations = {**summary.annotations, **notes}
        if "reward" in state.annotations:
            summary.reward = _reward(state.annotations["reward"], summary.outcome)
    if settings.health_checks:
        summary.health = list(summary.health or ()) + list(state.health)
    summary.priority = priority
    return summary


def summary_state(summary: RolloutSummary, trace_id: int) -> TrajectoryState:
    """The collector's state of a worker's summary: it waits for its annotations, and its
    reward, staleness and coordinates are checked, like a trajectory's."""
    coords: dict[str, Any] = {k: getattr(summary, k) for k in ("step", "sample_index", "rollout_n", "validate",
                                                               "experiment", "group_id", "policy_version")
                              if getattr(summary, k) is not None}
    if summary.extra:
        coords["extra"] = summary.extra
    state = TrajectoryState(trace_id, None, summary.name, "rollout", coords)
    state.summary_only = True
    state.summary = summary
    state.reward, state.has_reward = summary.reward, summary.reward is not None
    state.root_at = time.monotonic()
    return state


def state_of_tally(tally: Tally, settings: Settings, conv: SpanConverter) -> TrajectoryState:
    """A summary-only state of a tallied rollout (see the module docstring)."""
    root_id = _ids.span_id()
    state = TrajectoryState(tally.trace_id, root_id, tally.name, tally.kind, tally.coords)
    state.summary_only = True
    state.reward, state.has_reward, state.outcome = tally.reward, tally.has_reward, tally.outcome
    state.root_at = time.monotonic()
    state.dropped_spans = tally.dropped_marks
    root_hex = format(root_id, "016x")
    end = tally.end_ns if tally.end_ns is not None else tally.start_ns
    records = [SpanRecord(root_hex, None, tally.name, tally.kind, tally.start_ns, end,
                          "error" if tally.error else "ok", tally.error)]
    for mark in tally.marks:
        kind = mark.spec.kind
        if kind not in _SUMMED:
            continue  # the summary counts generations and tool calls, and times them
        start = mark.start_time
        record = SpanRecord("", root_hex, mark.spec.name, kind, start,
                            mark.end_time if mark.end_time is not None else start,
                            "error" if mark.error else "ok", mark.error)
        if kind == "generation" and mark.args is not None:
            try:  # the token counts and finish reason a recorded call's conversion gives
                output = unsnap(mark.output) if mark.has_output else None
                SpanConverter._generation(record, call_inputs(mark), mark.has_output, output, mark.spec.options)
            except Exception:
                _stats.incr("capture_errors")
                _stats.warn_once("tally-generation", "rtrace could not read a generation of a summarized rollout",
                                 exc_info=True)
        records.append(record)
    state.records = records
    return state


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
