"""The OpenAI wire format, as the gateway reads and rewrites it (chat completions, completions, and
the Responses API with rtrace/gateway/responses.py).

Three jobs, each a function or a small class, none of them doing I/O:

* :func:`prepare`: the body sent upstream is the client's, plus what the gateway asks on its
  own behalf: vLLM's ``return_token_ids`` (prompt ids as ``prompt_token_ids``, completion ids
  per choice as ``token_ids``) and the sampled tokens' ``logprobs``, each only when the
  client did not ask already (:class:`Asked` says which were added); of the Responses API,
  vLLM's ``enable_response_messages`` (the ids in ``input_messages`` / ``output_messages``);
* :func:`edit` (or :func:`strip` / :func:`strip_chunk` on a parsed answer): what the gateway
  added is taken out of the answer again, so the client sees what the upstream answers it
  without the gateway: the fields become ``null`` as the upstream leaves them when not
  asked, and a streamed chunk that only carried them (vLLM sends one per token once ids or
  logprobs are asked) is dropped. :func:`edit` cuts the values out of the bytes, every other
  byte as the upstream sent it, without parsing the answer into Python objects (msgspec's
  ``Raw`` finds where each value is, ~4x faster than orjson's parse and re-encoding of an
  answer with 128 logprobs);
* :class:`Capture`: what one call returned, from a whole answer (:meth:`Capture.response`)
  or chunk by chunk (:meth:`Capture.chunk`): the text and tool calls the client got, the
  prompt and completion token ids, the sampled tokens' logprobs, the finish reason, usage,
  the upstream's weight version (SGLang's ``metadata.weight_version``, a top-level
  ``weight_version`` / ``model_version``), and when the first token came.

Only the first choice is recorded (``n`` > 1 is a capture gap that says so).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from .responses import FINAL_EVENTS, read_event, read_response

try:  # the gateway extra brings it; the json module reads and writes the same values, slower
    import orjson

    loads = orjson.loads

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)

except ImportError:  # pragma: no cover
    orjson = None
    loads = json.loads

    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


try:  # the gateway extra brings it; without it, edit() says it cannot and answers are re-encoded
    import msgspec

    _TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
    _CHOICES = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
    _DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, msgspec.ValidationError)
except ImportError:  # pragma: no cover
    msgspec = None  # type: ignore[assignment]

__all__ = ["CHAT", "COMPLETIONS", "RESPONSES", "Asked", "prepare", "edit", "strip", "strip_chunk", "chunk_kept",
           "ends_stream", "Capture", "loads", "dumps", "SseSplitter"]

#: The kinds of model call, by route.
CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"


class Asked:
    """What the gateway added to a request on its own behalf (``messages``: the Responses
    API's ``enable_response_messages``)."""

    __slots__ = ("ids", "logprobs", "messages")

    def __init__(self, ids: bool = False, logprobs: bool = False, messages: bool = False) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.messages = messages

    def __bool__(self) -> bool:
        return self.ids or self.logprobs or self.messages


def prepare(payload: dict[str, Any], kind: str, ask_ids: bool, ask_logprobs: bool) -> tuple[dict[str, Any], Asked]:
    """The request body for the upstream and what was added (the client's dict is not changed)."""
    asked = Asked()
    body = payload
    if kind == RESPONSES:  # ids only (responses.py: no logprobs that line up with them)
        if ask_ids and not payload.get("enable_response_messages"):
            body = dict(payload)
            body["enable_response_messages"] = True
            asked.messages = True
        return body, asked
    if ask_ids and not payload.get("return_token_ids"):
        body = dict(payload)
        body["return_token_ids"] = True
        asked.ids = True
    if ask_logprobs:
        given = payload.get("logprobs")
        # chat: a boolean; completions: the number of alternatives (0: the sampled token's only)
        if (kind == CHAT and not given) or (kind == COMPLETIONS and given is None):
            if body is payload:
                body = dict(payload)
            body["logprobs"] = True if kind == CHAT else 0
            asked.logprobs = True
    return body, asked


def strip(data: dict[str, Any], asked: Asked) -> bool:
    """Take what the gateway asked for out of a whole answer (in place); True when a value
    that was there (not null) was taken out."""
    changed = False
    if asked.messages:  # a Responses answer, or a streamed event's (its "response")
        for obj in (data, data.get("response")):
            if type(obj) is dict:
                for key in _MESSAGES:
                    if obj.get(key) is not None:
                        obj[key] = None
                        changed = True
    if asked.ids and data.get("prompt_token_ids") is not None:
        data["prompt_token_ids"] = None
        changed = True
    for choice in data.get("choices") or ():
        if type(choice) is not dict:
            continue
        if asked.ids:
            for key in _IDS:
                if choice.get(key) is not None:
                    choice[key] = None
                    changed = True
        if asked.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


def strip_chunk(data: dict[str, Any], asked: Asked) -> bool:
    """:func:`strip` for a streamed chunk; False when nothing is left for the client
    (:func:`chunk_kept`)."""
    strip(data, asked)
    return chunk_kept(data)


def chunk_kept(data: dict[str, Any]) -> bool:
    """A streamed chunk (stripped already) still carries something for the client: no choices,
    usage, prompt ids, or a choice with a finish reason, a non-empty delta, or token ids / prompt
    ids / logprobs that the client asked for itself (so the gateway left them); and every
    completions chunk (``text``, even empty: vLLM sends one per token whatever is asked, with no
    text for a token that ends mid-character). A chat chunk that only carried what the gateway
    asked for is dropped: vLLM sends one per token once ids or logprobs are asked (a delta it
    would otherwise skip, ``{}``), and the upstream would not have sent it to the client."""
    choices = data.get("choices")
    if not choices or data.get("usage") or data.get("prompt_token_ids") is not None:
        return True
    for choice in choices:
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return True
        if choice.get("token_ids") is not None or choice.get("prompt_token_ids") is not None \
                or choice.get("logprobs") is not None:
            return True
        if "text" in choice:  # completions: sent whatever its text
            return True
        if choice.get("delta"):
            return True
    return False


def ends_stream(data: bytes, one_choice: bool = True) -> bool:
    """A streamed event's ``data`` ends a complete answer: ``[DONE]``; a Responses API event that
    carries the whole answer (``response.completed`` ...); the usage chunk (``choices`` empty, after
    every choice ended); a chunk with a finish reason when the call asked for ``one_choice``. A client
    may close its connection once it has read it (the openai SDK closes on ``[DONE]``)."""
    if data.strip() == b"[DONE]":
        return True
    try:
        obj = loads(data)
    except ValueError:
        return False
    if type(obj) is not dict:
        return False
    if obj.get("type") in FINAL_EVENTS:
        return True
    choices = obj.get("choices")
    if type(choices) is not list:
        return False
    if not choices:
        return bool(obj.get("usage"))
    return one_choice and any(type(c) is dict and c.get("finish_reason") is not None for c in choices)


# ----------------------------------------------------------------------------- edits in the bytes
_WS = frozenset(b" \t\r\n")
_PLAIN_KEY = re.compile(r"[ !#-\[\]-~]*")  # printable ASCII but '"' and '\\': written as it is
_TOKENS: dict[str, bytes] = {}  # key -> its JSON token (b"" when it may be written with escapes)
_FALSY = frozenset((b"null", b"false", b"0", b'""', b"{}", b"[]"))
_IDS = ("token_ids", "prompt_token_ids")
_MESSAGES = ("input_messages", "output_messages")
_COMMA, _COLON, _LBRACE, _RBRACE, _LBRACKET, _RBRACKET = b",:{}[]"


def _past(buf: bytes, i: int, char: int) -> int:
    """The index after ``char`` at ``buf[i:]`` (white space around it skipped); -1 if it is not there."""
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    if i >= n or buf[i] != char:
        return -1
    i += 1
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _token(key: str) -> bytes:
    token = _TOKENS.get(key)
    if token is None:
        token = b'"' + key.encode() + b'"' if _PLAIN_KEY.fullmatch(key) else b""
        if len(_TOKENS) < 4096:
            _TOKENS[key] = token
    return token


def _object(buf: bytes, i: int, items: Any, spans: dict[str, tuple[int, int]]) -> int:
    """Where each value of the object at ``buf[i:]`` is (``spans[key] = (start, end)``), from
    its keys and values as msgspec decoded them (``Raw`` values: their lengths are the
    values' lengths in ``buf``); the index after the object, -1 when ``buf`` does not hold
    them where they must be (a key written with escapes, a repeated key)."""
    i = _past(buf, i, _LBRACE)
    if i < 0:
        return -1
    tokens = _TOKENS
    n = len(buf)
    first = True
    for key, value in items:
        if first:
            first = False
        elif i < n and buf[i] == _COMMA and buf[i + 1] not in _WS:  # compact JSON: no white space
            i += 1
        else:
            i = _past(buf, i, _COMMA)
            if i < 0:
                return -1
        token = tokens.get(key) or _token(key)
        if not token or not buf.startswith(token, i):
            return -1
        i += len(token)
        if i + 1 < n and buf[i] == _COLON and buf[i + 1] not in _WS:
            i += 1
        else:
            i = _past(buf, i, _COLON)
            if i < 0:
                return -1
        end = i + len(value)
        spans[key] = (i, end)
        i = end
    return _past(buf, i, _RBRACE)


def _falsy(buf: bytes, span: tuple[int, int] | None) -> bool:
    """The value at ``span`` is one Python reads as false (absent, null, false, 0, "", {}, [])."""
    if span is None:
        return True
    value = buf[span[0]:span[1]]
    return value in _FALSY or (value[:1] in (b"{", b"[") and len(value) < 16 and b"".join(value.split()) in _FALSY)


def _null(buf: bytes, span: tuple[int, int] | None) -> bool:
    """The value at ``span`` is absent or null (Python's None)."""
    return span is None or buf[span[0]:span[1]] == b"null"


def edit(raw: bytes, asked: Asked, chunk: bool = False) -> tuple[bytes | None, bool]:
    """An answer's JSON (``raw``) without what the gateway asked for, as :func:`strip` (and for
    a streamed ``chunk``, :func:`strip_chunk`) would leave it, edited in the bytes: the
    values become ``null`` and every other byte stays as the upstream sent it.

    Returns:
        ``(edited, keep)``: ``keep`` is False for a chunk with nothing left for the client;
        ``edited`` is None when this cannot say (not a JSON object, a choice that is not
        one, keys written with escapes, msgspec missing): parse and use :func:`strip`.
    """
    if msgspec is None or asked.messages:  # (a Responses answer: parsed, strip())
        return None, True
    try:
        top = _TOP.decode(raw)
        choices_raw = top.get("choices")
        choices = None if choices_raw is None or bytes(choices_raw) == b"null" else _CHOICES.decode(choices_raw)
    except _DECODE_ERRORS:
        return None, True
    spans: dict[str, tuple[int, int]] = {}
    end = _object(raw, 0, top.items(), spans)
    if end != len(raw):  # (_past skipped the white space after it)
        return None, True
    cuts = []
    if asked.ids and "prompt_token_ids" in spans:
        cuts.append(spans["prompt_token_ids"])
    keep = not chunk or not choices or not _falsy(raw, spans.get("usage")) or (
        not asked.ids and not _null(raw, spans.get("prompt_token_ids")))
    if choices:
        start, stop = spans["choices"]
        i = _past(raw, start, _LBRACKET)
        for n, choice in enumerate(choices):
            if n and i >= 0:
                i = _past(raw, i, _COMMA)
            at: dict[str, tuple[int, int]] = {}
            i = -1 if i < 0 else _object(raw, i, choice.items(), at)
            if i < 0:
                return None, True
            if asked.ids:
                cuts += [at[k] for k in _IDS if k in at]
            if asked.logprobs and "logprobs" in at:
                cuts.append(at["logprobs"])
            if not keep:  # chunk_kept's test: a finish reason, what the client asked for, completions, a delta
                if not _null(raw, at.get("finish_reason")):
                    keep = True
                elif not asked.ids and not (_null(raw, at.get("token_ids")) and _null(raw, at.get("prompt_token_ids"))):
                    keep = True  # ids the client asked for itself
                elif not asked.logprobs and not _null(raw, at.get("logprobs")):
                    keep = True
                else:
                    keep = "text" in at or not _falsy(raw, at.get("delta"))
        # (the value's end: _past skipped the white space after its ']', if any)
        if _past(raw, i, _RBRACKET) < 0 or raw.rfind(b"]", i, stop + 1) != stop - 1:
            return None, True
    if not cuts:
        return raw, keep
    cuts.sort()
    out, last = [], 0
    for start, stop in cuts:
        out += (raw[last:start], b"null")
        last = stop
    out.append(raw[last:])
    return b"".join(out), keep


def _version(data: dict[str, Any]) -> Any:
    """The weight version an answer reports, if any."""
    for key in ("weight_version", "model_version"):
        if data.get(key) is not None:
            return data[key]
    meta = data.get("metadata")
    if type(meta) is dict and meta.get("weight_version") is not None:
        return meta["weight_version"]
    return None


def _logprobs(value: Any, kind: str) -> list[float] | None:
    """The sampled tokens' logprobs of one choice's ``logprobs`` object."""
    if type(value) is not dict:
        return None
    try:
        if kind == CHAT:
            content = value.get("content")
            return [e["logprob"] for e in content] if type(content) is list else None
        values = value.get("token_logprobs")
        return list(values) if type(values) is list else None
    except (KeyError, TypeError):  # not the shape vLLM answers: no logprobs recorded
        return None


class Capture:
    """What one model call returned (the first choice), read from the answer."""

    __slots__ = ("kind", "prompt_ids", "response_ids", "logprobs", "text", "reasoning", "tool_calls",
                 "finish_reason", "usage", "model", "response_id", "version", "choices", "role", "first_token_ns",
                 "chunks", "done", "refusal", "at")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.prompt_ids: list[int] | None = None
        self.response_ids: list[int] | None = None
        self.logprobs: list[Any] | None = None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        #: index -> {"id", "type", "function": {"name", "arguments"}} (arguments as parts while streaming)
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.model: Any = None
        self.response_id: Any = None
        self.version: Any = None
        self.choices = 0
        self.role = "assistant"
        self.first_token_ns: int | None = None
        self.chunks = 0
        #: the stream ended with ``data: [DONE]`` (or the whole answer was read)
        self.done = False
        self.refusal: Any = None
        #: when the chunk being read arrived (time.time_ns())
        self.at = 0

    # ------------------------------------------------------------------ whole answers
    def response(self, data: dict[str, Any]) -> None:
        """Read a whole (non-streamed) answer."""
        if self.kind == RESPONSES:
            read_response(self, data)
            self.done = True
            version = _version(data)
            if version is not None:
                self.version = version
            return
        self._top(data)
        choices = data.get("choices")
        if type(choices) is not list or not choices:
            self.done = True
            return
        self.choices = len(choices)
        choice = choices[0]
        if type(choice) is not dict:
            self.done = True
            return
        self.finish_reason = choice.get("finish_reason")
        ids = choice.get("token_ids")
        if type(ids) is list:
            self.response_ids = ids
        if self.prompt_ids is None and type(choice.get("prompt_token_ids")) is list:
            self.prompt_ids = choice["prompt_token_ids"]
        self.logprobs = _logprobs(choice.get("logprobs"), self.kind)
        if self.kind == CHAT:
            message = choice.get("message")
            if type(message) is dict:
                self.role = message.get("role") or "assistant"
                content = message.get("content")
                if content is not None:
                    self.text.append(content if type(content) is str else json.dumps(content))
                reasoning = message.get("reasoning_content", message.get("reasoning"))
                if type(reasoning) is str:
                    self.reasoning.append(reasoning)
                self.refusal = message.get("refusal")
                calls = message.get("tool_calls")
                if type(calls) is list:
                    for i, call in enumerate(calls):
                        if type(call) is dict:
                            self.tool_calls[i] = call
        else:
            text = choice.get("text")
            if type(text) is str:
                self.text.append(text)
        self.done = True

    def _top(self, data: dict[str, Any]) -> None:
        if type(data.get("prompt_token_ids")) is list:
            self.prompt_ids = data["prompt_token_ids"]
        if data.get("usage"):
            self.usage = data["usage"]
        if self.model is None:
            self.model = data.get("model")
            self.response_id = data.get("id")
        version = _version(data)
        if version is not None:
            self.version = version

    # ------------------------------------------------------------------ streams
    def chunk(self, data: dict[str, Any], at: int | None = None) -> None:
        """Read one streamed chunk, which arrived at ``at`` (``time.time_ns()``; default: now)."""
        self.at = at or time.time_ns()
        self.chunks += 1
        if self.kind == RESPONSES:
            read_event(self, data)
            return
        self._top(data)
        choices = data.get("choices")
        if type(choices) is not list:
            return
        for choice in choices:
            if type(choice) is not dict:
                continue
            index = choice.get("index", 0)
            if type(index) is int and index + 1 > self.choices:
                self.choices = index + 1
            if index != 0:
                continue
            ids = choice.get("token_ids")
            if type(ids) is list and ids:
                if self.first_token_ns is None:
                    self.first_token_ns = self.at
                if self.response_ids is None:
                    self.response_ids = []
                self.response_ids += ids
            if self.prompt_ids is None and type(choice.get("prompt_token_ids")) is list:
                self.prompt_ids = choice["prompt_token_ids"]
            lps = _logprobs(choice.get("logprobs"), self.kind)
            if lps:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs += lps
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if self.kind == CHAT:
                delta = choice.get("delta")
                if type(delta) is dict and delta:
                    self._delta(delta)
            else:
                text = choice.get("text")
                if type(text) is str and text:
                    if self.first_token_ns is None:
                        self.first_token_ns = self.at
                    self.text.append(text)

    def _delta(self, delta: dict[str, Any]) -> None:
        if delta.get("role"):
            self.role = delta["role"]
        content = delta.get("content")
        if type(content) is str and content:
            if self.first_token_ns is None:
                self.first_token_ns = self.at
            self.text.append(content)
        reasoning = delta.get("reasoning_content", delta.get("reasoning"))
        if type(reasoning) is str and reasoning:
            if self.first_token_ns is None:
                self.first_token_ns = self.at
            self.reasoning.append(reasoning)
        calls = delta.get("tool_calls")
        if type(calls) is list:
            if self.first_token_ns is None:
                self.first_token_ns = self.at
            for call in calls:
                if type(call) is not dict:
                    continue
                index = call.get("index", 0)
                have = self.tool_calls.get(index)
                if have is None:
                    have = self.tool_calls[index] = {"id": None, "type": "function",
                                                     "function": {"name": None, "arguments": []}}
                if call.get("id"):
                    have["id"] = call["id"]
                if call.get("type"):
                    have["type"] = call["type"]
                fn = call.get("function")
                if type(fn) is dict:
                    if fn.get("name"):
                        have["function"]["name"] = fn["name"]
                    if type(fn.get("arguments")) is str:
                        have["function"]["arguments"].append(fn["arguments"])

    # ------------------------------------------------------------------ the record
    def output(self) -> dict[str, Any]:
        """The generation's output as @traced_generation records one: the reply the client got
        (chat: an assistant message; completions: its text), the finish reason and the
        completion token ids (``response_ids``, read out by the pipeline)."""
        text = "".join(self.text) if self.text else None
        if self.kind != COMPLETIONS:  # chat; the Responses API's answer as the same assistant message
            out: dict[str, Any] = {"role": self.role, "content": text}
            if self.reasoning:
                out["reasoning_content"] = "".join(self.reasoning)
            if self.tool_calls:
                calls = []
                for _, call in sorted(self.tool_calls.items()):
                    fn = call.get("function") if type(call.get("function")) is dict else {}
                    args = fn.get("arguments")
                    calls.append({"id": call.get("id"), "type": call.get("type") or "function",
                                  "function": {"name": fn.get("name"),
                                               "arguments": "".join(args) if type(args) is list else args}})
                out["tool_calls"] = calls
            if self.refusal:
                out["refusal"] = self.refusal
        else:
            out = {"text": text if text is not None else ""}
        out["finish_reason"] = self.finish_reason
        if self.response_ids is not None:
            out["response_ids"] = self.response_ids
            if self.logprobs:  # the pipeline makes them the generation's per-token `logprob` array
                out["logprobs"] = self.logprobs
        return out


class SseSplitter:
    """Server-sent events out of a byte stream: whole events (with their blank line), as
    soon as each is complete; a partial one waits for the rest."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._tail + data if self._tail else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._tail = events.pop()
        return events

    @property
    def pending(self) -> int:
        """The bytes of an event not complete yet."""
        return len(self._tail)

    def rest(self) -> bytes:
        """What is left after the last complete event (an unterminated one)."""
        tail, self._tail = self._tail, b""
        return tail


def event_data(event: bytes) -> bytes | None:
    """The ``data:`` payload of one event (lines joined), None when it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    lines = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None for line in event.split(b"\n")]
    data = [x for x in lines if x is not None]
    return b"\n".join(data) if data else None
