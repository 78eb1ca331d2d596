"""The conversation of a trajectory, in chat format, from what its spans captured.

Sources, best first:

1. chat messages: the last span (any kind but tool) whose input has a conversation (an
   argument ``messages``, ``raw_prompt``, ``prompt`` or ``conversation`` that is a list of
   ``{"role": ..., ...}`` dicts: :data:`CHAT_KEYS`) gives the conversation so far; the
   generations and tool calls that start after it are appended. An op with chat messages
   and no generation traced in or after it (an API call rtrace does not see) adds its
   own output as the assistant turn when it reads as one (an assistant message, a string,
   or a dict with ``response_text`` / ``answer`` / ``content`` / ``text``), as veRL's
   trackio backend does;
2. text: the first generation's prompt (``rtrace.prompt_text`` from token2text, else a
   string ``prompt``/``text`` argument) as the user turn, then, in start order, each
   generation's response as an assistant turn and each tool span as a ``tool_calls``
   entry on the preceding assistant turn plus a ``tool`` message with its result;
3. nothing readable: an empty list.

Trajectories of ``rtrace.log_rollout_batch`` (root attribute ``rtrace.source`` =
``tensor_batch``) are rebuilt from their segments instead (:func:`segment_messages`).

Tool calls. The one place that reads a tool span's captured values is here:
:func:`tool_arguments` (the call's arguments) and :func:`tool_result` (its answer, step
reward, metrics, done flag, call id) — the builder uses the same function for the tool
span's ``rl.tool.*`` attributes. Tool messages carry ``tool_call_id`` (the captured
``tool_call_id``/``call_id``, or the one of an OpenAI tool message returned, else
``call_<span id>``) and ``name``; the assistant's ``tool_calls`` use the OpenAI shape
``{"id", "type": "function", "function": {"name", "arguments"}}`` with arguments as JSON.

A turn whose text is unknown is never an empty string when something is there: a
prompt or a response with token ids but no decoded text reads
``[16 tokens, not decoded: set RTRACE_TOKEN2TEXT]`` (:func:`placeholder`), so every
sink shows what the turn holds and how to see its text.

Each generation span whose response is an assistant message of the conversation gets
the attribute ``rtrace.message_index`` (:data:`~rtrace.trajectory.MESSAGE_INDEX`): that
message's position in ``Trajectory.messages``, so a sink can show a generation's output
as the assistant turn it produced, tool calls included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._serialize import json_text
from ..trajectory import (CHAT_KEYS, MESSAGE_INDEX, SpanRecord, Trajectory, chat_argument, response_text,
                          tool_call_id)

__all__ = ["build_messages", "segment_messages", "response_text", "tool_call_id", "tool_arguments",
           "tool_result", "ToolResult", "CHAT_KEYS", "placeholder"]

#: Root attribute ``rtrace.source`` of trajectories made by ``rtrace.log_rollout_batch``.
BATCH_SOURCE = "tensor_batch"
#: On a span of such a trajectory: the chat role of its segment ("user", "assistant", "tool").
ROLE_ATTR = "rtrace.role"

#: Input arguments holding a tool call's own arguments (veRL's ``BaseTool.execute(instance_id,
#: parameters, **kwargs)``); without one, the arguments are the whole input but the call id.
ARGUMENT_KEYS = ("arguments", "parameters", "tool_args", "tool_input")
#: Inputs that name the call, not its arguments.
CALL_ID_KEYS = ("tool_call_id", "call_id")
#: Keys of a returned dict holding the tool's answer, first present wins.
CONTENT_KEYS = ("content", "text", "output", "observation", "result", "response")
#: Keys of a returned dict holding the tool's metrics.
METRIC_KEYS = ("metrics", "info", "metadata")
#: Media keys of a returned dict: each item shows as ``[image]`` / ``[video]`` / ``[audio]``.
MEDIA_KEYS = (("image", "[image]"), ("images", "[image]"), ("video", "[video]"), ("videos", "[video]"),
              ("audio", "[audio]"))


#: The keys a returned dict may have besides its answer for the answer alone to be shown.
_KNOWN_KEYS = frozenset(CONTENT_KEYS + METRIC_KEYS + tuple(k for k, _ in MEDIA_KEYS) + (
    "reward", "done", "terminated", "truncated", "role", "tool_call_id", "name", "type", "error", "is_error",
    "status"))


@dataclass
class ToolResult:
    """What a tool call returned, read out of the span's (JSON-safe) output by :func:`tool_result`."""

    #: the tool message's text
    content: str
    #: a step reward returned with the answer (veRL's triple, gym-style tuples, a ``reward`` key)
    reward: float | None = None
    #: metrics / info returned with the answer
    metrics: dict[str, Any] | None = None
    #: the episode ended (gym-style ``done`` / ``terminated`` / ``truncated``)
    done: bool | None = None
    #: the call id of an OpenAI-style tool message returned by the tool
    call_id: str | None = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_json = json_text


