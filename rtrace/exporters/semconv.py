"""The OpenTelemetry GenAI conventions on rtrace's exported spans (docs/semconv.md).

:mod:`rtrace.exporters.otel`, the one conversion of trajectories to OTel spans, calls
this module for what the GenAI conventions (``open-telemetry/semantic-conventions-genai``,
status Development) say a span of an agent run carries, so the OTLP sink, the
collector's output and the MLflow sink all speak them:

* **span names**: a ``rollout`` / ``agent`` span is ``invoke_agent {name}``, a generation
  ``chat {gen_ai.request.model}`` (``chat`` without a model), a tool call
  ``execute_tool {gen_ai.tool.name}``; every other span keeps its name;
* **span kind**: ``CLIENT`` for a generation the capture gateway recorded (a call to a model
  server over HTTP), ``INTERNAL`` for every other span (:func:`span_kind`, in every mode);
* **attributes**: ``gen_ai.operation.name``, ``gen_ai.provider.name`` (what the generation
  recorded, else ``RTRACE_GENAI_PROVIDER``; on ``invoke_agent`` the root's own, else the one
  its generations agree on, else the setting), ``gen_ai.agent.name``,
  ``gen_ai.conversation.id`` (the trajectory: its trace id), ``gen_ai.input.messages`` /
  ``gen_ai.output.messages`` (JSON text of the conventions' message schema: role and typed
  parts ``text``, ``tool_call``, ``tool_call_response``, ``reasoning``),
  ``gen_ai.tool.call.id`` / ``.arguments`` / ``.result``, ``gen_ai.response.id`` /
  ``gen_ai.response.model`` and request parameters where the captured call shows them,
  ``error.type`` on a failed GenAI span;
* **events**: the trajectory's reward terms as ``gen_ai.evaluation.result`` span events
  on the root (the total with the verdict as its label, then each numeric or boolean
  outcome component), a tool's step reward as one on the tool span.

The messages come from the conversation the pipeline built (``Trajectory.messages``),
each message encoded once per trajectory: a generation's input is a prefix of it, so a
trajectory of N turns costs N encodings, not N²/2.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

from .._serialize import json_default, plain_json, strict_json
from ..trajectory import (MESSAGE_INDEX, SpanRecord, Trajectory, chat_argument, response_text,
                          tool_call_id)

__all__ = ["MODES", "EVALUATION_EVENT", "PROVIDER", "span_name", "span_kind", "genai_attributes",
           "evaluation_events", "message_parts", "encode_message", "Conversation", "DUPLICATES", "input_messages",
           "INPUT_CHARS_FACTOR"]

#: ``RTRACE_SEMCONV``: GenAI names next to rtrace's, GenAI names only, rtrace's only.
MODES = ("both", "genai", "rtrace")

#: The event a reward term becomes (``gen_ai.evaluation.result``).
EVALUATION_EVENT = "gen_ai.evaluation.result"

#: Which provider (engine, service) served a model call: required on ``chat`` and ``invoke_agent``.
PROVIDER = "gen_ai.provider.name"

#: The attribute the capture gateway puts on each call it records (rtrace/gateway/recorder.py).
_GATEWAY_CALL = "rtrace.gateway.join"

#: rtrace's copies of what the GenAI attributes carry, left out in ``genai`` mode (by span
#: kind): the captured call and decoded text (the messages, the tool call's arguments and
#: result), and ``rtrace.kind`` (``gen_ai.operation.name``).
DUPLICATES = {
    "generation": ("rtrace.input", "rtrace.output", "rtrace.prompt_text", "rtrace.response_text",
                   MESSAGE_INDEX, "rtrace.kind"),
    "tool": ("rtrace.input", "rtrace.output", "rtrace.kind"),
    "rollout": ("rtrace.kind",),
    "agent": ("rtrace.kind",),
}

#: ``gen_ai.input.messages`` keeps the task and the latest messages within this many times
#: ``max_value_chars`` characters (the conventions let instrumentations truncate input).
INPUT_CHARS_FACTOR = 10

_AGENT_KINDS = ("rollout", "agent")
#: Captured generation arguments -> GenAI request attributes.
_REQUEST_PARAMS = (("temperature", "gen_ai.request.temperature", float),
                   ("top_p", "gen_ai.request.top_p", float),
                   ("top_k", "gen_ai.request.top_k", float),
                   ("max_tokens", "gen_ai.request.max_tokens", int),
                   ("max_new_tokens", "gen_ai.request.max_tokens", int),
                   ("seed", "gen_ai.request.seed", int))
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _json(value: Any) -> str:
    """Compact JSON text: orjson when it takes the value (the parts this module builds are
    plain dicts, lists and strings; a NaN inside tool arguments is written as null), else
    the json module (non-finite floats as strings)."""
    data = plain_json(value)
    if data is not None:
        return data.decode()
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=json_default)
    except ValueError:
        return json.dumps(strict_json(value), ensure_ascii=False, allow_nan=False, default=json_default)


# ----------------------------------------------------------------------------- messages
def _content_text(content: Any) -> str:
    """A message's content as text: a string; OpenAI content parts joined (media as
    ``[image]`` markers: one text part renders in every backend); anything else as JSON."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        out = []
        for part in content:
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = str(part.get("type") or "part")
                out.append(f"[{kind.split('_')[0]}]")
        return " ".join(out)
    return _json(content)


