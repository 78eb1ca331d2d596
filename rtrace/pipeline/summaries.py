"""Summaries of rollouts: every finished rollout is counted, recorded in full or not.

The pipeline makes one :class:`~rtrace.summary.RolloutSummary` per finished rollout:

* a trajectory it exports: ``summarize(trajectory)`` (rtrace/summary.py);
* a trajectory the per-step selection drops: :func:`summary_of_state`, from its converted
  spans, without building the Trajectory (the collector drops most of what it assembles);
* a rollout recorded as a summary only (a :class:`~rtrace.pipeline.records.Tally` from the hot
  path): :func:`state_of_tally` makes a light state of it (its root and one record per
  generation and tool call, with the token counts and finish reasons a recorded call's
  conversion gives: the same code), which then waits for its annotations and gets the
  first phase of the health checks like any other, and :func:`summary_of_state` reads it;
  a collector-mode worker, whose summaries wait in the collector instead, makes the same
  summary in one pass over the marks (:func:`summary_of_tally`).

The three agree: the summary of a rollout is the same whether it was kept, dropped or
recorded as a summary only (``tests/test_summaries.py``), so step metrics over summaries
equal those of recording everything.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Status, StatusCode

from .. import _ids, _stats
from .._serialize import Converter, ListSnapshot, only_ints, unsnap
from ..config import Settings
from ..summary import ERROR_CHARS, RolloutSummary, count_calls, fleet_fields, summarize, wait_ms
from ..trajectory import SpanRecord
from .builder import (SpanConverter, _reward, as_id_list, call_input, call_inputs, finish, read_response, results,
                      rl_coordinates)
from .health import HealthChecker, continuity_finding, finding, generation_findings
from .records import Tally, TrajectoryState, worker_of

__all__ = ["summary_of_state", "state_of_tally", "summary_state", "summarize", "records_of_tally",
           "summary_of_tally"]

_SUMMED = ("generation", "tool")


def summary_of_state(state: TrajectoryState, settings: Settings, conv: Converter,
                     priority: float | None = None) -> RolloutSummary:
    """The summary of a finished state (its records converted), without building its
    Trajectory. ``recorded`` is False: nothing of it is written in full."""
    if state.summary is not None:  # the collector: a worker's summary, with what joined it here
        return _completed(state, settings, conv, priority)
    records = state.records
    if state.summary_only:  # state_of_tally puts the root first
        root = records[0]
    else:
        root_id = format(state.root_span_id, "016x") if state.root_span_id is not None else None
        root = next((r for r in records if r.span_id == root_id), None) if root_id is not None else None
    if root is None or state.partial:  # the root never ended: finish() stands in for it (rare)
        summary = summarize(finish(state, settings, conv), priority)
        summary.recorded = False
        summary.kept = []
        return summary
    coords, extra = (state.coordinates[:2] if state.coordinates is not None
                     else rl_coordinates(state.coords, settings, conv))
    reward, outcome, annotations = results(state, conv)
    calls = count_calls(records)
    end = max(root.end_ns, calls.end)
    name = root.name
    error = root.error if root.status == "error" else None
    wait_ms, server_ms, own_version = fleet_fields(records, root.start_ns, end)
    return RolloutSummary(
        format(state.trace_id, "032x"), name if isinstance(name, str) else str(name),
        step=coords.get("step"), sample_index=coords.get("sample_index"), rollout_n=coords.get("rollout_n"),
        validate=coords["validate"], experiment=coords.get("experiment"), group_id=coords.get("group_id"),
        policy_version=coords.get("policy_version"), extra=extra, reward=reward, outcome=outcome,
        annotations=annotations, status="error" if root.status == "error" else "ok",
        error=error[:ERROR_CHARS] if isinstance(error, str) else None, partial=False, turns=calls.turns,
        tool_calls=calls.tools, tokens_in=calls.tokens_in, tokens_out=calls.tokens_out, finish_reasons=calls.reasons,
        finish_reason=calls.last_reason, start_ns=root.start_ns, end_ns=end, generation_ms=calls.gen_ns / 1e6,
        tool_ms=calls.tool_ns / 1e6,
        health=list(state.health) if settings.health_checks else None, recorded=False, kept=[],
        priority=priority, dropped_spans=state.dropped_spans, worker=worker_of(state), policy_version_end=own_version,
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
    """A summary-only state of a tallied rollout (see the module docstring). Its records
    have no ids (the root is the first, and the only one without a parent): they are never
    written; a promoted rollout's are made again (:func:`records_of_tally`)."""
    state = TrajectoryState(tally.trace_id, None, tally.name, tally.kind, tally.coords)
    state.summary_only = True
    state.reward, state.has_reward, state.outcome = tally.reward, tally.has_reward, tally.outcome
    state.root_at = time.monotonic()
    state.dropped_spans = tally.dropped_marks
    end = tally.end_ns if tally.end_ns is not None else tally.start_ns
    text = conv.conv.text  # exception text as a recorded span's: redacted, bounded, encodable
    records = [SpanRecord("", None, tally.name, tally.kind, tally.start_ns, end,
                          "error" if tally.error else "ok", text(tally.error) if tally.error else None)]
    for mark in tally.marks:
        kind = mark.spec.kind
        if kind not in _SUMMED:
            continue  # the summary counts generations and tool calls, and times them
        mark_end = mark.end_time
        if mark_end is None or mark_end > end:
            # still running when the rollout ended: a recorded span that ends after its root
            # is not part of its trajectory either (counted late)
            continue
        record = SpanRecord("", "", mark.spec.name, kind, mark.start_time, mark_end,
                            "error" if mark.error else "ok", text(mark.error) if mark.error else None)
        if mark.args is not None:  # captured
            try:
                if kind == "generation":  # the token counts and finish reason a recorded call's conversion gives
                    output = unsnap(mark.output) if mark.has_output else None
                    SpanConverter._generation(record, call_inputs(mark), mark.has_output, output, mark.spec.options)
                else:
                    _tool(record, mark)
            except Exception:
                _stats.incr("capture_errors")
                _stats.warn_once("tally-generation", "rtrace could not read a call of a summarized rollout",
                                 exc_info=True)
        records.append(record)
    state.records = records
    return state