def _text(value: Any) -> str:
    """The text of a content value: a string, OpenAI content parts, or JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and value and all(isinstance(p, dict) and "type" in p for p in value):
        parts = []
        for part in value:  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
            kind = str(part.get("type"))
            if isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind.startswith(("image", "video", "audio")):
                parts.append(f"[{kind.split('_')[0]}]")
        return " ".join(parts)
    return _json(value)


def _media(output: dict[str, Any]) -> list[str]:
    markers: list[str] = []
    for key, marker in MEDIA_KEYS:
        value = output.get(key)
        if value is None or value == []:
            continue
        markers.extend([marker] * (len(value) if isinstance(value, list) else 1))
    return markers


def _dict_result(output: dict[str, Any]) -> ToolResult:
    observations = output.get("observations")
    if isinstance(observations, list) and all(isinstance(m, dict) for m in observations):
        # SkyRL-Gym's BaseTextEnvStepOutput: observations (chat messages), reward, done, metadata
        content = "\n".join(_text(m.get("content")) for m in observations)
    else:
        key = next((k for k in CONTENT_KEYS if k in output), None)
        if (key is None and not _media(output)) or not output.keys() <= _KNOWN_KEYS:
            # not an answer with its companions (``{"result": 5, "unit": "C"}``): the whole dict
            content = _json(output)
        else:
            text = _text(output.get(key)) if key is not None else ""
            content = " ".join(t for t in (text, *_media(output)) if t)
    reward = output.get("reward")
    done = next((output[k] for k in ("done", "terminated") if isinstance(output.get(k), bool)), None)
    metrics = next((output[k] for k in METRIC_KEYS if isinstance(output.get(k), dict)), None)
    call_id = output.get("tool_call_id") if output.get("role") == "tool" else None
    return ToolResult(content, float(reward) if _number(reward) else None, metrics, done,
                      str(call_id) if isinstance(call_id, (str, int)) else None)


def _tuple_result(output: list[Any]) -> ToolResult | None:
    """``(answer, reward, ...)`` as veRL ``(ToolResponse, reward, metrics)`` and gym-style
    ``(obs, reward, done, info)`` / ``(obs, reward, terminated, truncated, info)`` tuples
    (lists once captured): an answer (str, dict or None), a number, then up to two
    flags and an optional dict. Anything else is not such a tuple."""
    if not 2 <= len(output) <= 5 or not isinstance(output[0], (str, dict, type(None))) or not _number(output[1]):
        return None
    rest = output[2:]
    flags = []
    while rest and isinstance(rest[0], bool):
        flags.append(rest.pop(0))
    if len(flags) > 2 or len(rest) > 1 or (rest and not isinstance(rest[0], (dict, type(None)))):
        return None
    answer = tool_result(output[0])
    metrics = rest[0] if rest and rest[0] is not None else answer.metrics
    return ToolResult(answer.content, float(output[1]), metrics, any(flags) if flags else answer.done,
                      answer.call_id)


def tool_result(output: Any) -> ToolResult:
    """A tool call's answer from its captured (JSON-safe) return value.

    Shapes read, besides a plain string (the answer itself):

    * veRL ``(ToolResponse(text, image, video), reward, metrics)``: the text, plus one
      ``[image]`` / ``[video]`` marker per item; the reward; the metrics;
    * gym-style ``(obs, reward, done, info)`` and ``(obs, reward, terminated, truncated,
      info)`` tuples (AReaL / SkyRL environments' ``step``);
    * SkyRL-Gym's ``{"observations": [messages], "reward", "done", "metadata"}``;
    * an OpenAI tool message ``{"role": "tool", "content", "tool_call_id"}``;
    * a dict with the answer under ``content`` / ``text`` / ``output`` / ``observation`` /
      ``result`` / ``response`` (and ``reward``, ``done``, ``metrics`` / ``info`` /
      ``metadata`` next to it).

    Anything else is shown as its JSON text.
    """
    if isinstance(output, str):
        return ToolResult(output)
    if isinstance(output, dict):
        return _dict_result(output)
    if isinstance(output, list):
        shaped = _tuple_result(output)
        if shaped is not None:
            return shaped
    return ToolResult(_json(output))


def tool_arguments(inputs: Any) -> Any:
    """A tool call's arguments from its captured input: the ``arguments`` / ``parameters``
    / ``tool_args`` / ``tool_input`` argument when there is one (veRL's
    ``execute(instance_id, parameters, **kwargs)``: the parameters, not the instance id
    nor the agent state), else every argument but the call id."""
    if not isinstance(inputs, dict):
        return {} if inputs is None else inputs
    for key in ARGUMENT_KEYS if not inputs.keys().isdisjoint(ARGUMENT_KEYS) else ():
        value = inputs.get(key)
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                return parsed
    return {k: v for k, v in inputs.items() if k not in CALL_ID_KEYS}


def placeholder(n_tokens: int | None, token2text: bool) -> str:
    """The content of a turn without text: what is there, and how to see its text."""
    if n_tokens is None:
        return "[no text captured]"
    why = ("token2text has no tokenizer or could not decode, see rtrace.stats()" if token2text
           else "set RTRACE_TOKEN2TEXT")
    return f"[{n_tokens} tokens, not decoded: {why}]"


def _n_tokens(span: SpanRecord, ids: list[int] | None, usage_key: str) -> int | None:
    if ids is not None:
        return len(ids)
    n = span.attributes.get(usage_key)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _response(span: SpanRecord, token2text: bool) -> str:
    text = response_text(span)
    if text is not None:
        return text
    return placeholder(_n_tokens(span, span.response_ids, "gen_ai.usage.output_tokens"), token2text)


_PROMPT_KEYS = ("prompt", "text", "query", "question")


def _prompt_text(span: SpanRecord) -> str | None:
    text = span.attributes.get("rtrace.prompt_text")
    if isinstance(text, str):
        return text
    if isinstance(span.input, dict) and not span.input.keys().isdisjoint(_PROMPT_KEYS):
        for key in _PROMPT_KEYS:
            if isinstance(span.input.get(key), str):
                return span.input[key]
    return None




def _tool_messages(span: SpanRecord) -> tuple[dict[str, Any], dict[str, Any]]:
    name = span.attributes.get("gen_ai.tool.name") or span.name
    call_id = tool_call_id(span)
    args = tool_arguments(span.input)
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _json(args)}}
    output = span.output
    content = (f"error: {span.error}" if span.status == "error" else output if type(output) is str
               else tool_result(output).content)
    return call, {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _generated(span: SpanRecord, token2text: bool, own_calls: bool = True) -> dict[str, Any]:
    """The assistant turn a generation produced: its text and, with ``own_calls``, the tool
    calls it returned already parsed (an OpenAI message's ``tool_calls``: the capture
    gateway's calls, whose tools the agent ran without a span of theirs)."""
    output = span.output
    calls = output.get("tool_calls") if own_calls and type(output) is dict else None
    if isinstance(calls, list) and calls:
        text = response_text(span)
        return {"role": "assistant", "content": text if text is not None else "", "tool_calls": list(calls)}
    return {"role": "assistant", "content": _response(span, token2text)}


def _chat_messages(span: SpanRecord) -> list[dict[str, Any]] | None:
    chat = chat_argument(span.input)
    return [dict(m) for m in chat[1]] if chat is not None else None


def _assistant_output(output: Any) -> dict[str, Any] | None:
    """An op's output as the assistant turn, when it reads as one."""
    if isinstance(output, str):
        return {"role": "assistant", "content": output}
    if isinstance(output, dict):
        if output.get("role") == "assistant":
            reply = dict(output)
            if isinstance(reply.get("tool_calls"), list):
                reply["tool_calls"] = list(reply["tool_calls"])  # tool spans after it append here
            return reply
        for key in ("response_text", "answer", "content", "text"):  # veRL's trackio: response_text, answer
            if isinstance(output.get(key), str) and output[key]:
                return {"role": "assistant", "content": output[key]}
    return None


def _segment_text(text: Any, ids: list[int] | None, token2text: bool) -> str:
    if isinstance(text, str):
        return text
    return placeholder(len(ids), token2text) if ids else ""


def segment_messages(traj: Trajectory, token2text: bool = False) -> list[dict[str, Any]]:
    """The conversation of a tensor-batch trajectory, from its segments.

    Each non-root span is one segment of the sample's token sequence, in order; its
    role is the ``rtrace.role`` attribute. The first generation's prompt is the user
    turn. A segment with no decoded text (token2text off, or no tokenizer) reads as a
    :func:`placeholder` (empty when it holds no token ids), so the roles are there in
    order either way.
    """
    messages: list[dict[str, Any]] = []
    for span in traj.spans[1:]:
        if span.kind == "generation" and not messages:
            text = _segment_text(span.attributes.get("rtrace.prompt_text"), span.prompt_ids, token2text)
            messages.append({"role": "user", "content": text})
        role = span.attributes.get(ROLE_ATTR) or ("assistant" if span.kind == "generation" else "tool")
        if span.kind == "generation" and role == "assistant":
            span.attributes[MESSAGE_INDEX] = len(messages)
        text = _segment_text(span.attributes.get("rtrace.response_text"), span.response_ids, token2text)
        messages.append({"role": role, "content": text})
    return messages


def _index_chat(gens: list[SpanRecord], chat: list[dict[str, Any]]) -> None:
    """Generations before the op whose chat messages open the conversation produced the
    assistant turns of that chat, in order: link them when the counts agree."""
    turns = [i for i, m in enumerate(chat) if m.get("role") == "assistant"]
    if gens and len(turns) == len(gens):
        for span, i in zip(gens, turns):
            span.attributes[MESSAGE_INDEX] = i


#: Written by token2text on a generation whose prompt holds text inserted after the previous turn.
INSERTED_TEXT = "rtrace.inserted_text"
_ROLES = ("user", "tool", "system", "ipython", "observation", "human")


def _inserted_message(text: str) -> dict[str, Any]:
    """The message a loop inserted between two turns (decoded without special tokens): its
    chat template's role lines (``user`` first, ``assistant`` last, as ChatML and Llama-3 leave
    them) give the role and are left out."""
    lines = text.strip().split("\n")
    role = "user"
    if lines and lines[0].strip().lower() in _ROLES:
        role = lines.pop(0).strip().lower()
        role = "tool" if role in ("tool", "ipython", "observation") else "user" if role == "human" else role
    if lines and lines[-1].strip().lower() == "assistant":
        lines.pop()
    return {"role": role, "content": "\n".join(lines).strip()}


def _start_ns(span: SpanRecord) -> int:
    return span.start_ns


def build_messages(traj: Trajectory, token2text: bool = False) -> list[dict[str, Any]]:
    """The trajectory's conversation (see the module docstring for the sources).

    Args:
        token2text: whether token2text was on, for the placeholder of undecoded turns.
    """
    if traj.spans and traj.root.attributes.get("rtrace.source") == BATCH_SOURCE:
        return segment_messages(traj, token2text)
    # start order; a parent before the children that start with it (the sort is stable:
    # ties keep the tree order)
    spans = sorted(traj.spans, key=_start_ns)
    # one pass: the generations and tool calls, and the last op (any kind but tool) with
    # chat messages, which opens the conversation
    events: list[int] = []
    first, found, gen = 0, None, None
    for i, span in enumerate(spans):
        kind = span.kind
        if kind == "tool":
            events.append(i)
            continue
        if kind == "generation":
            events.append(i)
            if gen is None:
                gen = span
        if span.input is not None and (chat_found := chat_argument(span.input)) is not None:
            first, found = i, chat_found
    chat = [dict(m) for m in found[1]] if found is not None else None
    chats = chat is not None
    if not chats and gen is None:
        return []
    messages: list[dict[str, Any]] = []
    last_assistant: dict[str, Any] | None = None
    if chat is not None:
        source = spans[first]
        messages = chat
        _index_chat([spans[i] for i in events if i < first and spans[i].kind == "generation"], messages)
        if source.kind != "generation" and not any(spans[i].kind == "generation" for i in events if i > first):
            # no generation traced in or after the op (an API call rtrace does not see): its
            # own output is the assistant's reply
            reply = _assistant_output(source.output) if source.status != "error" else None
            if reply is not None:
                messages.append(reply)
                last_assistant = reply
    else:
        prompt = _prompt_text(gen)
        if prompt is None and gen.prompt_ids is not None:
            prompt = placeholder(len(gen.prompt_ids), token2text)
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
    for n, i in enumerate(events):
        if i < first:
            continue
        span = spans[i]
        if span.kind == "generation":
            inserted = span.attributes.get(INSERTED_TEXT)
            if isinstance(inserted, str) and not chats:
                messages.append(_inserted_message(inserted))
            # its own parsed tool calls, unless traced tool spans follow (they add the calls)
            ran = n + 1 < len(events) and spans[events[n + 1]].kind == "tool"
            last_assistant = _generated(span, token2text, not ran)
            span.attributes[MESSAGE_INDEX] = len(messages)
            messages.append(last_assistant)
        else:
            call, result = _tool_messages(span)
            if last_assistant is None:
                last_assistant = {"role": "assistant", "content": ""}
                messages.append(last_assistant)
            last_assistant.setdefault("tool_calls", []).append(call)
            messages.append(result)
    return messages