#: ``json.loads`` without its Python-level wrapping (a third of its time on a short text):
#: the C scanner, then the same checks (whitespace around, nothing after the value).
_scan_json = json.JSONDecoder().scan_once


def _arguments(raw: Any) -> Any:
    """Tool call arguments as an object when they are JSON text of one (the conventions
    expect an object and ask for a best-effort parse; what ``json.loads`` reads), else as
    given."""
    if isinstance(raw, str):
        text = raw.strip(" \t\n\r")  # JSON's whitespace, no other
        try:
            value, end = _scan_json(text, 0)
        except (StopIteration, ValueError):  # not JSON (StopIteration: nothing at 0)
            return raw
        return value if end == len(text) else raw
    return raw


def _tool_call_part(call: Any) -> dict[str, Any] | None:
    if not isinstance(call, dict):
        return None
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str):
        return None
    part: dict[str, Any] = {"type": "tool_call", "id": str(call["id"]) if call.get("id") is not None else None,
                            "name": name}
    if fn.get("arguments") is not None:
        part["arguments"] = _arguments(fn["arguments"])
    return part


def message_parts(msg: Any) -> dict[str, Any]:
    """One chat message (OpenAI shape: role, content, tool_calls, tool_call_id, name) in
    the GenAI message schema: ``{"role", "parts": [...], "name"?}``.

    A ``tool`` message is one ``tool_call_response`` part (``id``, ``response``); otherwise
    a ``reasoning`` part (``reasoning_content`` / ``reasoning``, or an assistant text's
    leading ``<think>...</think>``), a ``text`` part, and one ``tool_call`` part per call.
    A message with nothing else gets an empty text part (``parts`` is never empty).
    """
    if not isinstance(msg, dict):
        return {"role": "user", "parts": [{"type": "text", "content": _content_text(msg)}]}
    role = msg.get("role")
    role = role if isinstance(role, str) else "user"
    parts: list[dict[str, Any]] = []
    if role == "tool":
        call_id = msg.get("tool_call_id")
        parts.append({"type": "tool_call_response", "id": str(call_id) if call_id is not None else None,
                      "response": _content_text(msg.get("content"))})
    else:
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "content": reasoning})
        text = _content_text(msg.get("content"))
        if role == "assistant" and text.startswith(_THINK_OPEN) and _THINK_CLOSE in text:
            thought, _, text = text[len(_THINK_OPEN):].partition(_THINK_CLOSE)
            parts.append({"type": "reasoning", "content": thought.strip()})
            text = text.lstrip()
        calls = [p for p in map(_tool_call_part, msg.get("tool_calls") or ()) if p is not None]
        if text or not (calls or parts):
            parts.append({"type": "text", "content": text})
        parts.extend(calls)
    out: dict[str, Any] = {"role": role, "parts": parts}
    if isinstance(msg.get("name"), str) and role != "tool":
        out["name"] = msg["name"]
    return out


