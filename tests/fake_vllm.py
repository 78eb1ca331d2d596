"""An OpenAI-compatible server built to vLLM's response schema, for the gateway's quick tests.

The I/O boundary of the gateway is an HTTP server; this is one, served for real on
127.0.0.1 by uvicorn on a thread, answering as vLLM 0.32 does (shapes checked against the
real server in tests/gateway): ``prompt_token_ids`` at the top of a chat answer and
``token_ids`` per choice when ``return_token_ids`` is asked (``null`` when not), per-token
``logprobs`` when asked, SSE chunks one per token, the first carrying the prompt ids,
``data: [DONE]`` at the end; ``/v1/completions`` with the ids per choice; ``/v1/responses`` (the
Responses API) with vLLM's ``input_messages`` / ``output_messages`` (the prompt's and the answer's
tokens) when ``enable_response_messages`` is asked, streamed as typed events (``event:`` lines)
that end with ``response.completed``.

Its "model" is a script, so tests know what it answers: a chat request with tools and no
tool result yet gets a ``calculator`` tool call on the numbers of the last user message;
otherwise the answer is ``The answer is <sum>.``. Token ids are the UTF-8 bytes + 10.

Knobs (attributes of :class:`FakeVLLM`): ``version`` (answered as SGLang's
``metadata.weight_version``), ``token_ids`` (False: a server without vLLM's ids, such as a
hosted API, which ignores the field), ``delay_s`` (before answering), ``fail`` (an HTTP
status to answer with an OpenAI error), ``cut_after`` (a stream closed after that many
chunks), ``chunk_delay_s`` (between streamed chunks), ``done_delay_s`` (before a stream's
``data: [DONE]``), ``tail_delay_s`` (after it, before the body ends: the last HTTP chunk comes
later), ``owned_by`` (its ``/v1/models``' owner: ``vllm``). ``requests`` keeps every request's
path, headers and body (``model_list_requests``: those of ``/v1/models``).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-policy"


def encode(text: str) -> list[int]:
    return [b + 10 for b in text.encode()]


def render(messages: list[dict[str, Any]]) -> str:
    """The fake chat template."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            content += f"<tool_call>{call['function']['name']}({call['function']['arguments']})</tool_call>"
        out.append(f"<{m['role']}>{content}")
    return "".join(out) + "<assistant>"


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