#: what a light tool record holds for the checks: captured, and an answer that is not empty
_CAPTURED: dict[str, Any] = {}
_ANSWERED = "answered"


def _tool(record: SpanRecord, mark: Any) -> None:
    """What the health checks read of a captured tool call (its name, whether it answered
    nothing), without converting its arguments and answer: the ``generation`` check's "tool
    <name>: empty result" is then the same as for the recorded call."""
    record.attributes["gen_ai.tool.name"] = mark.spec.options.get("tool_name") or mark.owner_name or record.name
    record.input = _CAPTURED
    output = unsnap(mark.output) if mark.has_output else None
    # (a recorded call's converted answer is None or "" exactly when the answer was)
    record.output = output if output is None or (isinstance(output, str) and not output) else _ANSWERED


def records_of_tally(tally: Tally, state: TrajectoryState, conv: SpanConverter) -> list[SpanRecord]:
    """A tallied rollout as the records of one recorded in full (a worker promotes it:
    pipeline/stream.py): its root (``state``'s root span id, made now) and each mark that ended before the rollout, converted by :meth:`SpanConverter.convert`
    as its span would have been (captured values, token ids, GenAI attributes, error text).

    A mark does not know its parent (finding it on the hot path would cost every summarized
    call a context switch): the nesting is rebuilt from the times. A call's parent is the
    latest-started call that was still running from its start to its end, else the root:
    exact for calls made one after the other; of two concurrent calls (``asyncio.gather``),
    one whose time lies inside the other's is shown as its child. Marks have no events: a
    failed call has its error text, not the exception event and stack trace of a span."""
    end = tally.end_ns if tally.end_ns is not None else tally.start_ns
    if state.root_span_id is None:
        state.root_span_id = _ids.span_id()
    root = _Marked(tally.trace_id, state.root_span_id, None, tally.name, tally.start_ns, end, tally.error)
    out = [conv.convert(root, None)]
    stack = [root]  # the calls open at the current mark's start, innermost last
    for mark in tally.marks:
        mark_end = mark.end_time
        if mark_end is None or mark_end > end:
            continue  # as state_of_tally: not part of the rollout
        while len(stack) > 1 and stack[-1].end_time < mark_end:
            stack.pop()  # ended before this call did: not its parent
        span = _Marked(tally.trace_id, _ids.span_id(), stack[-1], mark.spec.name, mark.start_time, mark_end,
                       mark.error)
        out.append(conv.convert(span, mark))
        stack.append(span)
    return out