def encode_message(msg: Any) -> str:
    """One chat message as JSON text of the GenAI message schema (:func:`message_parts`).

    The usual messages take a shorter road to the same text: ``{"role", "content"}`` with
    text content (a system prompt, a question, an answer without tool calls or leading
    ``<think>``), and a tool's answer ``{"role": "tool", "tool_call_id", "content"[, "name"]}``.
    """
    if type(msg) is dict:
        role, content = msg.get("role"), msg.get("content")
        if type(role) is str and type(content) is str:
            size = len(msg)
            if size == 2 and role != "tool" and not (role == "assistant" and content.startswith(_THINK_OPEN)):
                return _json({"role": role, "parts": [{"type": "text", "content": content}]})
            if role == "tool" and (size == 3 or size == 4 and "name" in msg) and "tool_call_id" in msg:
                call_id = msg["tool_call_id"]
                return _json({"role": role, "parts": [{"type": "tool_call_response",
                                                        "id": str(call_id) if call_id is not None else None,
                                                        "response": content}]})
    return _json(message_parts(msg))


def input_messages(encoded: list[str], task: int, limit: int) -> str:
    """The JSON array of already-encoded messages, bounded: when it is longer than
    ``limit`` characters, the first ``task`` messages (system prompt and question) and the
    latest ones that fit are kept, in order."""
    total = sum(map(len, encoded)) + len(encoded) + 1
    if total <= limit or len(encoded) <= task + 1:
        return "[" + ",".join(encoded) + "]"
    head = encoded[:task]
    room = limit - sum(map(len, head)) - len(head) - 1
    tail: list[str] = []
    for text in reversed(encoded[task:]):
        if room - len(text) - 1 < 0 and tail:
            break
        tail.append(text)
        room -= len(text) + 1
    return "[" + ",".join(head + tail[::-1]) + "]"


