"""The conversation of a trajectory, in chat format, from what its spans captured.

Sources, best first:

1. chat messages: the last generation whose input has a ``messages`` argument (a list of
   ``{"role": ..., "content": ...}`` dicts) gives the conversation so far; its response
   and the tool calls after it are appended;
2. text: the first generation's prompt (``rtrace.prompt_text`` from token2text, else a
   string ``prompt``/``text`` argument) as the user turn, then, in start order, each
   generation's response as an assistant turn and each tool span as a ``tool_calls``
   entry on the preceding assistant turn plus a ``tool`` message with its result;
3. nothing readable: an empty list.

A turn whose text is unknown is never an empty string when something is there: a
prompt or a response with token ids but no decoded text reads
``[16 tokens, not decoded: set RTRACE_TOKEN2TEXT]`` (:func:`placeholder`), so every
sink shows what the turn holds and how to see its text.

Each generation span whose response is an assistant message of the conversation gets
the attribute ``rtrace.message_index`` (:data:`MESSAGE_INDEX`): that message's position
in ``Trajectory.messages``, so a sink can show a generation's output as the assistant
turn it produced, tool calls included.

Trajectories of ``rtrace.log_rollout_batch`` (root attribute ``rtrace.source`` =
``tensor_batch``) are rebuilt from their segments instead (:func:`segment_messages`).

Tool messages carry ``tool_call_id`` (the captured ``tool_call_id``/``call_id``, else
``call_<span id>``) and ``name``; the assistant's ``tool_calls`` use the OpenAI shape
``{"id", "type": "function", "function": {"name", "arguments"}}`` with arguments as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from ..trajectory import MESSAGE_INDEX, SpanRecord, Trajectory, response_text

__all__ = ["build_messages", "segment_messages", "response_text", "tool_call_id", "placeholder", "MESSAGE_INDEX"]

#: Root attribute ``rtrace.source`` of trajectories made by ``rtrace.log_rollout_batch``.
BATCH_SOURCE = "tensor_batch"
#: On a span of such a trajectory: the chat role of its segment ("user", "assistant", "tool").
ROLE_ATTR = "rtrace.role"


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


def _prompt_text(span: SpanRecord) -> str | None:
    text = span.attributes.get("rtrace.prompt_text")
    if isinstance(text, str):
        return text
    if isinstance(span.input, dict):
        for key in ("prompt", "text", "query", "question"):
            if isinstance(span.input.get(key), str):
                return span.input[key]
    return None


def tool_call_id(span: SpanRecord) -> str:
    """The tool call id of a tool span: the captured one, else derived from the span id."""
    call_id = span.attributes.get("gen_ai.tool.call.id")
    return str(call_id) if call_id is not None else f"call_{span.span_id[:8]}"


def _tool_messages(span: SpanRecord) -> tuple[dict[str, Any], dict[str, Any]]:
    name = span.attributes.get("gen_ai.tool.name") or span.name
    call_id = tool_call_id(span)
    args = span.input if span.input is not None else {}
    if isinstance(args, dict):  # the call id is the message's id, not a tool argument
        args = {k: v for k, v in args.items() if k not in ("tool_call_id", "call_id")}
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False, default=str)}}
    if span.status == "error":
        content = f"error: {span.error}"
    elif isinstance(span.output, str):
        content = span.output
    else:
        content = json.dumps(span.output, ensure_ascii=False, default=str)
    return call, {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _chat_messages(span: SpanRecord) -> list[dict[str, Any]] | None:
    if not isinstance(span.input, dict):
        return None
    msgs = span.input.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs):
        return [dict(m) for m in msgs]
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
    """Generations before the one whose chat messages open the conversation produced the
    assistant turns of that chat, in order: link them when the counts agree."""
    turns = [i for i, m in enumerate(chat) if m.get("role") == "assistant"]
    if len(turns) == len(gens):
        for span, i in zip(gens, turns):
            span.attributes[MESSAGE_INDEX] = i


def build_messages(traj: Trajectory, token2text: bool = False) -> list[dict[str, Any]]:
    """The trajectory's conversation (see the module docstring for the sources).

    Args:
        token2text: whether token2text was on, for the placeholder of undecoded turns.
    """
    if traj.spans and traj.root.attributes.get("rtrace.source") == BATCH_SOURCE:
        return segment_messages(traj, token2text)
    events = [s for s in traj.spans if s.kind in ("generation", "tool")]
    events.sort(key=lambda s: s.start_ns)
    gens = [s for s in events if s.kind == "generation"]
    if not gens:
        return []
    messages: list[dict[str, Any]] = []
    start = 0
    for i in range(len(events) - 1, -1, -1):
        chat = _chat_messages(events[i]) if events[i].kind == "generation" else None
        if chat is not None:
            messages, start = chat, i
            _index_chat([s for s in events[:i] if s.kind == "generation"], chat)
            break
    else:
        prompt = _prompt_text(gens[0])
        if prompt is None and gens[0].prompt_ids is not None:
            prompt = placeholder(len(gens[0].prompt_ids), token2text)
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
    last_assistant: dict[str, Any] | None = None
    for span in events[start:]:
        if span.kind == "generation":
            last_assistant = {"role": "assistant", "content": _response(span, token2text)}
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