_OK = Status(StatusCode.UNSET)


class _Marked:
    """A :class:`~rtrace.pipeline.records.Mark` (or the rollout's root) read as
    :meth:`SpanConverter.convert` reads one of rtrace's spans (its ids, parent, name, times,
    status; no attributes or events: nothing could set them on a mark)."""

    __slots__ = ("trace_id", "span_id", "parent_ref", "name", "start_time", "end_time", "status")
    _attributes = None
    _events = None

    def __init__(self, trace_id: int, span_id: int, parent: "_Marked | None", name: str, start: int, end: int,
                 error: str | None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_ref = parent
        self.name = name
        self.start_time = start
        self.end_time = end
        self.status = Status(StatusCode.ERROR, error) if error else _OK


# ----------------------------------------------------------------------------- one pass (collector mode)
def summary_of_tally(tally: Tally, settings: Settings, conv: SpanConverter,
                     health: HealthChecker | None) -> RolloutSummary:
    """The summary of a tallied rollout in a collector-mode worker, in one pass over its marks:
    what :func:`state_of_tally`, the first phase of the health checks (``rollout=False``) and
    :func:`summary_of_state` give, without their records and state. The generation's token
    counts and finish reason come from the recorded call's code (``builder.read_response``,
    ``as_id_list``); a prompt grown in place from turn to turn (one list, a longer snapshot
    each turn: ``prompt_ids += ...``) has its ids checked once, each turn only what is new,
    and its continuity compared on what follows the prompt before (:class:`_Turn`)."""
    end = tally.end_ns if tally.end_ns is not None else tally.start_ns
    values = conv.conv
    turns: list[_Turn] = []
    busy: list[tuple[int, int]] = []  # the generations' and tool calls' times (the rollout's wait)
    tools = tool_ns = 0
    empty_tools: list[Any] = []
    grown: list[Any] = [None, 0]  # the prompt list read last, and how many of its ids are ints (checked)
    for mark in tally.marks:
        spec = mark.spec
        kind = spec.kind
        mark_end = mark.end_time
        if kind == "generation":
            if mark_end is None or mark_end > end:
                continue  # still running when the rollout ended (as state_of_tally)
            turns.append(_Turn(mark, grown))
        elif kind == "tool":
            if mark_end is None or mark_end > end:
                continue
            tools += 1
            tool_ns += mark_end - mark.start_time
            busy.append((mark.start_time, mark_end))
            if mark.args is not None and mark.error is None and health is not None:  # captured, answered
                output = unsnap(mark.output) if mark.has_output else None
                if output is None or (isinstance(output, str) and not output):
                    empty_tools.append(spec.options.get("tool_name") or mark.owner_name or spec.name)
    tokens_in = tokens_out = gen_ns = 0
    reasons: dict[str, int] = {}
    last_reason = last_start = None
    for turn in turns:
        gen_ns += turn.end - turn.start
        busy.append((turn.start, turn.end))
        if turn.n is not None:
            tokens_in += turn.n
        if turn.response is not None:
            tokens_out += len(turn.response)
        reason = turn.finish
        if isinstance(reason, str):  # (what the recorded call's attribute holds)
            reason = str(reason)
            reasons[reason] = reasons.get(reason, 0) + 1
            if last_start is None or turn.start >= last_start:  # the last in start order (summary_of_state)
                last_start, last_reason = turn.start, reason
    found: list[dict[str, str]] = []
    if health is not None:
        if len(turns) > 1:
            turns.sort(key=_start_end)
        _check_turns(health, turns, empty_tools, found)
    coords, extra = rl_coordinates(tally.coords, settings, values)
    outcome = values.convert_named(tally.outcome)
    reward = _reward(tally.reward, outcome) if tally.has_reward else None
    name = tally.name
    error = values.text(tally.error)[:ERROR_CHARS] if tally.error else None
    return RolloutSummary(
        format(tally.trace_id, "032x"), name if isinstance(name, str) else str(name),
        step=coords.get("step"), sample_index=coords.get("sample_index"), rollout_n=coords.get("rollout_n"),
        validate=coords["validate"], experiment=coords.get("experiment"), group_id=coords.get("group_id"),
        policy_version=coords.get("policy_version"), extra=extra, reward=reward, outcome=outcome, annotations={},
        status="error" if tally.error else "ok", error=error, partial=False, turns=len(turns), tool_calls=tools,
        tokens_in=tokens_in, tokens_out=tokens_out, finish_reasons=reasons, finish_reason=last_reason,
        start_ns=tally.start_ns, end_ns=end, generation_ms=gen_ns / 1e6, tool_ms=tool_ns / 1e6,
        health=found if settings.health_checks else None, recorded=False, kept=[], priority=None,
        dropped_spans=tally.dropped_marks, wait_ms=wait_ms(busy, tally.start_ns, end))


class _Turn:
    """One summarized generation, read as a recorded one's conversion reads it: its prompt's
    id count ``n`` (None: the prompt is not a list of ids), response ids, finish reason and
    sampler-logprob problem.

    A prompt that is the list the previous generation's prompt was (grown in place) is not
    read again: its first ``grown[1]`` ids were found to be ints, only the rest are checked, and
    ``prompt`` (the ids as a list) is made only when a continuity check needs them."""

    __slots__ = ("start", "end", "ref", "n", "prompt", "response", "finish", "problem")

    def __init__(self, mark: Any, grown: list[Any]) -> None:
        self.start = mark.start_time
        self.end = mark.end_time
        self.ref = self.n = self.prompt = self.response = self.finish = self.problem = None
        if mark.args is None:  # not captured: no tokens, no finish reason (as the recorded call)
            return
        try:
            opts = mark.spec.options
            self._prompt(call_input(mark, opts.get("prompt_field", "prompt_ids")), grown)
            output = unsnap(mark.output) if mark.has_output else None
            self.response, _, _, self.finish, _, self.problem = read_response(output, mark.has_output, opts)
        except Exception:
            _stats.incr("capture_errors")
            _stats.warn_once("tally-generation", "rtrace could not read a call of a summarized rollout",
                             exc_info=True)

    def _prompt(self, value: Any, grown: list[Any]) -> None:
        """``n`` = ``len(as_id_list(value))`` (None when that is None)."""
        if type(value) is ListSnapshot:
            ref = value.ref
            n = min(value.length, len(ref))
            if ref is grown[0]:
                checked = grown[1]
                if n <= checked or only_ints(ref[checked:n]):
                    self.ref, self.n = ref, n
                    if n > checked:
                        grown[1] = n
                    return
            ids = as_id_list(value)
            grown[0], grown[1] = (ref, n) if ids is not None else (None, 0)
            if ids is not None:
                self.ref, self.n, self.prompt = ref, n, ids
            return
        ids = as_id_list(value)
        if ids is not None:
            self.n, self.prompt = len(ids), ids

    def ids(self) -> list[int]:
        """The prompt's ids (``n`` is not None)."""
        if self.prompt is None:
            self.prompt = self.ref[:self.n]
        return self.prompt


def _start_end(turn: _Turn) -> tuple[int, int]:
    return turn.start, turn.end


def _check_turns(health: HealthChecker, turns: list[_Turn], empty_tools: list[Any], out: list) -> None:
    """The first phase of the health checks of a summarized rollout's calls (what
    ``check_state(state, rollout=False)`` finds over :func:`state_of_tally`'s records): token
    continuity, the generation check, sampler logprobs left out. ``turns`` in start order."""
    on = health.checks
    if "token_continuity" in on:
        prev: _Turn | None = None
        for k, turn in enumerate(turns, 1):
            if prev is not None and turn.n is not None:
                response = prev.response
                if turn.ref is not None and turn.ref is prev.ref and turn.n >= prev.n:
                    # one list grown in place: its first prev.n ids are the previous prompt's, the same objects
                    at = health.continuity_break(response, turn.ref[prev.n:turn.n], bool(response), prev.n)
                else:
                    at = health.continuity_break(prev.ids() + response, turn.ids(), bool(response))
                if at is not None:
                    out.append(continuity_finding(k, prev.n + len(response), *at))
            prev = turn if turn.n is not None and turn.response is not None else None
    if "generation" in on:
        last = turns[-1].finish if turns else None
        generation_findings([t.response for t in turns], [last] if isinstance(last, str) else None, empty_tools,
                            out)
    if "token_arrays" in on:
        for k, turn in enumerate(turns, 1):
            if turn.problem is not None:
                out.append(finding("token_arrays", f"turn {k}: {turn.problem}: left out"))