class Conversation:
    """A trajectory's conversation, each message encoded once (GenAI schema, JSON text), and
    its provider (``provider``: the configured one, ``RTRACE_GENAI_PROVIDER``)."""

    __slots__ = ("traj", "limit", "provider", "_agent_provider", "_encoded", "_calls", "_task", "_prefixes")

    def __init__(self, traj: Trajectory, limit: int, provider: str | None = None) -> None:
        self.traj = traj
        self.limit = limit
        self.provider = provider
        self._agent_provider: Any = False  # not looked for yet
        self._encoded: list[str | None] = [None] * len(traj.messages)
        self._calls: dict[str, tuple[Any, str | None]] | None = None
        self._task: int | None = None
        #: end -> prefix(end): the root and the first generation share the task
        self._prefixes: dict[int, str] = {}

    def generation_provider(self) -> str | None:
        """``gen_ai.provider.name`` of a generation that recorded none: the root's, else the setting."""
        root = self.traj.spans[0].attributes.get(PROVIDER) if self.traj.spans else None
        return root if isinstance(root, str) and root else self.provider

    def agent_provider(self) -> str | None:
        """``gen_ai.provider.name`` of an ``invoke_agent`` span that recorded none: the one the
        trajectory's generations recorded when they agree, else the setting."""
        if self._agent_provider is False:
            seen = {s.attributes.get(PROVIDER) for s in self.traj.spans if s.kind == "generation"}
            seen.discard(None)
            one = seen.pop() if len(seen) == 1 else None
            self._agent_provider = one if isinstance(one, str) and one else self.provider
        return self._agent_provider

    def encoded(self, i: int) -> str:
        text = self._encoded[i]
        if text is None:
            text = self._encoded[i] = encode_message(self.traj.messages[i])
        return text

    def prefix(self, end: int) -> str:
        """The JSON array of the first ``end`` messages (bounded, see :func:`input_messages`)."""
        text = self._prefixes.get(end)
        if text is None:
            task = min(self.task_length(), end)
            text = self._prefixes[end] = input_messages([self.encoded(i) for i in range(end)], task, self.limit)
        return text

    def task_length(self) -> int:
        """Messages up to and including the first user message (``Trajectory.task_messages``)."""
        if self._task is None:
            msgs = self.traj.messages
            # (Trajectory.task_messages' rule, without making the list)
            self._task = next((i + 1 for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"),
                              min(len(msgs), 1))
        return self._task

    def last_assistant(self) -> int | None:
        msgs = self.traj.messages
        for i in range(len(msgs) - 1, -1, -1):
            if isinstance(msgs[i], dict) and msgs[i].get("role") == "assistant":
                return i
        return None

    def tool_call(self, call_id: str) -> tuple[Any, str | None] | None:
        """(the call's arguments as the conversation holds them, the tool's answer) for a
        tool call id of the conversation."""
        if self._calls is None:
            calls: dict[str, Any] = {}
            for msg in self.traj.messages:
                if not isinstance(msg, dict):
                    continue
                for call in msg.get("tool_calls") or ():
                    if isinstance(call, dict):
                        key = call.get("id")
                        if key is not None:
                            fn = call.get("function")
                            calls[key if type(key) is str else str(key)] = \
                                (call if not isinstance(fn, dict) else fn).get("arguments"), None
                if msg.get("role") == "tool":
                    key = str(msg.get("tool_call_id"))
                    known = calls.get(key)
                    if known is not None:
                        calls[key] = known[0], _content_text(msg.get("content"))
            self._calls = calls
        return self._calls.get(call_id)


# ----------------------------------------------------------------------------- spans
def span_name(rec: SpanRecord) -> str | None:
    """The GenAI name of a span (``invoke_agent {name}``, ``chat {model}``,
    ``execute_tool {tool}``), or None when the conventions name none for its kind."""
    kind = rec.kind
    if kind in _AGENT_KINDS:
        return f"invoke_agent {rec.name}"
    attrs = rec.attributes
    if kind == "generation":
        model = attrs.get("gen_ai.request.model")
        return f"chat {model}" if isinstance(model, str) and model else "chat"
    if kind == "tool":
        tool = attrs.get("gen_ai.tool.name") or rec.name
        return f"execute_tool {tool}"
    return None


def span_kind(rec: SpanRecord) -> str:
    """The OTel span kind of a span: ``client`` for a generation the capture gateway recorded
    (a call to a model server over HTTP: the GenAI conventions' CLIENT); ``internal`` for the
    rest, a decorated generation included (in the process, or through the trainer's own
    engine: rtrace cannot tell a server call from a model in the process)."""
    return "client" if rec.kind == "generation" and _GATEWAY_CALL in rec.attributes else "internal"


def _error_type(rec: SpanRecord) -> str:
    for event in rec.events:
        if event.get("name") == "exception":
            kind = (event.get("attributes") or {}).get("exception.type")
            if isinstance(kind, str) and kind:
                return kind
    head = (rec.error or "").split(":", 1)[0].strip()
    return head if head and " " not in head else "_OTHER"


def _generation_input(conv: Conversation, rec: SpanRecord, linked: bool) -> str | None:
    """A generation's ``gen_ai.input.messages``: the conversation the call was given; else
    the trajectory's conversation up to the turn it produced (``linked``: the pipeline
    linked it to that turn); else its decoded prompt as one user message."""
    chat = chat_argument(rec.input)
    index = rec.attributes.get(MESSAGE_INDEX)
    if chat is not None:
        if linked and conv.traj.messages[:index] == chat[1]:  # (the usual case) encoded once per trajectory
            return conv.prefix(index)
        encoded = [encode_message(m) for m in chat[1]]
        task = next((i + 1 for i, m in enumerate(chat[1]) if m.get("role") == "user"), 1)
        return input_messages(encoded, task, conv.limit)
    if linked and index > 0:
        return conv.prefix(index)
    prompt = rec.attributes.get("rtrace.prompt_text")
    if isinstance(prompt, str):
        return _json([{"role": "user", "parts": [{"type": "text", "content": prompt}]}])
    return None


def _finish_reason(rec: SpanRecord) -> str | None:
    reasons = rec.attributes.get("gen_ai.response.finish_reasons")
    if isinstance(reasons, (list, tuple)) and reasons and isinstance(reasons[0], str):
        return reasons[0]
    return None


def output_message(encoded: str, finish_reason: str | None) -> str:
    """``gen_ai.output.messages`` of one encoded message, with its ``finish_reason`` when
    known: deprecated in the current schema (``gen_ai.response.finish_reasons`` carries it)
    but required by readers of the earlier one (Phoenix validates output messages against
    it and drops them without it)."""
    if finish_reason is None:
        return "[" + encoded + "]"
    return "[" + encoded[:-1] + ',"finish_reason":' + _json(finish_reason) + "}]"


def _generation_output(conv: Conversation, rec: SpanRecord, linked: bool) -> str | None:
    """A generation's ``gen_ai.output.messages``: the assistant turn it produced (its text
    and the tool calls that followed), else its response text."""
    if linked:
        return output_message(conv.encoded(rec.attributes[MESSAGE_INDEX]), _finish_reason(rec))
    text = response_text(rec)
    if isinstance(text, str):
        return output_message(encode_message({"role": "assistant", "content": text}), _finish_reason(rec))
    return None


#: The captured arguments _REQUEST_PARAMS reads.
_PARAM_NAMES = frozenset(name for name, _, _ in _REQUEST_PARAMS)


def _request_attributes(out: dict[str, Any], rec: SpanRecord) -> None:
    inputs, output = rec.input, rec.output
    if isinstance(inputs, dict) and not inputs.keys().isdisjoint(_PARAM_NAMES):
        for key, attr, cast in _REQUEST_PARAMS:
            value = inputs.get(key)
            if type(value) in (int, float) and attr not in out:
                out[attr] = cast(value)
    if isinstance(output, dict):
        rid = output.get("id", output.get("response_id"))
        if isinstance(rid, str) and rid:
            out["gen_ai.response.id"] = rid
        model = output.get("model")
        if isinstance(model, str) and model:
            out["gen_ai.response.model"] = model


def genai_attributes(conv: Conversation, rec: SpanRecord, is_root: bool) -> dict[str, Any]:
    """The GenAI attributes of one span (module docstring), added to what rtrace writes.

    Values are OTel attribute values: messages, tool arguments and results are JSON text
    (the conventions allow it where structured values are not supported: the OTel Python
    SDK's span attributes are not, and Phoenix reads them only as JSON text).
    """
    traj, kind, attrs = conv.traj, rec.kind, rec.attributes
    out: dict[str, Any] = {}
    if kind in _AGENT_KINDS:
        out["gen_ai.operation.name"] = "invoke_agent"
        if PROVIDER not in attrs:
            provider = conv.agent_provider()
            if provider is not None:
                out[PROVIDER] = provider
        out["gen_ai.agent.name"] = rec.name
        out["gen_ai.conversation.id"] = traj.trace_id
        if is_root and traj.messages:
            out["gen_ai.input.messages"] = conv.prefix(conv.task_length())
            last = conv.last_assistant()
            if last is not None:
                out["gen_ai.output.messages"] = output_message(conv.encoded(last), traj.finish_reason)
    elif kind == "generation":
        out["gen_ai.operation.name"] = "chat"
        if PROVIDER not in attrs:
            provider = conv.generation_provider()
            if provider is not None:
                out[PROVIDER] = provider
        out["gen_ai.conversation.id"] = traj.trace_id
        _request_attributes(out, rec)
        linked = traj.turn_of(rec) is not None
        messages = _generation_input(conv, rec, linked)
        if messages is not None:
            out["gen_ai.input.messages"] = messages
        messages = _generation_output(conv, rec, linked)
        if messages is not None:
            out["gen_ai.output.messages"] = messages
    elif kind == "tool":
        out["gen_ai.operation.name"] = "execute_tool"
        out["gen_ai.tool.name"] = attrs.get("gen_ai.tool.name") or rec.name
        call_id = tool_call_id(rec)
        out["gen_ai.tool.call.id"] = call_id
        known = conv.tool_call(call_id)
        if known is not None:
            args, result = known
        else:
            inputs = rec.input
            args = {k: v for k, v in inputs.items() if k not in ("tool_call_id", "call_id")} \
                if isinstance(inputs, dict) else inputs
            result = rec.output if isinstance(rec.output, str) or rec.output is None else _json(rec.output)
        if args is not None:
            out["gen_ai.tool.call.arguments"] = args if isinstance(args, str) else _json(args)
        if result is not None and rec.status != "error":
            out["gen_ai.tool.call.result"] = result
    else:
        return out
    if rec.status == "error":
        out["error.type"] = _error_type(rec)
    return out


# ----------------------------------------------------------------------------- evaluations
def _evaluation(name: str, value: Any = None, label: str | None = None,
                explanation: str | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.evaluation.name": name}
    if value is not None:
        attrs["gen_ai.evaluation.score.value"] = value
    if label is not None:
        attrs["gen_ai.evaluation.score.label"] = label
    if explanation:
        attrs["gen_ai.evaluation.explanation"] = explanation[:1000]
    return attrs


def _score(value: Any) -> tuple[float | None, str | None] | None:
    """(score.value, score.label) of an outcome component: numbers are scores, booleans
    1.0 / 0.0 labelled ``true`` / ``false``; anything else is not a score."""
    if isinstance(value, bool):
        return (1.0 if value else 0.0), ("true" if value else "false")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value), None
    return None


def reward_terms(traj: Trajectory, verdict: str | None = None) -> Iterable[tuple[str, float | None, str | None]]:
    """(name, score, label) of each reward term: ``reward`` (the total, labelled with the
    verdict, ``verdict`` if given, else ``traj.verdict()``), then each numeric or boolean
    outcome component under its key (``outcome.<key>`` when the key is ``reward`` or
    ``verdict``)."""
    reward = traj.reward
    score = reward if reward is not None and math.isfinite(reward) else None
    yield "reward", score, verdict if verdict is not None else traj.verdict()
    for key, value in traj.outcome.items():
        scored = _score(value)
        if scored is not None:
            yield (f"outcome.{key}" if key in ("reward", "verdict") else str(key)), scored[0], scored[1]


def evaluation_events(traj: Trajectory, rec: SpanRecord, is_root: bool) -> list[tuple[str, dict[str, Any], int]]:
    """The ``gen_ai.evaluation.result`` events of one span, as (name, attributes, time):
    on the root, one per reward term (:func:`reward_terms`), at the root's end; on a tool
    span with a step reward (``rl.tool.reward``), one named ``tool_reward``."""
    if is_root:
        verdict = traj.verdict()
        if traj.reward is None and not traj.outcome and verdict == "ok":
            return []  # nothing was judged
        explanation = traj.error if traj.status == "error" else None
        end = max(rec.end_ns, rec.start_ns)
        return [(EVALUATION_EVENT, _evaluation(name, value, label, explanation if name == "reward" else None), end)
                for name, value, label in reward_terms(traj, verdict)]
    if rec.kind == "tool":
        value = rec.attributes.get("rl.tool.reward")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return [(EVALUATION_EVENT, _evaluation("tool_reward", float(value)), max(rec.end_ns, rec.start_ns))]
    return []
