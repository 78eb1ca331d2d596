"""From finished OTel spans and captured calls to :class:`~rtrace.trajectory.Trajectory`.

Runs in the worker thread. Everything the hot path postponed happens here: captured
arguments become bounded, redacted JSON; RL coordinates are stamped as ``rl.*`` on
every span; GenAI attributes are derived for generation and tool spans; token ids are
read out of the captured values; token2text decodes a whole batch at once; the
conversation (``messages``) is built last, from whatever text is available.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from opentelemetry.trace import StatusCode

from .. import _stats
from .._capture import CallRecord, TrajectoryState
from .._serialize import Converter, array_to_python, is_array, unsnap
from ..config import Settings
from ..trajectory import RL_FIELDS, SpanRecord, Trajectory
from .messages import build_messages

__all__ = ["TrajectoryBuilder", "as_id_list"]

Postprocessor = Callable[[list[Trajectory]], None]


def as_id_list(value: Any) -> list[int] | None:
    """Token ids as a list of ints, from a list, tuple, numpy array or torch tensor."""
    value = unsnap(value)
    if value is None:
        return None
    if is_array(value):
        value = array_to_python(value)
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # a batch of one
    # set(map(type, ...)) runs in C (2x faster than isinstance per id); bools are not ids
    if isinstance(value, (list, tuple)) and (not value or set(map(type, value)) == {int}):
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


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


class TrajectoryBuilder:
    """Builds trajectories; ``postprocessors`` (e.g. token2text) run on each batch."""

    def __init__(self, settings: Settings, postprocessors: Sequence[Postprocessor] = ()) -> None:
        self.settings = settings
        self.postprocessors = list(postprocessors)

    def build_many(self, states: list[TrajectoryState], prebuilt: Sequence[Trajectory] = ()) -> list[Trajectory]:
        """Build the trajectories of finished states; run postprocessors (token2text) on
        them and on ``prebuilt`` ones, then build messages where there are none."""
        converter = Converter(self.settings.max_value_chars, self.settings.redact_keys)
        out: list[Trajectory] = list(prebuilt)
        for state in states:
            try:
                out.append(self.build(state, converter))
            except Exception:
                _stats.incr("trajectories_build_failed")
                _stats.warn_once("build", "rtrace could not build a trajectory; it is dropped", exc_info=True)
        for post in self.postprocessors:
            try:
                post(out)
            except Exception:
                _stats.incr("postprocess_errors")
                _stats.warn_once(f"post-{post!r}", "rtrace postprocessor %r failed", post, exc_info=True)
        for traj in out:
            if traj.messages:
                continue
            try:
                traj.messages = build_messages(traj)
            except Exception:
                _stats.incr("messages_errors")
                _stats.warn_once("messages", "rtrace could not build messages", exc_info=True)
        for name, n in (("values_truncated", converter.truncated), ("values_redacted", converter.redacted),
                        ("capture_errors", converter.errors)):
            if n:
                _stats.incr(name, n)
        return out

    # ------------------------------------------------------------------ one trajectory
    def build(self, state: TrajectoryState, conv: Converter) -> Trajectory:
        captures = state.captures
        records = [self._span(span, captures.get(span.context.span_id), conv) for span in state.spans]
        root_id = _hex_span(state.root_span_id)
        if not any(r.span_id == root_id for r in records):
            # The root never ended (orphan timeout / shutdown): stand in for it.
            end = max((r.end_ns for r in records), default=state.created_ns)
            records.append(SpanRecord(span_id=root_id, parent_id=None, name=state.name, kind=state.kind,
                                       start_ns=state.created_ns, end_ns=max(end, state.created_ns),
                                       status="unset", attributes={"rtrace.partial": True}))
        spans = _tree_order(records, root_id)
        root = spans[0]
        if root.kind == "span":  # a rollout_context root has no call record
            root.kind = state.kind
        root.parent_id = None  # a root opened inside an application span links to it instead

        coords = {k: conv(v) for k, v in state.coords.items() if k != "extra"}
        extra = {str(k): conv(v) for k, v in (state.coords.get("extra") or {}).items()}
        coords.setdefault("validate", False)
        coords["validate"] = bool(coords["validate"])
        if self.settings.experiment is not None:
            coords.setdefault("experiment", self.settings.experiment)
        reward = self._reward(state)
        outcome = {str(k): conv(v) for k, v in state.outcome.items()}

        stamp = {f"rl.{k}": v for k, v in coords.items() if k in RL_FIELDS and _attr_ok(v)}
        stamp.update({f"rl.extra.{k}": v for k, v in extra.items() if _attr_ok(v)})
        for span in spans:
            span.attributes.update(stamp)
        if reward is not None:
            root.attributes["rl.reward"] = reward
        root.attributes.update({f"rl.outcome.{k}": v for k, v in outcome.items() if _attr_ok(v)})

        return Trajectory(
            trace_id=format(state.trace_id, "032x"), name=root.name, spans=spans,
            step=coords.get("step"), sample_index=coords.get("sample_index"),
            rollout_n=coords.get("rollout_n"), validate=coords["validate"],
            experiment=coords.get("experiment"), group_id=coords.get("group_id"),
            policy_version=coords.get("policy_version"), extra=extra, reward=reward, outcome=outcome,
            status="error" if root.status == "error" else "ok", error=root.error,
            partial=state.partial, dropped_spans=state.dropped_spans)

    def _reward(self, state: TrajectoryState) -> float | None:
        if not state.has_reward or state.reward is None:
            return None
        value = unsnap(state.reward)
        try:
            reward = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            _stats.incr("reward_errors")
            _stats.warn_once("reward", "rtrace: a reward is not a number (%r); recorded as outcome reward_raw",
                             type(value).__name__)
            state.outcome["reward_raw"] = repr(value)[:200]
            return None
        if not math.isfinite(reward):
            _stats.incr("rewards_non_finite")
        return reward

    def _span(self, span: Any, rec: CallRecord | None, conv: Converter) -> SpanRecord:
        ctx = span.context
        parent = span.parent
        status = span.status
        attrs = {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()}
        out = SpanRecord(
            span_id=_hex_span(ctx.span_id),
            parent_id=_hex_span(parent.span_id) if parent is not None and parent.trace_id == ctx.trace_id else None,
            name=span.name,
            kind=rec.spec.kind if rec is not None else "span",
            start_ns=span.start_time or 0,
            end_ns=span.end_time or span.start_time or 0,
            status="error" if status.status_code is StatusCode.ERROR else "ok",
            error=status.description if status.status_code is StatusCode.ERROR else None,
            attributes=attrs,
            events=[{"name": e.name, "time_ns": e.timestamp,
                     "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (e.attributes or {}).items()}}
                    for e in span.events],
        )
        if rec is not None and rec.args is not None:
            self._captured(out, rec, conv)
        return out

    def _captured(self, out: SpanRecord, rec: CallRecord, conv: Converter) -> None:
        spec = rec.spec
        args, names = rec.args or (), spec.param_names
        if spec.skip_first:
            args, names = args[1:], names[1:]
        inputs = {names[i] if i < len(names) else f"arg{i}": value for i, value in enumerate(args)}
        inputs.update(rec.kwargs or {})
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

    @staticmethod
    def _generation(out: SpanRecord, inputs: dict[str, Any], has_output: bool, output: Any,
                    opts: dict[str, Any]) -> tuple[bool, Any]:
        """Fill prompt_ids / response_ids and the GenAI attributes of a generation span.

        Removes the id lists from ``inputs`` and returns ``(has_output, output)`` without
        them (an output that is the id list itself leaves no output)."""
        attrs = out.attributes
        attrs["gen_ai.operation.name"] = "chat"
        model = opts.get("model") or unsnap(inputs.get("model"))
        if isinstance(model, str):
            attrs["gen_ai.request.model"] = model
        prompt_field = opts.get("prompt_field", "prompt_ids")
        out.prompt_ids = as_id_list(inputs.get(prompt_field))
        if out.prompt_ids is not None:
            del inputs[prompt_field]
            attrs["gen_ai.usage.input_tokens"] = len(out.prompt_ids)
        ids = as_id_list(output)
        if ids is not None:
            has_output, output = False, None
        elif output is not None:
            id_keys = (opts.get("response_field", "response_ids"), "token_ids", "output_ids")
            ids = as_id_list(_field(output, *id_keys))
            if ids is not None and isinstance(output, dict):
                output = {k: v for k, v in output.items() if k not in id_keys}
        out.response_ids = ids
        if ids is not None:
            attrs["gen_ai.usage.output_tokens"] = len(ids)
        finish = _field(output, "finish_reason", "stop_reason") if output is not None else None
        if isinstance(finish, str):
            attrs["gen_ai.response.finish_reasons"] = [finish]
        return has_output, output


def _attr_ok(value: Any) -> bool:
    """OTel attribute values: primitives, or homogeneous lists of primitives."""
    if isinstance(value, (str, bool, int, float)):
        return True
    return isinstance(value, list) and all(isinstance(v, (str, bool, int, float)) for v in value)


def _tree_order(records: list[SpanRecord], root_id: str) -> list[SpanRecord]:
    """Root first, then depth first with siblings by start time. Spans whose parent is
    missing (dropped or never ended) are placed under the root."""
    by_id = {r.span_id: r for r in records}
    children: dict[str, list[SpanRecord]] = {}
    for r in records:
        if r.span_id == root_id:
            continue
        parent = r.parent_id if r.parent_id in by_id else root_id
        children.setdefault(parent, []).append(r)
    ordered: list[SpanRecord] = []
    stack = [by_id[root_id]]
    while stack:
        node = stack.pop()
        ordered.append(node)
        kids = sorted(children.get(node.span_id, ()), key=lambda s: (s.start_ns, s.end_ns))
        stack.extend(reversed(kids))
    return ordered