class FakeVLLM:
    """The fake server (see the module docstring); ``url`` is its OpenAI base URL."""

    def __init__(self) -> None:
        self.version: Any = None
        self.token_ids = True
        self.delay_s = 0.0
        self.fail: int | None = None
        self.cut_after: int | None = None
        self.chunk_delay_s = 0.0
        self.done_delay_s = 0.0
        self.tail_delay_s = 0.0
        #: what its /v1/models says owns the model (vLLM 0.32: "vllm")
        self.owned_by = "vllm"
        self.requests: list[dict[str, Any]] = []
        self.model_list_requests: list[dict[str, Any]] = []
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])
        self.url = ""
        self._server: Any = None

    # ------------------------------------------------------------------ serving
    def start(self) -> "FakeVLLM":
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                     access_log=False, lifespan="off"))
        self._server.install_signal_handlers = lambda: None
        thread = threading.Thread(target=self._server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake vLLM did not start"
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self._thread = thread
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def reset(self) -> None:
        self.version, self.token_ids, self.delay_s, self.fail, self.cut_after = None, True, 0.0, None, None
        self.chunk_delay_s = self.done_delay_s = self.tail_delay_s = 0.0
        self.owned_by = "vllm"
        self.requests.clear()
        self.model_list_requests.clear()

    # ------------------------------------------------------------------ the "model"
    @staticmethod
    def reply(messages: list[dict[str, Any]], tools: Any) -> tuple[str | None, list[dict[str, Any]], str]:
        """``(content, tool_calls, sampled text)`` for a chat request."""
        user = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
        results = [m for m in messages if m["role"] == "tool"]
        nums = numbers(user)
        if tools and not results:
            args = json.dumps({"expression": " + ".join(map(str, nums or [0]))})
            call = {"id": f"call_{len(messages)}", "type": "function",
                    "function": {"name": "calculator", "arguments": args}}
            return None, [call], f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'
        total = sum(numbers(results[-1]["content"] or "")) if results else sum(nums)
        text = f"The answer is {total}."
        return text, [], text

    def _meta(self, data: dict[str, Any]) -> None:
        if self.version is not None:
            data["metadata"] = {"weight_version": self.version}

    @staticmethod
    def _logprobs(ids: list[int]) -> list[float]:
        return [-0.125 * (i % 7) - 0.0625 for i in range(len(ids))]

    async def _common(self, request: Request) -> tuple[dict[str, Any], Response | None]:
        body = json.loads(await request.body())
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body,
                              "client": request.client})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            return body, JSONResponse({"error": {"message": f"fake failure {self.fail}", "type": "BadRequestError",
                                                 "param": None, "code": self.fail}}, status_code=self.fail)
        return body, None

    async def chat(self, request: Request) -> Response:
        body, failed = await self._common(request)
        if failed is not None:
            return failed
        ids_asked = bool(body.get("return_token_ids")) and self.token_ids
        lp_asked = bool(body.get("logprobs"))
        content, calls, sampled = self.reply(body["messages"], body.get("tools"))
        prompt_ids, ids = encode(render(body["messages"])), encode(sampled)
        finish = "tool_calls" if calls else "stop"
        if body.get("stream"):
            return StreamingResponse(self._chat_stream(body, content, calls, sampled, prompt_ids, ids, finish,
                                                       ids_asked, lp_asked), media_type="text/event-stream")
        lps = self._logprobs(ids)
        data = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None,
                                                     "tool_calls": calls, "reasoning": None},
                             "logprobs": {"content": [{"token": chr(i - 10), "logprob": lp, "bytes": [i - 10],
                                                       "top_logprobs": []} for i, lp in zip(ids, lps)]}
                             if lp_asked else None,
                             "finish_reason": finish, "stop_reason": None,
                             "token_ids": ids if ids_asked else None}],
                "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(ids),
                          "completion_tokens": len(ids)},
                "prompt_token_ids": prompt_ids if ids_asked else None}
        for i in range(1, int(body.get("n") or 1)):  # n > 1: the same answer again (a fake has one)
            data["choices"].append({**data["choices"][0], "index": i})
        self._meta(data)
        return JSONResponse(data)

    async def _chat_stream(self, body: dict[str, Any], content: str | None, calls: list[dict[str, Any]],
                           sampled: str, prompt_ids: list[int], ids: list[int], finish: str, ids_asked: bool,
                           lp_asked: bool) -> Any:
        def chunk(choice: dict[str, Any], **top: Any) -> bytes:
            data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                    "choices": [choice], **top}
            self._meta(data)
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}, prompt_token_ids=prompt_ids if ids_asked else None)
        lps = self._logprobs(ids)
        # the text as the client sees it: the content, or the tool call's name then its arguments
        pieces: list[dict[str, Any]] = []
        if calls:
            fn = calls[0]["function"]
            pieces.append({"content": None, "tool_calls": [{"id": calls[0]["id"], "type": "function", "index": 0,
                                                            "function": {"name": fn["name"]}}]})
            args = fn["arguments"]
            step = max(1, len(args) // 4)
            pieces += [{"content": None, "tool_calls": [{"index": 0, "function": {"arguments": args[i:i + step]}}]}
                       for i in range(0, len(args), step)]
        else:
            pieces += [{"content": c} for c in content]
        sent = 0
        n = max(len(ids), len(pieces))
        for i in range(n):
            if self.cut_after is not None and sent >= self.cut_after:
                raise RuntimeError("the fake vLLM cuts the stream")  # uvicorn closes the connection
            delta = pieces[i] if i < len(pieces) else {}
            if not delta and not (ids_asked or lp_asked):
                continue  # vLLM sends a chunk without text only to carry ids or logprobs
            tok = ids[i: i + 1] if i < len(ids) else []
            choice = {"index": 0, "delta": delta,
                      "logprobs": {"content": [{"token": chr(t - 10), "logprob": lps[i], "bytes": [t - 10],
                                                "top_logprobs": []} for t in tok]} if lp_asked else None,
                      "finish_reason": None, "token_ids": tok if ids_asked else None}
            yield chunk(choice)
            sent += 1
            await asyncio.sleep(self.chunk_delay_s)
        yield chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                     "token_ids": [] if ids_asked else None})
        async for part in self._done():
            yield part

    async def _done(self) -> Any:
        """A stream's end: ``data: [DONE]``, then the end of the body (each after its delay)."""
        await asyncio.sleep(self.done_delay_s)
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(self.tail_delay_s)

    @staticmethod
    def completion(prompt: str) -> str:
        """The text a completions request gets: the sum of the prompt's numbers, then the prompt's
        characters beyond ASCII (each several tokens: bytes)."""
        return f" {sum(numbers(prompt))}" + "".join(c for c in prompt if not c.isascii())

    async def completions(self, request: Request) -> Response:
        body, failed = await self._common(request)
        if failed is not None:
            return failed
        ids_asked = bool(body.get("return_token_ids")) and self.token_ids
        lp_asked = body.get("logprobs") is not None
        text = self.completion(str(body["prompt"]))
        prompt_ids, ids = encode(str(body["prompt"])), encode(text)
        lps = self._logprobs(ids)
        if body.get("stream"):
            async def stream() -> Any:
                # one event per token (a byte), as vLLM sends one per token whatever is asked: a token that
                # ends mid-character has no text yet
                decoder = codecs.getincrementaldecoder("utf-8")()
                for i, t in enumerate(ids):
                    piece = decoder.decode(bytes([t - 10]))
                    data = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": body["model"],
                            "choices": [{"index": 0, "text": piece, "finish_reason": "stop" if i == len(ids) - 1
                                         else None,
                                         "logprobs": {"tokens": [piece], "token_logprobs": [lps[i]],
                                                      "top_logprobs": None, "text_offset": [i]} if lp_asked else None,
                                         "prompt_token_ids": prompt_ids if ids_asked and i == 0 else None,
                                         "token_ids": [t] if ids_asked else None}]}
                    self._meta(data)
                    yield b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
                async for part in self._done():
                    yield part

            return StreamingResponse(stream(), media_type="text/event-stream")
        data = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": "stop",
                             "logprobs": {"tokens": list(text), "token_logprobs": lps, "top_logprobs": None,
                                          "text_offset": list(range(len(text)))} if lp_asked else None,
                             "prompt_token_ids": prompt_ids if ids_asked else None,
                             "token_ids": ids if ids_asked else None}],
                "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(ids),
                          "completion_tokens": len(ids)}}
        self._meta(data)
        return JSONResponse(data)

    # ------------------------------------------------------------------ the Responses API
    @staticmethod
    def responses_input(body: dict[str, Any]) -> list[dict[str, Any]]:
        """A Responses request's conversation as the chat messages the fake's template renders
        (vLLM renders the items through the model's chat template the same way)."""
        messages: list[dict[str, Any]] = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                content = item["content"]
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content)
                messages.append({"role": item["role"], "content": content})
            elif kind == "function_call":
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        return messages

    async def responses(self, request: Request) -> Response:
        body, failed = await self._common(request)
        if failed is not None:
            return failed
        messages = self.responses_input(body)
        content, calls, sampled = self.reply(messages, body.get("tools"))
        prompt, prompt_ids, ids = render(messages), encode(render(messages)), encode(sampled)
        if calls:
            fn = calls[0]["function"]
            items = [{"id": "fc_fake", "type": "function_call", "call_id": calls[0]["id"], "name": fn["name"],
                      "arguments": fn["arguments"], "status": "completed"}]
        else:
            items = [{"id": "msg_fake", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": None}]}]
        asked = bool(body.get("enable_response_messages")) and self.token_ids
        done = {"id": "resp_fake", "object": "response", "created_at": 1, "model": body["model"],
                "instructions": body.get("instructions"), "status": "completed", "incomplete_details": None,
                "output": items, "tools": body.get("tools") or [], "tool_choice": "auto",
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)},
                "input_messages": [{"message": prompt, "tokens": prompt_ids, "type": "raw_message_tokens"}]
                if asked else None,
                "output_messages": [{"message": sampled, "tokens": ids, "type": "raw_message_tokens"}]
                if asked else None}
        self._meta(done)
        if not body.get("stream"):
            return JSONResponse(done)

        async def stream() -> Any:
            seq = 0

            def event(kind: str, **data: Any) -> bytes:
                nonlocal seq
                seq += 1
                return f"event: {kind}\ndata: ".encode() + json.dumps(
                    {"type": kind, "sequence_number": seq - 1, **data}, separators=(",", ":")).encode() + b"\n\n"

            start = {**done, "status": "in_progress", "output": [], "usage": None, "input_messages": None,
                     "output_messages": None}
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            item = items[0]
            if calls:
                yield event("response.output_item.added", output_index=0, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
                args = item["arguments"]
                step = max(1, len(args) // 4)
                for i in range(0, len(args), step):
                    if self.cut_after is not None and i // step >= self.cut_after:
                        raise RuntimeError("the fake vLLM cuts the stream")
                    yield event("response.function_call_arguments.delta", output_index=0, item_id=item["id"],
                                delta=args[i:i + step])
                    await asyncio.sleep(self.chunk_delay_s)
                yield event("response.function_call_arguments.done", output_index=0, item_id=item["id"],
                            arguments=args, name=item["name"])
            else:
                yield event("response.output_item.added", output_index=0,
                            item={**item, "content": [], "status": "in_progress"})
                yield event("response.content_part.added", output_index=0, item_id=item["id"], content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                for i, c in enumerate(content):
                    if self.cut_after is not None and i >= self.cut_after:
                        raise RuntimeError("the fake vLLM cuts the stream")
                    yield event("response.output_text.delta", output_index=0, item_id=item["id"], content_index=0,
                                delta=c, logprobs=[])
                    await asyncio.sleep(self.chunk_delay_s)
                yield event("response.output_text.done", output_index=0, item_id=item["id"], content_index=0,
                            text=content, logprobs=[])
                yield event("response.content_part.done", output_index=0, item_id=item["id"], content_index=0,
                            part=item["content"][0])
            yield event("response.output_item.done", output_index=0, item=item)
            await asyncio.sleep(self.done_delay_s)
            yield event("response.completed", response=done)
            await asyncio.sleep(self.tail_delay_s)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        # kept apart from the model calls: the gateway asks it what it is when it starts (identify)
        self.model_list_requests.append({"path": request.url.path, "headers": dict(request.headers)})
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.owned_by}]})
