"""The OpenAI Responses API (``POST /v1/responses``), as the gateway records a call to it.

The OpenAI Agents SDK's default model calls the Responses API; vLLM serves it. A call is
recorded as a chat generation (docs/gateway.md, "The Responses API"):

* :func:`chat_messages`: the request's ``instructions`` and ``input`` items as chat messages
  (``system``, ``user`` / ``assistant`` with their ``tool_calls``, ``tool``), recorded beside
  the request as its ``messages``, so that the conversation, the health checks and the GenAI
  messages read it as they read a chat call;
* :func:`read_response`: the answer (``output`` items: messages, function calls, reasoning)
  as the assistant message the client got, its finish reason (from ``status``), usage and
  token ids: vLLM returns them with ``enable_response_messages`` (the gateway asks, as it
  asks ``return_token_ids`` of chat): ``input_messages`` / ``output_messages``, each one
  ``{"message", "tokens", "type": "raw_message_tokens"}`` for a model without vLLM's harmony
  format (gpt-oss answers messages without tokens: no ids, a ``not_returned`` gap);
* :func:`read_event`: a streamed answer, event by event: text and reasoning deltas and
  finished function calls as they come (what a stream cut short leaves), the whole answer
  from its final event (``response.completed``, ``.incomplete``, ``.failed``).

No per-token logprobs: vLLM gives them only on an answer's text part (none when the answer
is a tool call), so they would not line up with the token ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_messages", "read_response", "read_event", "FINAL_EVENTS"]

#: The events whose ``response`` is the whole answer.
FINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))
#: ``incomplete_details.reason`` -> the chat API's finish reason
_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any) -> Any:
    """A Responses message's content as chat content: a string as it is; parts that are all
    text joined; other parts kept as chat parts (``{"type": "text", "text"}``, the rest as given)."""
    if not isinstance(content, list):
        return content
    parts = [p for p in content if isinstance(p, dict)]
    if all(p.get("type") in _TEXT_PARTS for p in parts):
        return "".join(str(p.get("text") or "") for p in parts)
    return [{"type": "text", "text": p.get("text") or ""} if p.get("type") in _TEXT_PARTS else p for p in parts]


def _call(item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call (``id`` is its ``call_id``, which the
    ``function_call_output`` that answers it names)."""
    return {"id": item.get("call_id") or item.get("id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}


def _reasoning(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or ()
    return "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))


def chat_messages(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's conversation as chat messages: ``instructions`` as the system message,
    then each ``input`` item (a string input is one user message); a model's message and the
    function calls after it are one assistant message; a reasoning item goes on the next
    assistant message; items of other types (built-in tools' calls) are left out. None when
    there is no conversation to read."""
    out: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    items = payload.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return out or None
    reasoning = ""
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or ("message" if "role" in item else None)
        last = out[-1] if out else None
        if kind == "message":
            message: dict[str, Any] = {"role": item.get("role") or "user", "content": _text(item.get("content"))}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            if last is None or last.get("role") != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
                out.append(last)
            last.setdefault("tool_calls", []).append(_call(item))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            reasoning += _reasoning(item)
    return out or None


def _ids(messages: Any) -> list[int] | None:
    """The token ids of vLLM's ``input_messages`` / ``output_messages``: one raw message with its
    tokens (more than one: several model turns inside one call, not one prompt and completion)."""
    if isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], dict):
        tokens = messages[0].get("tokens")
        if isinstance(tokens, list):
            return tokens
    return None


def read_response(cap: Any, resp: dict[str, Any]) -> None:
    """Read a whole Responses answer into ``cap`` (a :class:`~rtrace.gateway.protocol.Capture`):
    what was assembled from a stream's events before is replaced by it."""
    if resp.get("model") is not None:
        cap.model = resp["model"]
    if resp.get("id") is not None:
        cap.response_id = resp["id"]
    usage = resp.get("usage")
    if isinstance(usage, dict):
        cap.usage = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    prompt, response = _ids(resp.get("input_messages")), _ids(resp.get("output_messages"))
    if prompt is not None:
        cap.prompt_ids = prompt
    if response is not None:
        cap.response_ids = response
    text: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for item in resp.get("output") or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict):
                    if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                        text.append(part["text"])
                    elif part.get("type") == "refusal":
                        cap.refusal = part.get("refusal")
        elif kind == "function_call":
            calls[len(calls)] = _call(item)
        elif kind == "reasoning":
            reasoning.append(_reasoning(item))
    cap.text, cap.reasoning, cap.tool_calls = text, [r for r in reasoning if r], calls
    cap.choices = 1
    status = resp.get("status")
    if status == "completed":
        cap.finish_reason = "tool_calls" if calls else "stop"
    elif status == "incomplete":
        details = resp.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        cap.finish_reason = _INCOMPLETE.get(reason, reason or "incomplete")
    elif isinstance(status, str):
        cap.finish_reason = status
    cap.done = status in ("completed", "incomplete")


def read_event(cap: Any, data: dict[str, Any]) -> None:
    """Read one streamed event into ``cap`` (``cap.at``: when it came)."""
    kind = data.get("type")
    if kind in FINAL_EVENTS:
        resp = data.get("response")
        if isinstance(resp, dict):
            read_response(cap, resp)
        cap.done = kind != "response.failed"
        return
    if kind in ("response.created", "response.in_progress"):
        resp = data.get("response")
        if isinstance(resp, dict) and cap.model is None:
            cap.model, cap.response_id = resp.get("model"), resp.get("id")
        return
    delta = data.get("delta")
    if kind == "response.output_text.delta" and isinstance(delta, str):
        cap.text.append(delta)
    elif kind == "response.reasoning_text.delta" and isinstance(delta, str):
        cap.reasoning.append(delta)
    elif kind == "response.output_item.done":
        item = data.get("item")
        if isinstance(item, dict) and item.get("type") == "function_call":
            cap.tool_calls[len(cap.tool_calls)] = _call(item)
        return
    elif kind != "response.function_call_arguments.delta":
        return
    if cap.first_token_ns is None:
        cap.first_token_ns = cap.at
