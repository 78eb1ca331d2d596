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

Trajectories of ``rtrace.log_rollout_batch`` (root attribute ``rtrace.source`` =
``tensor_batch``) are rebuilt from their segments instead (:func:`segment_messages`).

Tool messages carry ``tool_call_id`` (the captured ``tool_call_id``/``call_id``, else
``call_<span id>``) and ``name``; the assistant's ``tool_calls`` use the OpenAI shape
``{"id", "type": "function", "function": {"name", "arguments"}}`` with arguments as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from ..trajectory import SpanRecord, Trajectory, response_text

__all__ = ["build_messages", "segment_messages", "response_text", "tool_call_id"]

#: Root attribute ``rtrace.source`` of trajectories made by ``rtrace.log_rollout_batch``.
BATCH_SOURCE = "tensor_batch"
#: On a span of such a trajectory: the chat role of its segment ("user", "assistant", "tool").
ROLE_ATTR = "rtrace.role"


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


def segment_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The conversation of a tensor-batch trajectory, from its segments.

    Each non-root span is one segment of the sample's token sequence, in order; its
    role is the ``rtrace.role`` attribute. The first generation's prompt is the user
    turn. A segment with no decoded text (token2text off, or no tokenizer) has empty
    content, so the roles are there in order either way.
    """
    messages: list[dict[str, Any]] = []
    for span in traj.spans[1:]:
        if span.kind == "generation" and not messages:
            prompt = span.attributes.get("rtrace.prompt_text")
            messages.append({"role": "user", "content": prompt if isinstance(prompt, str) else ""})
        role = span.attributes.get(ROLE_ATTR) or ("assistant" if span.kind == "generation" else "tool")
        text = span.attributes.get("rtrace.response_text")
        messages.append({"role": role, "content": text if isinstance(text, str) else ""})
    return messages


def build_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The trajectory's conversation (see the module docstring for the sources)."""
    if traj.spans and traj.root.attributes.get("rtrace.source") == BATCH_SOURCE:
        return segment_messages(traj)
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
            break
    else:
        prompt = _prompt_text(gens[0])
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
    last_assistant: dict[str, Any] | None = None
    for span in events[start:]:
        if span.kind == "generation":
            last_assistant = {"role": "assistant", "content": response_text(span) or ""}
            messages.append(last_assistant)
        else:
            call, result = _tool_messages(span)
            if last_assistant is None:
                last_assistant = {"role": "assistant", "content": ""}
                messages.append(last_assistant)
            last_assistant.setdefault("tool_calls", []).append(call)
            messages.append(result)
    return messages
