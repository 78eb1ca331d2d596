"""From finished OTel spans and captured calls to :class:`~rtrace.trajectory.Trajectory`.

Runs in the worker thread. Everything the hot path postponed happens here: captured
arguments become bounded, redacted JSON; RL coordinates are stamped as ``rl.*`` on
every span; GenAI attributes are derived for generation and tool spans; token ids are
read out of the captured values; token2text decodes a whole batch at once; the
conversation (``messages``) is built last, from whatever text is available.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opentelemetry.trace import StatusCode

from .. import _stats
from .._serialize import (Converter, ListSnapshot, array_to_python, attr_ok, is_array, json_text, only_ints,
                          truncate, unsnap, vouch)
from ..config import Settings
from ..trajectory import RL_FIELDS, SpanRecord, Trajectory
from .messages import tool_result
from .records import CallRecord, Deferred, TrajectoryState, snapshot_args, start_end
from .tokens import LOGPROB_KEYS, SAMPLER, TOKEN_PROBLEM, sampler_logprobs

__all__ = ["SpanConverter", "finish", "coordinates", "rl_coordinates", "tail_of", "as_id_list", "call_inputs",
           "call_input", "results", "read_response"]

_ERROR = StatusCode.ERROR


def as_id_list(value: Any) -> list[int] | None:
    """Token ids as a list of ints, from a list, tuple, numpy array or torch tensor."""
    cls = type(value)
    if cls is ListSnapshot:  # a prompt as the call saw it: its slice is already a new list
        value = value.value()
        return value if only_ints(value) else None
    if cls is list or cls is tuple:
        return list(value) if only_ints(value) else None
    value = unsnap(value)
    if value is None:
        return None
    if is_array(value):
        value = array_to_python(value)
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # a batch of one
    if isinstance(value, (list, tuple)) and only_ints(value):  # bools are not ids
        return list(value)
    return None


def _field(value: Any, *names: str) -> Any:
    """``value[name]`` or ``value.name`` for the first name present."""
    value = unsnap(value)
    for name in names:
        if isinstance(value, dict):
            if name in value:
                return value[name]
        elif hasattr(value, name) and not callable(getattr(value, name)):
            return getattr(value, name)
    return None


def _fields(value: Any) -> dict[str, Any] | None:
    """A dict, a dataclass or a pydantic model (veRL's ``TokenOutput``) as a dict of its
    fields (shallow); None for anything else."""
    if isinstance(value, dict):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(type(value), "model_dump", None)
    if callable(dump):
        try:
            return dict(dump(value))
        except Exception:
            return None
    return None


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


class SpanConverter:
    """Converts ended spans into :class:`SpanRecord` as they reach the worker.

    One instance per worker round: it owns that round's :class:`Converter`, whose
    counters (truncated, redacted, errors) are added to ``rtrace.stats()`` by
    :meth:`count`.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.conv = Converter(settings.max_value_chars, settings.redact_keys)

    def count(self) -> None:
        """Add this round's conversion counters to ``rtrace.stats()``."""
        conv = self.conv
        for name, n in (("values_truncated", conv.truncated), ("values_redacted", conv.redacted),
                        ("capture_errors", conv.errors)):
            if n:
                _stats.incr(name, n)
        conv.truncated = conv.redacted = conv.errors = 0

    def convert(self, span: Any, rec: CallRecord | None, stamp: dict[str, Any] | None = None) -> SpanRecord:
        """One ended span (rtrace's own, or an SDK ``ReadableSpan``) and the call record of its
        decorated call as a SpanRecord; its attributes start with ``stamp`` (the
        trajectory's ``rl.*``), when given."""
        conv = self.conv
        try:  # one of rtrace's own spans: its ids as they are (no SpanContext made), its
            # attribute dict and event list as it keeps them (None when it has none)
            trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_ref
            attrs, events = span._attributes, span._events
        except AttributeError:  # an SDK span (an application's provider, a segment)
            ctx = span.context
            trace_id, span_id, parent = ctx.trace_id, ctx.span_id, span.parent
            attrs, events = span.attributes, span.events
        status = span.status
        is_error = status.status_code is _ERROR
        name = span.name
        start = span.start_time or 0
        end = span.end_time or start
        attribute = conv.attribute
        if stamp is not None:  # the stamp first, the span's own values over it (as finish() merges)
            merged = stamp.copy()
            if attrs:
                for key, value in attrs.items():
                    merged[key] = attribute(key, value)
            attrs = merged
        elif attrs:
            attrs = {key: attribute(key, value) for key, value in attrs.items()}
        else:
            attrs = {}
        out = SpanRecord(
            format(span_id, "016x"),
            format(parent.span_id, "016x") if parent is not None and parent.trace_id == trace_id else None,
            name, rec.spec.kind if rec is not None else "span", start, end, "error" if is_error else "ok",
            # exception text and attributes the application set did not come through a
            # capture: bounded, redacted and made encodable like every captured value
            conv.text(status.description or "") if is_error else None,
            attrs, None, None,
            [{"name": e.name, "time_ns": e.timestamp, "attributes": _attributes(e.attributes, conv)}
             for e in events] if events else [])
        if type(name) is not str or type(start) is not int or type(end) is not int or (events and any(
                type(e["name"]) is not str or type(e["time_ns"]) is not int for e in out.events)):
            conv.unplain += 1  # what the application gave its span as it was (a float end time ...)
        if rec is not None and isinstance(rec.kwargs, Deferred):
            _resolve(out, rec, conv)
        if rec is not None and rec.args is not None:
            self._captured(out, rec, conv)
        return out

    def _captured(self, out: SpanRecord, rec: CallRecord, conv: Converter) -> None:
        spec = rec.spec
        inputs = call_inputs(rec)
        has_output = rec.has_output
        output = unsnap(rec.output) if has_output else None
        attrs = out.attributes
        opts = spec.options
        if spec.kind == "generation":
            # Token ids go to prompt_ids/response_ids before anything is converted to
            # JSON: they are not stored twice, and converting long id lists is most of
            # the worker's cost.
            has_output, output = self._generation(out, inputs, has_output, output, opts)
        elif spec.kind == "tool":
            attrs["gen_ai.operation.name"] = "execute_tool"
            attrs["gen_ai.tool.name"] = opts.get("tool_name") or rec.owner_name or out.name
            call_id = unsnap(inputs.get("tool_call_id", inputs.get("call_id")))
            if isinstance(call_id, (str, int)):
                attrs["gen_ai.tool.call.id"] = str(call_id)
        out.input = conv.convert_named(inputs)
        if has_output:
            out.output = conv(output)
            if spec.kind == "tool":
                _tool_attributes(attrs, out.output)
        if spec.default_name and (spec.kind == "tool" or spec.kind == "generation"):
            _display_name(out, spec.function)

    @staticmethod
    def _generation(out: SpanRecord, inputs: dict[str, Any], has_output: bool, output: Any,
                    opts: dict[str, Any]) -> tuple[bool, Any]:
        """Fill prompt_ids / response_ids and the GenAI attributes of a generation span.

        Removes the id lists from ``inputs`` and returns ``(has_output, output)`` without
        them (an output that is the id list itself leaves no output)."""
        attrs = out.attributes
        # (a span may name its operation itself: the gateway's completions are text_completion)
        attrs.setdefault("gen_ai.operation.name", "chat")
        model = opts.get("model") or unsnap(inputs.get("model"))
        if isinstance(model, str):
            attrs["gen_ai.request.model"] = model
        prompt_field = opts.get("prompt_field", "prompt_ids")
        out.prompt_ids = as_id_list(inputs.get(prompt_field))
        if out.prompt_ids is not None:
            del inputs[prompt_field]
            attrs["gen_ai.usage.input_tokens"] = len(out.prompt_ids)
        ids, has_output, output, finish, values, problem = read_response(output, has_output, opts)
        if values is not None:
            out.token_values = {SAMPLER: values}
        elif problem is not None:
            attrs[TOKEN_PROBLEM] = problem
        out.response_ids = ids
        if ids is not None:
            attrs["gen_ai.usage.output_tokens"] = len(ids)
        if isinstance(finish, str):
            attrs["gen_ai.response.finish_reasons"] = [finish]
        return has_output, output


def read_response(output: Any, has_output: bool, opts: dict[str, Any]) -> tuple[Any, bool, Any, Any, Any, Any]:
    """What a generation's output says, read once for a recorded call
    (:meth:`SpanConverter._generation`) and a summarized one (pipeline/summaries.py), so both
    count the same tokens and finish reason: ``(response ids or None, has_output, the output
    without its ids and logprobs, the finish reason (used when a str), the sampler's per-token
    logprobs (float32) or None, why they were left out or None)``."""
    if type(output) is dict:  # what the general path below does for a dict, in fewer steps
        id_keys = (opts.get("response_field", "response_ids"), "token_ids", "output_ids")
        key = next((k for k in id_keys if k in output), None)
        ids = as_id_list(output[key]) if key is not None else None
        if ids is not None:  # the ids are kept once, in response_ids
            output = {k: v for k, v in output.items() if k not in id_keys}
        finish = output["finish_reason"] if "finish_reason" in output else output.get("stop_reason")
    else:
        ids = as_id_list(output)
        if ids is not None:
            has_output, output = False, None
        elif output is not None:
            id_keys = (opts.get("response_field", "response_ids"), "token_ids", "output_ids")
            ids = as_id_list(_field(output, *id_keys))
            view = _fields(output) if ids is not None else None
            if view is not None:  # the ids are kept once, in response_ids
                output = {k: v for k, v in view.items() if k not in id_keys}
        finish = _field(output, "finish_reason", "stop_reason") if output is not None else None
    values = problem = None
    if ids is not None and type(output) is dict and not output.keys().isdisjoint(LOGPROB_KEYS):
        # the sampler's per-token logprobs: a float32 array beside the ids, not JSON
        key, values = sampler_logprobs(output)
        output = {k: v for k, v in output.items() if k != key}
        if values is None or len(values) != len(ids):  # said by the token_arrays check (pipeline/health.py)
            _stats.incr("token_arrays_unreadable" if values is None else "token_arrays_misaligned")
            problem = (f"{key}: not a list of numbers" if values is None else
                       f"{key} has {len(values)} values for {len(ids)} response tokens")
            values = None
    return ids, has_output, output, finish, values, problem


def call_inputs(rec: Any) -> dict[str, Any]:
    """A captured call's arguments by name (``self`` / ``cls`` left out; list arguments
    as they were at the call)."""
    spec = rec.spec
    args, names = snapshot_args(rec), spec.param_names
    if spec.skip_first:
        args, names = args[1:], names[1:]
    if len(args) <= len(names):
        inputs = dict(zip(names, args))
    else:
        inputs = {names[i] if i < len(names) else f"arg{i}": value for i, value in enumerate(args)}
    if rec.kwargs:
        inputs.update(rec.kwargs)
    return inputs


def call_input(rec: Any, name: str) -> Any:
    """``call_inputs(rec).get(name)`` without making the dict (a summarized generation reads
    its prompt only)."""
    kwargs = rec.kwargs
    if kwargs and name in kwargs:
        return kwargs[name]
    spec = rec.spec
    names, args, lens = spec.param_names, rec.args or (), rec.arg_lens
    first = 1 if spec.skip_first else 0
    n_args, n_names = len(args) - first, len(names) - first
    if n_args <= n_names:
        try:
            i = names.index(name, first) - first
        except ValueError:
            return None
        if i >= n_args:
            return None
    elif name.startswith("arg") and name[3:].isdigit() and int(name[3:]) >= n_names:
        i = int(name[3:])  # an argument past the named ones (``*args``): call_inputs names it arg<i>
        if i >= n_args or str(i) != name[3:]:
            return None
    else:
        try:
            i = names.index(name, first) - first
        except ValueError:
            return None
    value = args[first + i]
    if lens is not None and lens[first + i] >= 0:
        return ListSnapshot(value, lens[first + i])
    return value


def _resolve(out: SpanRecord, rec: Any, conv: Converter) -> None:
    """A record read only now (:class:`~rtrace.pipeline.records.Deferred`): its inputs and
    output become the record's, its attributes the span's (over its own). A failure to read
    is counted; the span stays, without a record."""
    try:
        inputs, output, attributes = rec.kwargs.resolve()
    except Exception:
        _stats.incr("capture_errors")
        _stats.warn_once("deferred-record", "rtrace could not read a call's record", exc_info=True)
        inputs, output, attributes = None, None, {}
    attrs = out.attributes
    for key, value in attributes.items():
        attrs[key] = conv.attribute(key, value)
    if inputs is None:
        rec.args = rec.kwargs = rec.output = None
        rec.has_output = False
    else:
        rec.args, rec.kwargs = (), inputs
        rec.output, rec.has_output = output, output is not None


def _display_name(out: SpanRecord, function: str | None) -> None:
    """Name a tool span after its tool (``gen_ai.tool.name``) and a generation span after
    its model (``gen_ai.request.model``), so that every sink shows ``calculator`` rather
    than ``CalculatorTool.execute``; the function's fully-qualified name (``module.qualname``)
    goes in OTel's ``code.function.name`` attribute (``code.function``, which held the bare
    name, is deprecated). Only for spans named by default (no ``name=``)."""
    attrs = out.attributes
    key = "gen_ai.tool.name" if out.kind == "tool" else "gen_ai.request.model" if out.kind == "generation" else None
    shown = attrs.get(key) if key else None
    if isinstance(shown, str) and shown and shown != out.name:
        attrs["code.function.name"] = function or out.name
        out.name = shown


#: Tool span attributes read out of what the tool returned (see :func:`messages.tool_result`).
TOOL_REWARD = "rl.tool.reward"
TOOL_DONE = "rl.tool.done"
TOOL_METRICS = "rl.tool.metrics."


def _tool_attributes(attrs: dict[str, Any], output: Any) -> None:
    """The step reward, done flag and metrics a tool returned with its answer (veRL's
    ``(ToolResponse, reward, metrics)``, gym-style tuples, ...) as ``rl.tool.reward``,
    ``rl.tool.done`` and ``rl.tool.metrics.<key>`` (a value that is not an attribute
    value is its JSON text, None is left out); an OpenAI tool message's ``tool_call_id`` as
    ``gen_ai.tool.call.id`` unless the call had one."""
    if type(output) is str:
        return  # the answer alone: no reward, flag, metrics or call id
    result = tool_result(output)
    if result.reward is not None:
        attrs[TOOL_REWARD] = result.reward
    if result.done is not None:
        attrs[TOOL_DONE] = result.done
    for key, value in (result.metrics or {}).items():
        if value is None:
            continue
        attrs[f"{TOOL_METRICS}{key}"] = value if attr_ok(value) else json_text(value)
    if result.call_id is not None:
        attrs.setdefault("gen_ai.tool.call.id", result.call_id)


def finish(state: TrajectoryState, settings: Settings, conv: Converter) -> Trajectory:
    """The Trajectory of a finished (or expired) state: spans in tree order, the RL
    coordinates stamped as ``rl.*`` on every span, reward, outcome and annotations on
    the root. Reads the state, never writes it."""
    unplain = conv.unplain
    records = list(state.records)
    root_id = _hex_span(state.root_span_id) if state.root_span_id is not None else None
    by_id = {r.span_id: r for r in records}
    if root_id is None or root_id not in by_id:
        # The root never ended (orphan timeout / shutdown / lost): stand in for it.
        if root_id is None:
            root_id = _hex_span(state.trace_id & 0xFFFFFFFFFFFFFFFF or 1)
        end = max((r.end_ns for r in records), default=state.created_ns)
        start = min((r.start_ns for r in records), default=state.created_ns)
        records.append(SpanRecord(span_id=root_id, parent_id=None, name=state.name, kind=state.kind,
                                  start_ns=min(start, state.created_ns), end_ns=max(end, state.created_ns),
                                  status="unset", attributes={"rtrace.partial": True}))
        by_id[root_id] = records[-1]
        if state.coordinates is not None:  # the others were stamped at conversion
            records[-1].attributes = {**state.coordinates[2], "rtrace.partial": True}
    spans = _tree_order(records, root_id, by_id)
    root = spans[0]
    if root.kind == "span":  # a rollout_context root has no call record
        root.kind = state.kind
    # A root opened inside an application span links to it instead of using it as
    # parent; a segment's remote parent is kept in ``rtrace.remote_parent``, which the
    # one OTel conversion (exporters/otel) uses to join the process's tree.
    root.parent_id = None

    stamped = state.coordinates is not None
    coords, extra, stamp = state.coordinates if stamped else coordinates(state, settings, conv)
    reward, outcome, annotations = results(state, conv)
    if not stamped:  # (the one-process worker stamped each record when it converted it)
        for span in spans:
            own = span.attributes
            if own:
                merged = stamp.copy()
                merged.update(own)  # a span's own value wins (a generation's version)
                span.attributes = merged
            else:
                span.attributes = stamp.copy()
    if reward is not None:
        root.attributes["rl.reward"] = reward
    step, version = coords.get("step"), coords.get("policy_version")
    if type(step) is int and type(version) is int:
        root.attributes["rl.staleness"] = step - version
    root.attributes.update({f"rl.outcome.{k}": v for k, v in outcome.items() if attr_ok(v)})
    root.attributes.update({f"rl.{k}": v for k, v in annotations.items() if attr_ok(v)})

    traj = Trajectory(
        trace_id=format(state.trace_id, "032x"), name=root.name, spans=spans,
        step=coords.get("step"), sample_index=coords.get("sample_index"),
        rollout_n=coords.get("rollout_n"), validate=coords["validate"],
        experiment=coords.get("experiment"), group_id=coords.get("group_id"),
        policy_version=coords.get("policy_version"), extra=extra, reward=reward, outcome=outcome,
        annotations=annotations,
        status="error" if root.status == "error" else "ok", error=root.error,
        partial=state.partial, dropped_spans=state.dropped_spans,
        messages=list(state.messages) if state.messages else [], kept=list(state.kept),
        health=list(state.health) if settings.health_checks else None)
    if (state.plain and conv.unplain == unplain and not state.messages and type(traj.name) is str
            and (reward is None or reward - reward == 0.0)):
        vouch(traj)  # converted values only, none of them NaN or kept as it was
    return traj


def results(state: TrajectoryState, conv: Converter) -> tuple[float | None, dict[str, Any], dict[str, Any]]:
    """A finished state's reward (an annotated ``reward`` over the recorded one), outcome
    and annotations, converted (a reward that is no number is counted and kept as outcome
    ``reward_raw``: call this once per trajectory)."""
    outcome = conv.convert_named(state.outcome)
    reward = _reward(state.reward, outcome) if state.has_reward else None
    annotations = conv.convert_named({k: v for k, v in state.annotations.items() if k != "reward"})
    if "reward" in state.annotations:
        reward = _reward(state.annotations["reward"], annotations)
    return reward, outcome, annotations


def tail_of(state: TrajectoryState, keep_by: str) -> Any:
    """What the end-of-trajectory selection needs to know about a finished state."""
    from .sampling import Tail

    failed = state.partial
    for record in state.records:
        if record.status == "error" and record.parent_id is None:
            failed = True
        if "length" in (record.attributes.get("gen_ai.response.finish_reasons") or ()):
            failed = True
    reward = _number(state.annotations.get("reward", state.reward if state.has_reward else None))
    value = reward if keep_by == "reward" else _number(state.annotations.get(keep_by))
    return Tail(failed, value, reward, bool(state.health), _number(state.annotations.get("logprob_mismatch_k3")))


def _number(value: Any) -> float | None:
    value = unsnap(value)
    try:
        if is_array(value):
            value = value.item()
        out = float(value)
    except Exception:
        return None
    return out if math.isfinite(out) else None


#: coordinate -> its attribute (``step`` -> ``rl.step``)
_RL_KEYS = {k: f"rl.{k}" for k in RL_FIELDS}


def coordinates(state: TrajectoryState, settings: Settings,
                conv: Converter) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The trajectory's RL coordinates, its ``extra`` ones (values converted; secret-looking
    keys redacted), and the ``rl.*`` attributes every span of it carries."""
    coords, extra = rl_coordinates(state.coords, settings, conv)
    stamp = {}
    for k, v in coords.items():
        key = _RL_KEYS.get(k)
        if key is not None and attr_ok(v):
            stamp[key] = v
    if extra:
        stamp.update({f"rl.extra.{k}": v for k, v in extra.items() if attr_ok(v)})
    return coords, extra, stamp


def rl_coordinates(given: dict[str, Any], settings: Settings, conv: Converter) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`coordinates` of a trajectory's ``rollout_context`` coordinates, without the
    ``rl.*`` stamp (a rollout's summary has no spans to stamp)."""
    coords = {k: conv(v) for k, v in given.items() if k != "extra"}
    extra = conv.convert_named(given.get("extra") or {})
    coords["validate"] = bool(coords.get("validate") or False)
    if settings.experiment is not None:
        coords.setdefault("experiment", settings.experiment)
    return coords, extra


def _reward(value: Any, outcome: dict[str, Any]) -> float | None:
    """The reward as a float; anything that is not one real number (a tensor of two, a
    string, an int beyond float range) is kept as ``reward_raw`` in ``outcome`` (a
    bounded repr, written into the trajectory's own dict) and counted."""
    value = unsnap(value)
    if value is None:
        return None
    try:
        if is_array(value):
            value = value.item()  # a one-element tensor / array; more elements raise
        reward = float(value)
    except Exception:
        _stats.incr("reward_errors")
        _stats.warn_once("reward", "rtrace: a reward is not a number (%s); recorded as outcome reward_raw",
                         type(value).__name__)
        try:
            raw = repr(value)
        except Exception:
            raw = f"<{type(value).__name__}>"
        outcome["reward_raw"] = truncate(raw, 200)
        return None
    if not math.isfinite(reward):
        _stats.incr("rewards_non_finite")
    return reward


def _attributes(attrs: Any, conv: Converter) -> dict[str, Any]:
    """An SDK span's attributes as a dict: tuples as lists, strings bounded and redacted,
    secret-looking keys redacted, ints beyond 64 bits as strings (``Converter.attribute``)."""
    return {key: conv.attribute(key, value) for key, value in (attrs or {}).items()}


def _tree_order(records: list[SpanRecord], root_id: str, by_id: dict[str, SpanRecord]) -> list[SpanRecord]:
    """Root first, then depth first with siblings by start time. Spans whose parent is
    missing (dropped or never ended) are placed under the root. ``by_id``: the records by
    span id (the last of a duplicated id)."""
    children: dict[str, list[SpanRecord]] = {}
    for r in records:
        span_id = r.span_id
        if span_id == root_id:
            continue
        parent = r.parent_id
        if parent not in by_id:
            parent = root_id
        kids = children.get(parent)
        if kids is None:
            children[parent] = [r]
        else:
            kids.append(r)
    ordered: list[SpanRecord] = []
    stack = [by_id[root_id]]
    while stack:
        node = stack.pop()
        ordered.append(node)
        kids = children.get(node.span_id)
        if kids:
            if len(kids) > 1:
                kids.sort(key=start_end)  # stable: ties keep their arrival order
                stack.extend(reversed(kids))
            else:
                stack.append(kids[0])
    return ordered
