"""The capture gateway (rtrace/gateway, docs/gateway.md) against a server built to vLLM's schema.

The gateway serves for real on 127.0.0.1 (uvicorn on a thread) in front of
``tests/fake_vllm.py``, also a real HTTP server; clients are plain HTTP (httpx). Each test
reads the written trajectories back (rtrace.testing's memory sink, or JSONL) and compares
them with what the upstream answered. tests/gateway runs the same joins against a real
vLLM, with the openai SDK, the OpenAI Agents SDK and LangGraph (``make test-gateway``).
"""

from __future__ import annotations

import json
import logging
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

import rtrace  # noqa: E402
import rtrace.testing  # noqa: E402
from rtrace.gateway import keys  # noqa: E402
from rtrace.gateway import open_session, start_gateway  # noqa: E402
from tests.doubles import MetricsSink  # noqa: E402
from tests.fake_vllm import FakeVLLM, encode, render  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def upstream():
    fake = FakeVLLM().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(upstream):
    upstream.reset()
    return upstream


@pytest.fixture
def gateway(fake):
    """``gateway(**settings)`` starts a gateway in front of the fake upstream (stopped after the test)."""
    made = []

    def start(**settings):
        server = start_gateway(fake.url, **settings)
        made.append(server)
        return server

    yield start
    for server in made:
        server.stop()


@pytest.fixture
def captured():
    with rtrace.testing.capture() as got:
        yield got


def chat(base_url, key=None, messages=QUESTION, tools=TOOLS, headers=None, **body):
    h = dict(headers or {})
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{base_url}/chat/completions", json={"model": "fake-policy", "messages": messages,
                                                              "tools": tools, **body}, headers=h, timeout=30)


def sse(text):
    """The data of each SSE event of a streamed answer, JSON-decoded (``[DONE]`` as is)."""
    out = []
    for event in text.split("\n\n"):
        if event.startswith("data: "):
            data = event[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_until_cut(access, body, error=httpx.HTTPError):
    """A streamed chat call that ``error`` ends before its end: the bytes the client got first."""
    got = b""
    with pytest.raises(error):
        with httpx.stream("POST", f"{access.base_url}/chat/completions", json=body, headers=access.headers,
                          timeout=30) as response:
            for part in response.iter_bytes():
                got += part
    return got


def only(trajectories, kind="generation"):
    return [s for t in trajectories for s in t.spans if s.kind == kind]


class TestKeyJoin:
    def test_a_call_with_the_rollout_key_is_a_generation_span_of_the_rollout(self, captured, gateway, fake):
        """Inside rollout_context, gateway_access()'s key makes the call a child generation span of the
        rollout, with the upstream's ids, the client's text and tool calls, logprobs, usage, coordinates."""
        gw = gateway()
        with rtrace.rollout_context(step=3, sample_index=17, rollout_n=2, group_id="p17") as ro:
            access = rtrace.gateway_access()
            got = chat(access.base_url, access.api_key)
        assert got.status_code == 200
        answer = got.json()
        (traj,) = captured.trajectories
        assert (traj.trace_id, traj.step, traj.sample_index, traj.rollout_n, traj.group_id) == (
            ro.trace_id, 3, 17, 2, "p17")
        (gen,) = only([traj])
        assert gen.parent_id == traj.root.span_id
        assert gen.name == "chat fake-policy"
        assert gen.prompt_ids == encode(render(QUESTION))
        _, calls, sampled = FakeVLLM.reply(QUESTION, TOOLS)
        assert gen.response_ids == encode(sampled)
        message = answer["choices"][0]["message"]
        assert gen.output == {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"],
                              "finish_reason": "tool_calls"}
        assert gen.input["messages"] == QUESTION and gen.input["tools"] == TOOLS
        attrs = gen.attributes
        assert gen.token_values["logprob"].tolist() == pytest.approx(FakeVLLM._logprobs(gen.response_ids))
        assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (
            len(gen.prompt_ids), len(gen.response_ids))
        assert attrs["gen_ai.response.finish_reasons"] == ["tool_calls"]
        assert (attrs["gen_ai.request.model"], attrs["gen_ai.operation.name"], attrs["rl.step"]) == (
            "fake-policy", "chat", 3)
        assert "rtrace.capture_gap" not in attrs and not [f for f in traj.health if f["check"] == "capture_gap"]
        assert gw.gateway.url in access.base_url

    def test_the_client_sees_what_the_upstream_answers_it(self, captured, gateway, fake):
        """The gateway asks for ids and logprobs on its own behalf and takes them out again: the client
        gets the upstream's answer to its own request, streamed chunk for chunk; the rollout key never
        goes upstream, the call's traceparent does."""
        gw = gateway()
        direct = chat(fake.url).json()
        direct_stream = sse(chat(fake.url, stream=True).text)
        fake.requests.clear()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = chat(access.base_url, access.api_key).json()
            via_stream = sse(chat(access.base_url, access.api_key, stream=True).text)
        assert via == direct
        assert via_stream == direct_stream
        sent = fake.requests[0]
        assert sent["body"]["return_token_ids"] is True and sent["body"]["logprobs"] is True
        assert "authorization" not in sent["headers"]
        spans = only(captured.trajectories)
        assert sent["headers"]["traceparent"] == f"00-{'%032x' % int(captured.trajectories[0].trace_id, 16)}-" \
                                                 f"{spans[0].span_id}-01"
        assert gw.gateway.url

    def test_upstream_connections_are_kept_alive(self, captured, gateway, fake):
        """Calls one after another reuse one upstream connection (a new one per call costs a connect)."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            for stream in (False, True, False, True):
                assert chat(access.base_url, access.api_key, stream=stream).status_code == 200
        assert len({r["client"] for r in fake.requests}) == 1

    def test_what_the_client_asked_for_stays(self, captured, gateway, fake):
        """A client that asks for token ids and logprobs itself gets them, as the upstream sent them."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            answer = chat(access.base_url, access.api_key, return_token_ids=True, logprobs=True).json()
        (gen,) = only(captured.trajectories)
        assert answer["prompt_token_ids"] == gen.prompt_ids
        assert answer["choices"][0]["token_ids"] == gen.response_ids
        assert [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]] == \
            pytest.approx(gen.token_values["logprob"].tolist())

    def test_streamed_and_whole_calls_record_the_same(self, captured, gateway, fake):
        """A streamed call is recorded exactly as the same call not streamed (ids, text, tool calls,
        logprobs, finish reason), plus its time to first token."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            for stream in (False, True):
                chat(access.base_url, access.api_key, stream=stream)
                chat(access.base_url, access.api_key, tools=None, stream=stream)
        whole_call, whole_text, stream_call, stream_text = only(captured.trajectories)
        for whole, streamed in ((whole_call, stream_call), (whole_text, stream_text)):
            assert (streamed.prompt_ids, streamed.response_ids, streamed.output) == (
                whole.prompt_ids, whole.response_ids, whole.output)
            for key in ("gen_ai.response.finish_reasons", "gen_ai.usage.output_tokens"):
                assert streamed.attributes[key] == whole.attributes[key]
            assert streamed.token_values["logprob"].tolist() == whole.token_values["logprob"].tolist()
            assert streamed.attributes["rtrace.time_to_first_token_ms"] > 0
            assert "rtrace.time_to_first_token_ms" not in whole.attributes
        assert whole_text.output["content"] == "The answer is 19."

    def test_completions_whole_and_streamed(self, captured, gateway, fake):
        """/v1/completions: ids per choice, text, logprobs; text_completion as the operation."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            for stream in (False, True):
                got = httpx.post(f"{access.base_url}/completions", json={"model": "fake-policy", "prompt": "2 + 40 =",
                                                                          "stream": stream},
                                 headers=access.headers, timeout=30)
                assert got.status_code == 200
        whole, streamed = only(captured.trajectories)
        for gen in (whole, streamed):
            assert gen.prompt_ids == encode("2 + 40 =") and gen.response_ids == encode(" 42")
            assert gen.output == {"text": " 42", "finish_reason": "stop"}
            assert gen.attributes["gen_ai.operation.name"] == "text_completion"
            assert gen.token_values["logprob"].tolist() == pytest.approx(FakeVLLM._logprobs(encode(" 42")))
        assert whole.name == "text_completion fake-policy"

    def test_the_key_in_the_path(self, captured, gateway, fake):
        """An agent that can only be given a base URL: the key in the path (any API key) joins the same."""
        gateway()
        with rtrace.rollout_context(step=5):
            access = rtrace.gateway_access()
            assert chat(access.keyed_base_url, "anything").status_code == 200
        (gen,) = only(captured.trajectories)
        assert gen.attributes["rl.step"] == 5

    def test_a_sampled_out_rollout_goes_through_unrecorded(self, gateway, fake):
        """A rollout the trainer does not record (over max_traces_per_step): its key lets the call through,
        nothing is recorded, and the upstream is not asked for anything extra."""
        with rtrace.testing.capture(max_traces_per_step=0) as got:
            gateway()
            with rtrace.rollout_context(step=1, sample_index=0) as ro:
                assert not ro.traced
                access = rtrace.gateway_access()
                assert not access.traced
                assert chat(access.base_url, access.api_key).status_code == 200
            assert got.trajectories == []
            assert got.stats()["gateway_calls_untraced"] == 1
        assert "return_token_ids" not in fake.requests[0]["body"]

    def test_forged_and_expired_keys_are_refused_and_never_forwarded(self, captured, gateway, fake):
        """A key signed with another secret, a key whose coordinates were changed, an expired key:
        401 with an OpenAI-style error naming why, counted, and nothing reaches the upstream."""
        gw = gateway()
        with rtrace.rollout_context(step=1) as ro:
            tid = int(ro.trace_id, 16)
        forged, _ = keys.mint("another-secret-of-16+chars", tid, 1, True, {"step": 1}, 60)
        good, _ = keys.mint(gw.gateway.secret, tid, 1, True, {"step": 1}, 60)
        body, mac = good[len(keys.PREFIX):].split(".")
        claims = json.loads(keys._unb64(body))
        claims["c"]["step"] = 999
        tampered = keys.PREFIX + keys._b64(json.dumps(claims).encode()) + "." + mac
        expired, _ = keys.mint(gw.gateway.secret, tid, 1, True, {"step": 1}, -1)
        got = {name: chat(f"{gw.url}/v1", key) for name, key in (("forged", forged), ("tampered", tampered),
                                                                  ("expired", expired), ("garbage", "rtk-x.y"))}
        assert {k: (r.status_code, r.json()["error"]["code"]) for k, r in got.items()} == {
            "forged": (401, "key_bad_signature"), "tampered": (401, "key_bad_signature"),
            "expired": (401, "key_expired"), "garbage": (401, "key_malformed")}
        assert got["expired"].json()["error"]["type"] == "authentication_error"
        assert fake.requests == []
        stats = captured.stats()
        assert (stats["gateway_refused.key_bad_signature"], stats["gateway_refused.key_expired"],
                stats["gateway_refused.key_malformed"]) == (2, 1, 1)


def test_gateway_access_needs_a_gateway(monkeypatch):
    """No RTRACE_GATEWAY_URL / _SECRET and no gateway in this process: a ConfigError naming them;
    a bad RTRACE_GATEWAY_KEY_TTL_S names itself."""
    with pytest.raises(rtrace.ConfigError, match="RTRACE_GATEWAY_URL and RTRACE_GATEWAY_SECRET"):
        rtrace.gateway_access()
    monkeypatch.setenv("RTRACE_GATEWAY_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("RTRACE_GATEWAY_SECRET", "s" * 32)
    monkeypatch.setenv("RTRACE_GATEWAY_KEY_TTL_S", "soon")
    with pytest.raises(rtrace.ConfigError, match="RTRACE_GATEWAY_KEY_TTL_S"):
        rtrace.gateway_access()
    monkeypatch.setenv("RTRACE_GATEWAY_KEY_TTL_S", "60")
    access = rtrace.gateway_access()  # outside any trajectory: a key that lets calls through unrecorded
    assert (access.base_url, access.traced) == ("http://127.0.0.1:1/v1", False)
    claims = keys.verify("s" * 32, access.api_key)
    assert not claims.sampled and 59 < claims.expires - __import__("time").time() <= 60.01


#: the calculator tool as the Responses API declares tools (flat: no "function" object)
RESPONSE_TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate an expression.",
                   "parameters": TOOLS[0]["function"]["parameters"]}]


def respond(base_url, access=None, stream=False, **body):
    """A POST /v1/responses call (with the rollout key of ``access``, if given); its answer (the
    stream's events as ``(event name, data)``) and its status."""
    body = {"model": "fake-policy", "stream": stream, **body}
    got = httpx.post(f"{base_url}/responses", json=body, headers=access.headers if access else {}, timeout=30)
    if not stream:
        return got.status_code, got.json()
    events = []
    for event in got.text.split("\n\n"):
        if event:
            head, data = event.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: ")
            events.append((head[7:], json.loads(data[6:])))
    return got.status_code, events


class TestResponsesAPI:
    """POST /v1/responses, the OpenAI Agents SDK's default model (docs/gateway.md, The Responses API)."""

    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
    def test_a_call_is_a_chat_generation(self, captured, gateway, fake, stream):
        """Recorded as a chat generation: vLLM's token ids (asked with enable_response_messages, taken out
        again: the client gets the upstream's answer to its own request), the request's conversation as
        chat messages, the answer (a tool call) as the assistant message the client got, usage."""
        gateway()
        body = {"instructions": "Use the calculator.", "input": "What is 12 + 7?", "tools": RESPONSE_TOOLS}
        direct = respond(fake.url, stream=stream, **body)
        with rtrace.rollout_context(step=2):
            access = rtrace.gateway_access()
            via = respond(access.base_url, access, stream=stream, **body)
        assert via == direct and via[0] == 200
        assert fake.requests[-1]["body"]["enable_response_messages"] is True
        (gen,) = only(captured.trajectories)
        messages = [{"role": "system", "content": "Use the calculator."},
                    {"role": "user", "content": "What is 12 + 7?"}]
        _, calls, sampled = FakeVLLM.reply(messages, RESPONSE_TOOLS)
        assert (gen.name, gen.attributes["gen_ai.operation.name"]) == ("chat fake-policy", "chat")
        assert gen.input == {"model": "fake-policy", "stream": stream, **body, "messages": messages}
        assert (gen.prompt_ids, gen.response_ids) == (encode(render(messages)), encode(sampled))
        assert gen.output == {"role": "assistant", "content": None, "tool_calls": calls, "finish_reason": "tool_calls"}
        assert (gen.attributes["gen_ai.usage.input_tokens"], gen.attributes["gen_ai.usage.output_tokens"],
                gen.attributes["gen_ai.response.id"]) == (len(gen.prompt_ids), len(gen.response_ids), "resp_fake")
        assert "rtrace.capture_gap" not in gen.attributes
        assert ("rtrace.time_to_first_token_ms" in gen.attributes) is stream

    def test_an_agent_loop_is_one_conversation(self, captured, gateway, fake):
        """Two calls as the Agents SDK makes them (the second sends the first's function call and the tool's
        output as input items): the trajectory's conversation is system, user, the tool call, the tool's
        answer, the final answer, in order."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            _, first = respond(access.base_url, access, instructions="Use the calculator.",
                               input=[{"role": "user", "content": "What is 12 + 7?"}], tools=RESPONSE_TOOLS)
            call = first["output"][0]
            _, second = respond(access.base_url, access, instructions="Use the calculator.", tools=RESPONSE_TOOLS,
                                input=[{"role": "user", "content": "What is 12 + 7?"}, call,
                                       {"type": "function_call_output", "call_id": call["call_id"], "output": "19"}])
        (traj,) = captured.trajectories
        assert second["output"][0]["content"][0]["text"] == "The answer is 19."
        assert traj.messages == [
            {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 + 7?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call["call_id"], "type": "function",
                 "function": {"name": "calculator", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "19"},
            {"role": "assistant", "content": "The answer is 19."}]
        assert [g.response_ids for g in only([traj])][1] == encode("The answer is 19.")

    def test_an_upstream_without_ids_and_a_cut_stream(self, captured, gateway, fake):
        """An upstream that returns no ids (vLLM's harmony models answer messages without tokens) is a
        not_returned gap; a stream cut before response.completed is an error with an incomplete gap and
        the text that came."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            fake.token_ids = False
            respond(access.base_url, access, input="What is 2 + 3?")
            fake.token_ids, fake.cut_after = True, 4
            with pytest.raises(httpx.HTTPError):
                respond(access.base_url, access, input="What is 2 + 3?", stream=True)
        whole, cut = only(captured.trajectories)
        assert whole.attributes["rtrace.capture_gap.codes"] == ["not_returned"]
        assert whole.output == {"role": "assistant", "content": "The answer is 5.", "finish_reason": "stop"}
        assert cut.status == "error" and "incomplete" in cut.attributes["rtrace.capture_gap.codes"]
        assert cut.output["content"] == "The "

    def test_a_client_that_asks_for_the_messages_gets_them(self, captured, gateway, fake):
        """The client's own enable_response_messages: the answer passes as it came, ids and all."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            _, got = respond(access.base_url, access, input="What is 2 + 3?", enable_response_messages=True)
        (gen,) = only(captured.trajectories)
        assert got["output_messages"][0]["tokens"] == gen.response_ids == encode("The answer is 5.")


@pytest.mark.parametrize("payload, messages", [
    ({"input": "Hi"}, [{"role": "user", "content": "Hi"}]),
    ({"instructions": "Be brief.", "input": [{"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": "Hi "},
                                                          {"type": "input_text", "text": "there"}]}]},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]),
    # a model's reasoning, text and function calls (output items given back as input) are one assistant turn
    ({"input": [{"role": "user", "content": "Q"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
                {"type": "web_search_call", "id": "ws"}]},
     [{"role": "user", "content": "Q"},
      {"role": "assistant", "content": "Let me.", "reasoning_content": "think",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                      {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"}]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:..."}]}]},
     [{"role": "user", "content": [{"type": "input_image", "image_url": "data:..."}]}]),
    ({"previous_response_id": "resp_1"}, None),  # nothing to read
])
def test_responses_input_as_chat_messages(payload, messages):
    """A Responses request's instructions and input items as the chat messages the record keeps."""
    from rtrace.gateway.responses import chat_messages

    assert chat_messages(payload) == messages


class TestTraceparentJoin:
    def test_an_injected_context_makes_the_call_a_child_of_the_callers_span(self, captured, gateway, fake):
        """rtrace.inject() inside a traced agent step: the call is a child of that span, in the
        rollout's trace, with the coordinates from the baggage."""
        gateway()

        @rtrace.traced(kind="agent")
        def agent_step(base_url):
            return chat(base_url, "any-key", headers=rtrace.inject({}))

        with rtrace.rollout_context(step=4, sample_index=2):
            access = rtrace.gateway_access()
            assert agent_step(access.base_url).status_code == 200
        (traj,) = captured.trajectories
        step, gen = traj.spans[1], traj.spans[2]
        assert (step.kind, gen.kind, gen.parent_id) == ("agent", "generation", step.span_id)
        assert gen.attributes["rtrace.gateway.join"] == "traceparent"
        assert gen.attributes["rl.sample_index"] == 2

    def test_an_otel_sdk_agent_joins_the_trainers_trace(self, captured, gateway, fake):
        """An agent instrumented with the OpenTelemetry SDK (its own provider) continues the trainer's
        context and propagates it: the call's span is a child of the agent's span, in the trainer's trace."""
        from opentelemetry.propagate import extract as otel_extract
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        gateway()
        agent_tracer = TracerProvider().get_tracer("agent")
        with rtrace.rollout_context(step=2) as ro:
            carrier = rtrace.inject({})
            access = rtrace.gateway_access()
        # the agent (in another process, as far as it knows) starts from the carrier
        ctx = otel_extract(carrier)
        with agent_tracer.start_as_current_span("agent.turn", context=ctx) as agent_span:
            headers: dict = {}
            TraceContextTextMapPropagator().inject(headers)
            assert chat(access.base_url, "sk-agent", headers=headers).status_code == 200
        trajectories = captured.trajectories
        gens = only(trajectories)
        assert len(gens) == 1
        gen = gens[0]
        seg = next(t for t in trajectories if gen in t.spans)
        assert seg.trace_id == ro.trace_id  # the trainer's trace
        assert gen.attributes["rtrace.remote_parent"] == format(agent_span.get_span_context().span_id, "016x")

    def test_an_unsampled_traceparent_goes_through_unrecorded(self, captured, gateway, fake):
        """The caller's trace is not sampled: the call goes through, nothing is recorded."""
        gw = gateway()
        tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-00"
        assert chat(f"{gw.url}/v1", "sk-x", headers={"traceparent": tp}).status_code == 200
        assert captured.trajectories == [] and captured.stats()["gateway_calls_untraced"] == 1


def agent(base_url, key, question="What is 12 + 7?", stream=False):
    """A two-turn tool-using agent over plain HTTP: the model calls the calculator, the agent runs
    it and sends the result back, the model answers."""
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}]
    first = chat(base_url, key, messages=messages, stream=stream)
    if stream:
        calls = [c for e in sse(first.text) if e != "[DONE]" for c in e["choices"][0]["delta"].get("tool_calls") or []]
        call = {"id": calls[0]["id"], "type": "function",
                "function": {"name": calls[0]["function"]["name"],
                             "arguments": "".join(c["function"].get("arguments", "") for c in calls)}}
    else:
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
    result = str(eval(json.loads(call["function"]["arguments"])["expression"]))  # the agent's own tool
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": result}]
    second = chat(base_url, key, messages=messages, stream=stream)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse(second.text) if e != "[DONE]") \
        if stream else second.json()["choices"][0]["message"]["content"]
    return messages + [{"role": "assistant", "content": text}]


class TestSessions:
    def test_a_session_is_a_trajectory_with_its_reward_and_the_agents_tool_turns(self, captured, gateway, fake):
        """open -> agent calls with the session key (a tool turn between them) -> reward -> end: one
        trajectory with the session's coordinates and reward, each call a generation under its root,
        and the conversation with the agent's tool turn in order."""
        gw = gateway()
        session = open_session(gw.url, step=7, sample_index=3, rollout_n=1, group_id="g3", policy_version=6,
                               task="add")
        assert session.traced and session.env == {"OPENAI_BASE_URL": f"{gw.url}/v1",
                                                  "OPENAI_API_KEY": session.api_key}
        conversation = agent(session.base_url, session.api_key)
        assert session.info()["calls"] == 2
        session.set_reward(1.0, correct=True)
        assert session.end()["calls"] == 2
        (traj,) = captured.trajectories
        assert (traj.trace_id, traj.step, traj.sample_index, traj.rollout_n, traj.group_id, traj.policy_version,
                traj.extra, traj.reward, traj.outcome, traj.partial) == (
            session.trace_id, 7, 3, 1, "g3", 6, {"task": "add"}, 1.0, {"correct": True}, False)
        gens = only([traj])
        assert [g.parent_id for g in gens] == [traj.root.span_id] * 2
        assert traj.messages == conversation
        assert [f for f in traj.health if f["check"] in ("generation", "capture_gap")] == []

    def test_a_streaming_agent_records_what_a_whole_one_does(self, captured, gateway, fake):
        gw = gateway()
        for stream in (False, True):
            s = open_session(gw.url, step=1, sample_index=int(stream))
            agent(s.base_url, s.api_key, stream=stream)
            s.end(reward=0.5)
        whole, streamed = sorted(captured.trajectories, key=lambda t: t.sample_index)
        assert streamed.messages == whole.messages
        for a, b in zip(only([whole]), only([streamed])):
            assert (a.prompt_ids, a.response_ids, a.output) == (b.prompt_ids, b.response_ids, b.output)

    def test_ended_and_unknown_sessions(self, captured, gateway, fake):
        """A call with the key of an ended session is refused (never forwarded); ending twice, an unknown
        id, bad coordinates: OpenAI-style errors."""
        gw = gateway()
        session = open_session(gw.url, step=1)
        session.end()
        refused = chat(session.base_url, session.api_key)
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "session_ended")
        for path, body in (("/rtrace/sessions/nope/end", {}), (f"/rtrace/sessions/{session.session_id}/end", {})):
            got = httpx.post(gw.url + path, json=body)
            assert (got.status_code, got.json()["error"]["code"]) == (404, "session_not_found")
        bad = httpx.post(gw.url + "/rtrace/sessions", json={"step": "three"})
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_coordinates")
        assert fake.requests == []

    def test_a_sampled_out_session_is_counted_with_its_reward(self, gateway, fake):
        """Over the cap, a session is recorded as a summary only: its calls go through unrecorded and
        the step metrics count it with its reward (before: its tally was never ended, the rollout in
        no metric and no counter); one left to expire is counted as lost."""
        sink = MetricsSink()
        with rtrace.testing.capture(max_traces_per_step=1, sinks=[sink]) as got:
            gw = gateway()
            kept = open_session(gw.url, step=3, sample_index=0)
            out = open_session(gw.url, step=3, sample_index=1)
            lost = open_session(gw.url, step=3, sample_index=2, ttl_s=0.3)
            assert (kept.traced, out.traced, lost.traced) == (True, False, False)
            agent(out.base_url, out.api_key)
            kept.end(reward=1.0)
            out.end(reward=0.0)
            deadline = __import__("time").monotonic() + 20  # the gateway sweeps once a second
            while not rtrace.stats().get("gateway_sessions_summary_lost") and __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.1)
            with rtrace.rollout_context(step=4, sample_index=0):  # a later step: step 3 is done
                pass
            (traj,) = [t for t in got.trajectories if t.step == 3]
            stats = got.stats()
        assert traj.sample_index == 0 and traj.reward == 1.0
        (m,) = [m for m in sink.metrics if m.step == 3]
        assert (m.values["rollout/trajectories"], m.values["rollout/reward_mean"]) == (2.0, 0.5)
        assert (stats["gateway_calls_untraced"], stats["gateway_sessions_summary_lost"]) == (2, 1)

    def test_a_session_never_ended_is_written_partial(self, gateway, fake):
        """A session left open past its time to live: its key dies and what it recorded is written as a
        partial trajectory (counted), as an orphan is."""
        with rtrace.testing.capture(export_interval_s=0.05) as got:
            gw = gateway()
            session = open_session(gw.url, step=2, ttl_s=0.5)
            assert chat(session.base_url, session.api_key).status_code == 200
            deadline = __import__("time").monotonic() + 20
            while not got.sink.trajectories and __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.1)
            (traj,) = got.trajectories
            assert (traj.partial, traj.step, len(only([traj]))) == (True, 2, 1)
            assert got.stats()["gateway_sessions_expired"] == 1
            assert chat(session.base_url, session.api_key).status_code == 401


class TestCaptureGaps:
    def test_an_upstream_without_ids_is_a_capture_gap(self, captured, gateway, fake):
        """A server that returns no token ids (a hosted API): the call is recorded with its text and a
        capture gap saying why (a health finding and a counter), never as text alone."""
        gateway()
        fake.token_ids = False
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            chat(access.base_url, access.api_key)
        (traj,) = captured.trajectories
        (gen,) = only([traj])
        assert gen.response_ids is None and gen.output["tool_calls"]
        assert gen.attributes["rtrace.capture_gap.codes"] == ["not_returned"]
        assert [f["detail"] for f in traj.health if f["check"] == "capture_gap"] == [
            "turn 1: the upstream returned no token ids (not vLLM / SGLang, or an older version)"]
        assert gen.attributes["gen_ai.usage.output_tokens"] == len(encode(FakeVLLM.reply(QUESTION, TOOLS)[2]))
        assert captured.stats()["gateway_capture_gaps.not_returned"] == 1

    def test_ids_not_asked_for(self, gateway, fake):
        with rtrace.testing.capture(gateway_token_ids=False) as got:
            gateway(gateway_token_ids=False)
            with rtrace.rollout_context(step=1):
                access = rtrace.gateway_access()
                chat(access.base_url, access.api_key)
            (gen,) = only(got.trajectories)
        assert "return_token_ids" not in fake.requests[0]["body"]
        assert gen.attributes["rtrace.capture_gap.codes"] == ["not_requested"]

    def test_a_stream_cut_by_the_upstream(self, captured, gateway, fake):
        """The upstream closes a stream midway: the client gets what came, the span records it as an
        error with an ``incomplete`` capture gap."""
        gateway()
        fake.cut_after = 3
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            with pytest.raises(httpx.HTTPError):
                chat(access.base_url, access.api_key, tools=None, stream=True)
        (gen,) = only(captured.trajectories)
        assert gen.status == "error" and "upstream" in gen.error
        assert "incomplete" in gen.attributes["rtrace.capture_gap.codes"]
        assert gen.response_ids == encode("The answer is 19.")[:3]

    def test_a_client_that_goes_away_mid_stream(self, captured, gateway, fake):
        """The client closes its connection after the first chunk: the call is recorded with what came,
        as an error with an ``incomplete`` gap."""
        import time

        gateway()
        fake.chunk_delay_s = 0.05
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            body = {"model": "fake-policy", "messages": QUESTION, "stream": True}
            with httpx.stream("POST", f"{access.base_url}/chat/completions", json=body, headers=access.headers,
                              timeout=30) as response:
                # until the first chunk with a token has come (the one after the role's): the gateway
                # holds a chunk before it passes it on
                events = (line for line in response.iter_lines() if line.startswith("data: "))
                next(events), next(events)
            deadline = time.monotonic() + 30  # until the gateway has seen the disconnect and ended the span
            while not rtrace.stats().get("gateway_capture_gaps.incomplete") and time.monotonic() < deadline:
                time.sleep(0.05)
        (gen,) = only(captured.trajectories)
        assert gen.status == "error" and "went away" in gen.error
        assert "incomplete" in gen.attributes["rtrace.capture_gap.codes"]
        assert 0 < len(gen.response_ids) < len(encode(FakeVLLM.reply(QUESTION, TOOLS)[2]))

    @pytest.mark.parametrize("route, body, settings, until, gaps", [
        # the openai SDK's way: [DONE] read, the connection closed; the gateway asked for ids and logprobs
        ("chat/completions", {}, {}, "[DONE]", []),
        # the client asked for both itself: the gateway passes the bytes on as they come
        ("chat/completions", {"return_token_ids": True, "logprobs": True}, {}, "[DONE]", []),
        ("completions", {}, {}, "[DONE]", []),
        # past the size cap nothing more is kept: the end is told from the bytes passed on
        ("chat/completions", {"return_token_ids": True, "logprobs": True}, {"gateway_max_response_bytes": 1024},
         "[DONE]", ["too_large"]),
        # a client that stops at the chunk with the finish reason, before [DONE]
        ("chat/completions", {}, {}, '"finish_reason":"stop"', []),
    ], ids=["done", "done-as-it-came", "completions", "done-past-the-cap", "finish-reason"])
    def test_a_client_that_closes_once_the_end_came_closes_a_complete_answer(self, captured, gateway, fake, route,
                                                                            body, settings, until, gaps):
        """The openai SDK closes its connection as soon as it reads ``data: [DONE]``, which may come before
        the upstream's body ends (its last chunk a little later): once the answer's end (``[DONE]``, or the
        chunk with the finish reason) has been passed to the client, its close ends a complete answer:
        recorded as such, no error, no ``incomplete`` gap."""
        import time

        gw = gateway(gateway_untraced="record", **settings)  # each call its own trajectory: written when it ends
        if until == "[DONE]":
            fake.tail_delay_s = 5.0  # the upstream's body ends long after [DONE]
        else:
            fake.done_delay_s = 5.0  # [DONE] comes long after the finish reason
        request = {"model": "fake-policy", "stream": True, **body}
        request.update({"prompt": "12 + 7 ="} if route == "completions" else {"messages": QUESTION})
        read = []
        with httpx.stream("POST", f"{gw.url}/v1/{route}", json=request, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    read.append(line[6:])
                    if until in line:
                        break
        deadline = time.monotonic() + 4  # the gateway records the call when it sees the close
        while not (gens := only(captured.trajectories)) and time.monotonic() < deadline:
            time.sleep(0.05)
        (gen,) = gens
        assert (gen.status, gen.error) == ("ok", None)
        assert gen.attributes.get("rtrace.capture_gap.codes", []) == gaps
        if not gaps:
            answer = "".join(json.loads(d)["choices"][0].get("text") or
                             json.loads(d)["choices"][0].get("delta", {}).get("content") or "" for d in read
                             if d != "[DONE]")
            want = FakeVLLM.reply(QUESTION, None)[2] if route == "chat/completions" else " 19"
            assert answer == want and gen.response_ids == encode(want)
            assert gen.output["finish_reason"] == "stop"

    def test_an_answer_over_the_size_cap_passes_through_unrecorded(self, captured, gateway, fake):
        """An answer larger than RTRACE_GATEWAY_MAX_RESPONSE_BYTES reaches the client whole (as it came
        when there is nothing to take out: the client asked for ids and logprobs itself); the call is
        recorded with a ``too_large`` gap, counted; whole and streamed (tests/test_gateway_wire.py:
        an answer the gateway must strip)."""
        gateway(gateway_max_response_bytes=1024)
        long = [{"role": "user", "content": "What is " + " + ".join(["1"] * 300) + "?"}]
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            whole = chat(access.base_url, access.api_key, messages=long, tools=None, return_token_ids=True,
                         logprobs=True)
            streamed = chat(access.base_url, access.api_key, messages=long, tools=None, stream=True)
        assert whole.status_code == streamed.status_code == 200
        assert whole.json()["choices"][0]["message"]["content"] == "The answer is 300."
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in sse(streamed.text)
                       if e != "[DONE]") == "The answer is 300."
        gens = only(captured.trajectories)
        assert [g.attributes["rtrace.capture_gap.codes"][0] for g in gens] == ["too_large", "too_large"]
        assert captured.stats()["gateway_responses_too_large"] == 2

    def test_more_than_one_choice(self, captured, gateway, fake):
        """n=2: the client gets both choices; the first is recorded, and the gap says so."""
        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            answer = chat(access.base_url, access.api_key, n=2).json()
        assert len(answer["choices"]) == 2
        (gen,) = only(captured.trajectories)
        assert gen.response_ids and gen.attributes["rtrace.capture_gap.codes"] == ["choices"]

    @pytest.mark.parametrize("owned_by, provider", [("vllm", "vllm"), ("sglang", "sglang"), ("someone", None)])
    def test_the_upstream_says_what_it_is(self, captured, gateway, fake, owned_by, provider):
        """The gateway asks its upstream what it is (its /v1/models' owned_by: vLLM says vllm, SGLang
        sglang) and records it as each call's gen_ai.provider.name; exported (RTRACE_SEMCONV=both) on the
        chat span, a CLIENT span (a call over HTTP), and on invoke_agent; an upstream that does not say
        is not guessed."""
        import time

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.trace import SpanKind

        from rtrace.exporters import otel

        fake.owned_by = owned_by
        gw = gateway()
        deadline = time.monotonic() + 10  # asked when the gateway starts: until it has the answer
        while not (fake.model_list_requests and gw.gateway._identifying is None) and time.monotonic() < deadline:
            time.sleep(0.01)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            chat(access.base_url, access.api_key)
        (traj,) = captured.trajectories
        (gen,) = only([traj])
        assert gen.attributes.get("gen_ai.provider.name") == provider == gw.gateway.identity.provider
        assert len(fake.model_list_requests) == 1  # asked once at start (again only while it does not say)
        root, chat_span = otel.to_readable_spans(traj, Resource.get_empty(), semconv="both")
        assert root.attributes.get("gen_ai.provider.name") == chat_span.attributes.get("gen_ai.provider.name") \
            == provider
        assert (root.kind, chat_span.kind) == (SpanKind.INTERNAL, SpanKind.CLIENT)

    def test_the_servers_weight_version_is_the_generations_policy_version(self, captured, gateway, fake):
        gateway()
        fake.version = "12"
        with rtrace.rollout_context(step=13, policy_version=11):
            access = rtrace.gateway_access()
            chat(access.base_url, access.api_key)
        (traj,) = captured.trajectories
        (gen,) = only([traj])
        assert (gen.attributes["rl.policy_version"], gen.attributes["rtrace.weight_version"]) == (12, "12")
        assert traj.policy_version == 11 and traj.root.attributes["rl.policy_version"] == 11
        # the server said which weights answered: the rollout ended on them, across an update
        assert (traj.policy_version_end, traj.crossed_update) == (12, True)

    def test_each_call_names_the_server_that_answered(self, captured, gateway, fake):
        """Every recorded call carries OTel's server.address / server.port of the upstream that
        answered it (the timeline's server track), and the rollout's generation time by server."""
        from urllib.parse import urlsplit

        from rtrace.summary import summarize

        gateway()
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            chat(access.base_url, access.api_key)
        (traj,) = captured.trajectories
        (gen,) = only([traj])
        up = urlsplit(fake.url)
        assert (gen.attributes["server.address"], gen.attributes["server.port"]) == (up.hostname, up.port)
        assert summarize(traj).server_ms == {f"{up.hostname}:{up.port}": gen.duration_ms}


class TestBadInput:
    @pytest.mark.parametrize("body, status, code", [
        (b"{not json", 400, "invalid_json"),           # malformed
        (b"[1, 2]", 400, "invalid_body"),              # JSON, not an object
        (b"{" + b" " * 3000 + b"}", 413, "request_too_large"),  # over RTRACE_GATEWAY_MAX_REQUEST_BYTES
    ])
    def test_bad_bodies(self, captured, gateway, fake, body, status, code):
        gw = gateway(gateway_max_request_bytes=2048)
        got = httpx.post(f"{gw.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert (got.status_code, got.json()["error"]["code"]) == (status, code)
        assert captured.stats()[f"gateway_refused.{code}"] == 1 and fake.requests == []

    def test_routes_not_served_are_named(self, captured, gateway, fake):
        gw = gateway()
        for method, path, status in (("POST", "/v1/embeddings", 404), ("POST", "/v1/messages", 404),
                                     ("GET", "/v1/chat/completions", 405), ("GET", "/v1/responses", 405)):
            got = httpx.request(method, gw.url + path, json={})
            error = got.json()["error"]
            assert got.status_code == status and "POST /v1/chat/completions" in error["message"]
            assert path in error["message"]

    def test_calls_naming_no_rollout(self, gateway, fake):
        """No key, no session, no traceparent: refused by default (never forwarded); forwarded as they are
        with RTRACE_GATEWAY_UNTRACED=forward; each a trajectory of its own with =record."""
        with rtrace.testing.capture() as got:
            refuse, forward, record = gateway(), gateway(gateway_untraced="forward"), gateway(gateway_untraced="record")
            no = chat(f"{refuse.url}/v1", "sk-unknown")
            assert (no.status_code, no.json()["error"]["code"]) == (401, "no_rollout") and fake.requests == []
            assert chat(f"{forward.url}/v1", "sk-unknown").json() == chat(fake.url).json()
            fake.requests.clear()
            assert chat(f"{record.url}/v1", "sk-mine").status_code == 200
            (traj,) = got.trajectories
        assert traj.root.kind == "generation" and traj.root.response_ids
        assert fake.requests[0]["headers"]["authorization"] == "Bearer sk-mine"  # the client's own key

    def test_upstream_errors_pass_through(self, captured, gateway, fake):
        """An upstream 400: status and body as the upstream sent them; the span is an error."""
        gateway()
        fake.fail = 400
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            got = chat(access.base_url, access.api_key)
            direct = chat(fake.url)
        assert (got.status_code, got.json()) == (400, direct.json())
        (gen,) = only(captured.trajectories)
        assert gen.status == "error" and gen.error == "upstream answered 400: fake failure 400"
        assert gen.attributes["http.response.status_code"] == 400

    def test_an_upstream_down_or_slow(self, captured, gateway, fake):
        """502 when the upstream cannot be reached, 504 past RTRACE_GATEWAY_TIMEOUT_S; counted."""
        from tests.servers import free_port

        down = start_gateway(f"http://127.0.0.1:{free_port()}/v1", gateway_untraced="forward")
        slow = gateway(gateway_timeout_s=0.2, gateway_untraced="forward")
        fake.delay_s = 1.0
        try:
            got = chat(f"{down.url}/v1")
            assert (got.status_code, got.json()["error"]["code"]) == (502, "upstream_unreachable")
            got = chat(f"{slow.url}/v1")
            assert (got.status_code, got.json()["error"]["code"]) == (504, "upstream_timeout")
        finally:
            down.stop()
        stats = captured.stats()
        assert (stats["gateway_upstream_errors.unreachable"], stats["gateway_upstream_errors.timeout"]) == (1, 1)


class TestAuthorization:
    def test_the_upstream_key_replaces_the_clients(self, captured, gateway, fake):
        gateway(gateway_upstream_key="sk-upstream-secret", gateway_untraced="forward")
        url = rtrace.gateway.access.local.url
        chat(f"{url}/v1", "sk-client")
        assert fake.requests[-1]["headers"]["authorization"] == "Bearer sk-upstream-secret"

    def test_keys_are_never_logged(self, captured, gateway, fake, caplog):
        """Keys in headers and in the path, refused or not, appear in no log record, no error message
        and no repr."""
        caplog.set_level(logging.DEBUG)
        gw = gateway(gateway_upstream_key="sk-upstream-secret")
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            bodies = [chat(access.base_url, access.api_key).text, chat(access.keyed_base_url, "x").text,
                      chat(f"{gw.url}/v1", access.api_key + "x").text]
        secrets = (access.api_key, access.api_key[len(keys.PREFIX):20], gw.gateway.secret, "sk-upstream-secret")
        logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records
                           if r.name.startswith(("rtrace", "uvicorn", "starlette")))  # the gateway's side
        text = logged + repr(access) + repr(gw.env) + "".join(bodies[2:])
        assert not any(s in text for s in secrets)
        assert "<secret>" in repr(access)


class TestFailsOpen:
    def test_a_sink_that_hangs_never_holds_a_call(self, gateway, fake):
        """With the only sink blocked for good, every call still returns at once: recording is beside
        the call, the pipeline's queues are bounded, drops counted."""
        release = threading.Event()

        class Stuck(rtrace.Sink):
            name = "stuck"

            def export(self, trajectories):
                release.wait(60)

        rtrace.configure(sinks=[Stuck(None)], export_interval_s=0.01, sink_queue_size=1, sink_timeout_s=0.5)
        try:
            gateway()
            for i in range(30):
                with rtrace.rollout_context(step=1, sample_index=i):
                    access = rtrace.gateway_access()
                    assert chat(access.base_url, access.api_key, timeout=5).status_code == 200
        finally:
            release.set()

    def test_a_recording_failure_lets_the_call_through(self, gateway, fake):
        """A runtime that fails to open spans: the call goes through untraced, counted."""

        class Broken:
            capture = True

            @property
            def registry(self):
                raise RuntimeError("broken")

        with rtrace.testing.capture() as got:
            gw = gateway(runtime=Broken)
            with rtrace.rollout_context(step=1):
                access = rtrace.gateway_access()
            assert chat(access.base_url, access.api_key).status_code == 200
            stats = got.stats()
        assert stats["gateway_record_errors"] == 1 and stats["gateway_calls_untraced"] == 1
        assert gw.gateway.url


class TestCollector:
    def test_calls_land_in_the_jobs_trajectory(self, collector, fake, monkeypatch, tmp_path):
        """start_collector(gateway_upstream=...): a worker streams its rollout to the collector, its agent
        calls the collector's gateway with the rollout key: one trajectory per rollout, the calls under
        the worker's root; a key of a written rollout is refused."""
        c = collector(gateway_upstream=fake.url, settle_s=0.2)
        assert c.gateway is not None and c.env["RTRACE_GATEWAY_URL"] == c.gateway.url
        for key, value in c.env.items():
            monkeypatch.setenv(key, value)
        rtrace.configure(export_interval_s=0.05)  # this process is a worker of the job
        with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0) as ro:
            access = rtrace.gateway_access()
            agent(access.base_url, access.api_key)
            rtrace.record_reward(1.0)
        rtrace.flush()
        session = open_session(c.gateway.url, step=1, sample_index=1, rollout_n=0)
        agent(session.base_url, session.api_key, stream=True)
        session.end(reward=0.0)
        assert c.flush(30)
        lines = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
        by_index = {d["sample_index"]: d for d in lines}
        assert sorted(by_index) == [0, 1] and len(lines) == 2
        mine = by_index[0]
        assert mine["trace_id"] == ro.trace_id and mine["reward"] == 1.0 and not mine["partial"]
        gens = [s for s in mine["spans"] if s["kind"] == "generation"]
        assert [g["parent_id"] for g in gens] == [mine["spans"][0]["span_id"]] * 2
        assert gens[0]["prompt_ids"] == encode(render(QUESTION))
        assert [m["role"] for m in mine["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert by_index[1]["reward"] == 0.0 and len([s for s in by_index[1]["spans"] if s["kind"] == "generation"]) == 2
        late = chat(access.base_url, access.api_key)
        assert (late.status_code, late.json()["error"]["code"]) == (401, "rollout_ended")


class TestBeyondLoopback:
    def test_the_collectors_token_rules(self, captured, gateway, fake):
        """Bound beyond loopback, a token is generated: the session API and a call that joins by
        traceparent alone need it (401 without, counted); rollout keys work as they are."""
        gw = gateway(host="0.0.0.0")
        token = gw.gateway.token
        assert token and len(token) >= 32
        refused = httpx.post(f"{gw.url}/rtrace/sessions", json={"step": 1})
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "token_required")
        session = open_session(gw.url, step=1, token=token)
        assert chat(session.base_url, session.api_key).status_code == 200
        session.end()
        with rtrace.rollout_context(step=2):
            carrier = rtrace.inject({})
            access = rtrace.gateway_access()
            assert chat(access.base_url, "sk-x", headers=carrier).json()["error"]["code"] == "token_required"
            assert chat(access.base_url, token, headers=carrier).status_code == 200
            assert chat(access.base_url, access.api_key).status_code == 200
        assert "authorization" not in fake.requests[-1]["headers"]  # the token is not the upstream's key
        assert sorted(t.step for t in captured.trajectories) == [1, 2]


class TestConversation:
    def test_an_agent_stopped_after_a_tool_call(self, captured, gateway, fake):
        """The last call returned a tool call the agent never ran: the conversation ends with it, and
        health says so once ('no tool ran'), not twice."""
        gw = gateway()
        session = open_session(gw.url, step=1)
        answer = chat(session.base_url, session.api_key).json()["choices"][0]["message"]
        session.end()
        (traj,) = captured.trajectories
        assert traj.messages[-1] == {"role": "assistant", "content": "", "tool_calls": answer["tool_calls"]}
        assert [f["detail"] for f in traj.health if f["check"] == "generation"] == [
            "turn 1: the model called 1 tool(s) (calculator) but no tool ran"]


def test_every_gateway_counter_is_documented():
    """docs/stats.md lists each counter the gateway counts (rtrace.stats(), GET /rtrace/stats)."""
    import pathlib
    import re

    root = pathlib.Path(rtrace.__file__).parent
    source = "".join(p.read_text() for p in (root / "gateway").glob("*.py"))
    names = set(re.findall(r'_stats\.incr\(f?"(gateway_[a-z_]+)', source))
    doc = (root.parent / "docs" / "stats.md").read_text()
    assert names and {n for n in names if f"`{n}" not in doc} == set()


def test_the_performance_part_says_what_the_asks_cost_the_upstream():
    """docs/gateway.md's Performance part says what the ids and logprobs the gateway asks for cost the
    upstream (more than the gateway itself costs), and names the switches, which are settings."""
    import pathlib

    from rtrace.config import PARAMS

    text = (pathlib.Path(rtrace.__file__).parents[1] / "docs" / "gateway.md").read_text()
    part = text[text.index("## Performance"):]
    assert "What the gateway's asks cost the upstream" in part
    settings = {p.env: p for p in PARAMS}
    for switch in ("RTRACE_GATEWAY_LOGPROBS", "RTRACE_GATEWAY_TOKEN_IDS"):
        assert f"`{switch}=false`" in part and settings[switch].default is True


@pytest.mark.integration
class TestProcesses:
    def _start(self, args, env, tmp_path):
        import os
        import subprocess
        import sys

        full = {**os.environ, **env, "PYTHONPATH": str(__import__("pathlib").Path(rtrace.__file__).parents[1])}
        return subprocess.Popen([sys.executable, "-m", "rtrace", *args], env=full, cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def test_rtrace_gateway(self, fake, tmp_path):
        """`rtrace gateway`: prints the trainers' environment (the secret only in its 0600 file), serves,
        and on SIGTERM writes what it holds: an ended session whole, one left open as partial."""
        import os
        import signal

        from tests.servers import free_port, wait_http

        port = free_port()
        jsonl = tmp_path / "traces.jsonl"
        proc = self._start(["gateway", "--upstream", fake.url, "--port", str(port), "--exporter", "jsonl"],
                           {"RTRACE_JSONL_PATH": str(jsonl)}, tmp_path)
        try:
            wait_http(f"http://127.0.0.1:{port}/rtrace/health", 60, proc)
            done = open_session(f"http://127.0.0.1:{port}", step=1, sample_index=0)
            agent(done.base_url, done.api_key)
            done.end(reward=1.0)
            left = open_session(f"http://127.0.0.1:{port}", step=1, sample_index=1)
            chat(left.base_url, left.api_key)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        env_file = tmp_path / "rtrace-gateway.env"
        secret = [line.split("=", 1)[1] for line in env_file.read_text().splitlines() if "GATEWAY_SECRET" in line][0]
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"
        assert f"export RTRACE_GATEWAY_URL=http://127.0.0.1:{port}" in out and secret not in out
        assert proc.returncode == 0, out
        lines = {d["sample_index"]: d for d in map(json.loads, jsonl.read_text().splitlines())}
        assert (lines[0]["reward"], lines[0]["partial"], lines[1]["partial"]) == (1.0, False, True)
        assert [m["role"] for m in lines[0]["messages"]] == ["system", "user", "assistant", "tool", "assistant"]

    def test_rtrace_collect_with_a_gateway(self, fake, tmp_path):
        """`rtrace collect --gateway-upstream`: the gateway serves beside the collector; its URL is printed,
        its secret goes to the env file only."""
        import os
        import signal
        import time

        proc = self._start(["collect", "--exporter", "jsonl", "--port", "0", "--gateway-upstream", fake.url],
                           {"RTRACE_JSONL_PATH": str(tmp_path / "traces.jsonl")}, tmp_path)
        lines: list[str] = []
        deadline = time.monotonic() + 60
        try:
            while not any("RTRACE_GATEWAY_URL" in line for line in lines) and time.monotonic() < deadline:
                lines.append(proc.stdout.readline())
            url = next(line for line in lines if "RTRACE_GATEWAY_URL" in line).strip().split("=", 1)[1]
            session = open_session(url, step=3)
            assert chat(session.base_url, session.api_key).status_code == 200
            session.end()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        env = (tmp_path / "rtrace-collector.env").read_text()
        secret = [x.split("=", 1)[1] for x in env.splitlines() if "GATEWAY_SECRET" in x][0]
        assert secret not in "".join(lines) + out
        (traj,) = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
        assert traj["step"] == 3 and traj["num_turns"] == 1


def test_a_kept_alive_connection_the_upstream_closed_is_retried_once():
    """An upstream that closes each connection after its answer (without saying so): the next request,
    sent on the kept-alive connection, is sent again once on a new one; nothing reaches the caller."""
    import asyncio
    import socket
    import time

    from rtrace.gateway.upstream import Upstream

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted = []

    def serve():
        for _ in range(2):
            conn, _ = listener.accept()
            accepted.append(conn)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
            time.sleep(0.3)  # the client's next request arrives meanwhile, on this connection
            conn.close()  # closes, though the answer said nothing of it, and never answers that request

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def two_calls():
        upstream = Upstream(f"http://127.0.0.1:{port}/v1", timeout_s=10)
        bodies = []
        for _ in range(2):
            reply = await upstream.request("POST", "/chat/completions", [], b"{}")
            bodies.append(b"".join([c async for c in reply.chunks()]))
        upstream.close()
        return bodies

    assert asyncio.run(two_calls()) == [b"{}", b"{}"]
    thread.join(5)
    listener.close()
    assert len(accepted) == 2


# ----------------------------------------------------------------------------- protocol.edit: the byte edit
from rtrace.gateway.protocol import Asked, edit, strip, strip_chunk  # noqa: E402

BOTH, IDS, LOGPROBS = Asked(True, True), Asked(True, False), Asked(False, True)


def _stripped(raw, asked, chunk=False):
    """What the parse-and-strip path leaves of ``raw``: ``(object, keep)``."""
    data = json.loads(raw)
    keep = strip_chunk(data, asked) if chunk else (strip(data, asked) or True)
    return data, keep


def _vllm_answer(**extra):
    lps = {"content": [{"token": t, "logprob": -0.5, "bytes": [ord(t)], "top_logprobs": [{"token": t, "logprob": -0.5,
                                                                                          "bytes": [ord(t)]}]}
                       for t in ("{", '"', "[", "\\", "'", "]", "}")]}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "a \"quoted\" {[x]} \\ é ✓",
                                                   "tool_calls": [{"id": "c1", "type": "function", "function": {
                                                       "name": "f", "arguments": "{\"token_ids\": [1, 2]}"}}]},
                           "logprobs": lps, "finish_reason": "stop", "stop_reason": None, "token_ids": [5, 6, 7]}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
              "prompt_token_ids": [1, 2, 3]}
    answer.update(extra)
    return answer


class TestEdit:
    """protocol.edit takes out what the gateway asked for as a byte edit: it must leave exactly
    what parsing, strip() / strip_chunk() and encoding again leave, and every other byte as it came."""

    @pytest.mark.parametrize("asked", [BOTH, IDS, LOGPROBS], ids=["both", "ids", "logprobs"])
    @pytest.mark.parametrize("dump", [
        lambda d: json.dumps(d, separators=(",", ":"), ensure_ascii=False),  # vLLM's compact JSON
        lambda d: json.dumps(d),  # ", " and ": ", non-ASCII escaped
        lambda d: json.dumps(d, indent=2, ensure_ascii=False),  # new lines and indentation
        lambda d: " \n" + json.dumps(d) + " \n",  # white space around the object
    ], ids=["compact", "spaced", "indented", "padded"])
    def test_a_whole_answer(self, asked, dump):
        """Tool-call arguments that spell a token_ids field, quotes, brackets and backslashes in the text
        and in the logprobs' tokens, a nested token_ids the gateway did not ask for (it stays)."""
        answer = _vllm_answer(metadata={"token_ids": [9], "logprobs": {"x": 1}})
        raw = dump(answer).encode()
        out, keep = edit(raw, asked)
        want, _ = _stripped(raw, asked)
        assert keep and json.loads(out) == want
        assert json.loads(out)["metadata"] == {"token_ids": [9], "logprobs": {"x": 1}}
        # byte for byte what the upstream would have written without them: the same dump of the answer
        # with those values null (the rest as it came, its spacing, escapes and order)
        assert out == dump(want).encode()

    def test_fields_in_any_order_and_several_choices(self):
        answer = _vllm_answer()
        choice = answer["choices"][0]
        reordered = {k: answer[k] for k in reversed(list(answer))}
        reordered["choices"] = [{k: choice[k] for k in reversed(list(choice))},
                                {**{k: choice[k] for k in sorted(choice)}, "index": 1,
                                 "prompt_token_ids": [1, 2, 3]}]
        raw = json.dumps(reordered).encode()
        out, _ = edit(raw, BOTH)
        assert json.loads(out) == _stripped(raw, BOTH)[0]
        assert all(c["token_ids"] is None and c["logprobs"] is None for c in json.loads(out)["choices"])

    @pytest.mark.parametrize("raw", [
        b'[1, 2]', b'"text"', b'{"a": 1', b'{"a": 1} x', b'not json', b'',
        b'{"choices": [1, 2]}',  # a choice that is not an object
        b'{"prompt_token_ids": [1], "prompt_token_ids": [2]}',  # a repeated key
        b'{"prompt\\u005ftoken_ids": [1, 2]}',  # a key written with an escape
    ])
    def test_what_it_cannot_tell_it_leaves_to_the_parser(self, raw):
        """edit() answers None (the gateway then parses, strips and encodes again) rather than guess."""
        assert edit(raw, BOTH) == (None, True)

    def test_nothing_to_take_out_is_the_same_bytes(self):
        raw = b'{"id": "x", "choices": null, "usage": {}}'
        assert edit(raw, BOTH) == (raw, True)
        raw = json.dumps(_vllm_answer(prompt_token_ids=None)).encode()
        assert edit(raw, Asked(False, False))[0] is raw

    @pytest.mark.parametrize("chunk, keep", [
        ({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": None,
                       "token_ids": [5]}]}, False),  # only what the gateway asked for: dropped
        ({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None, "token_ids": [5]}]}, True),
        ({"choices": [{"index": 0, "delta": { }, "finish_reason": "stop", "token_ids": []}]}, True),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None}], "usage": {"total_tokens": 3}}, True),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None}], "usage": None}, False),
        ({"choices": [], "usage": None, "prompt_token_ids": [1, 2]}, True),  # no choices: kept (vLLM's first)
        # completions: vLLM sends one per token whatever is asked (empty text: a token that ends mid-character)
        ({"choices": [{"index": 0, "text": "", "finish_reason": None, "token_ids": [5]}]}, True),
        ({"choices": [{"index": 0, "text": "4", "finish_reason": None, "token_ids": [5]}]}, True),
        ({"choices": [{"index": 0, "delta": None, "finish_reason": None}]}, False),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None},
                      {"index": 1, "delta": {"tool_calls": []}, "finish_reason": None}]}, True),  # a non-empty delta
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None},
                      {"index": 1, "delta": {"role": "assistant"}, "finish_reason": None}]}, True),
    ])
    def test_a_chunk_with_nothing_left_is_dropped(self, chunk, keep):
        """The same decision as strip_chunk: a chunk that only carried ids or logprobs is dropped."""
        for raw in (json.dumps(chunk).encode(), json.dumps(chunk, separators=(",", ":")).encode()):
            out, kept = edit(raw, BOTH, chunk=True)
            want, want_keep = _stripped(raw, BOTH, chunk=True)
            assert (kept, want_keep) == (keep, keep) and json.loads(out) == want


def _json_values():
    from hypothesis import strategies as st

    text = st.text(alphabet=st.sampled_from('ab"\\{}[]:, \n\té✓\x01'), max_size=8)
    leaves = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                                                                                 allow_infinity=False) | text
    keys = st.sampled_from(["token_ids", "prompt_token_ids", "logprobs", "x", 'q"k', "b\\s", "é"]) | text
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                        max_leaves=12)


def test_edit_agrees_with_strip_on_any_answer():
    """Property: for answers with arbitrary other fields (nested, escaped, keys named like the
    fields taken out at other depths), in any order and any spacing, edit() leaves what the
    parse-and-strip path leaves, or says it cannot (None)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ids = st.none() | st.lists(st.integers(0, 10**6), max_size=5)
    choice = st.fixed_dictionaries({"index": st.integers(0, 3)}, optional={
        "token_ids": ids, "prompt_token_ids": ids, "logprobs": _json_values(), "delta": _json_values(),
        "text": _json_values(), "finish_reason": st.none() | st.sampled_from(["stop", ""]), "extra": _json_values()})
    answer = st.fixed_dictionaries({}, optional={
        "id": st.text(max_size=5), "choices": st.none() | st.lists(choice, max_size=3), "prompt_token_ids": ids,
        "usage": _json_values(), "other": _json_values(), "token_ids": ids, "logprobs": _json_values()})

    @settings(max_examples=400, deadline=None)
    @given(answer, st.sampled_from([BOTH, IDS, LOGPROBS]), st.booleans(), st.randoms(use_true_random=False),
           st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    def check(data, asked, chunk, rnd, seps):
        items = list(data.items())
        rnd.shuffle(items)
        raw = json.dumps(dict(items), separators=seps, ensure_ascii=rnd.random() < 0.5).encode()
        out, keep = edit(raw, asked, chunk=chunk)
        if out is None:
            return
        edited.append(out is not raw)
        want, want_keep = _stripped(raw, asked, chunk=chunk)
        assert json.loads(out) == want and keep == want_keep

    edited: list[bool] = []
    check()
    assert sum(edited) > 100, edited.count(True)  # most examples were edits, not refusals


# ----------------------------------------------------------------------------- the gateway's HTTP server
def _raw_exchange(url, data, until=b"", timeout=10.0):
    """Send ``data`` on one raw TCP connection to the gateway; read until ``until`` has come (or the
    connection closes); the bytes read and whether the gateway closed the connection."""
    import socket
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    try:
        sock.sendall(data)
        got, closed, deadline = b"", False, time.monotonic() + timeout
        done = until if callable(until) else (lambda got: until and until in got)
        while not done(got) and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            got += chunk
        return got, closed
    finally:
        sock.close()


def _post(path, body, *headers):
    head = [f"POST {path} HTTP/1.1", "host: gw", "content-type: application/json", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class TestServer:
    """rtrace/gateway/http.py: the HTTP/1.1 details a server owes its clients."""

    def test_pipelined_requests_are_answered_in_order(self, captured, gateway, fake):
        """Three requests in one write (a model call between two health checks) on one connection."""
        gw = gateway(gateway_untraced="forward")
        health = b"GET /rtrace/health HTTP/1.1\r\nhost: gw\r\n\r\n"
        body = json.dumps({"model": "fake-policy", "messages": QUESTION}).encode()
        got, closed = _raw_exchange(gw.url, health + _post("/v1/chat/completions", body) + health,
                                    until=lambda got: got.count(b'"status":"ok"') == 2, timeout=10)
        answers = got.split(b"HTTP/1.1 ")[1:]
        assert [a[:3] for a in answers] == [b"200"] * 3 and not closed
        assert b'"status":"ok"' in answers[0] and b"chat.completion" in answers[1]
        assert b'"status":"ok"' in answers[2]
        assert all(b"\r\ndate: " in a for a in answers)

    def test_expect_100_continue(self, captured, gateway, fake):
        gw = gateway(gateway_untraced="forward")
        body = json.dumps({"model": "fake-policy", "messages": QUESTION}).encode()
        got, _ = _raw_exchange(gw.url, _post("/v1/chat/completions", body, "expect: 100-continue"),
                               until=b"chat.completion")
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")

    @pytest.mark.parametrize("framing", ["content-length", "chunked"])
    def test_a_body_over_the_limit_is_refused_and_never_forwarded(self, captured, gateway, fake, framing):
        """413 with an OpenAI-style error, then the connection closes (the rest of the body is not read)."""
        gw = gateway(gateway_untraced="forward", gateway_max_request_bytes=2048)
        body = json.dumps({"model": "fake-policy", "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        if framing == "chunked":
            data = _post("/v1/chat/completions", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
                         "transfer-encoding: chunked")
        else:
            data = _post("/v1/chat/completions", body)
        got, closed = _raw_exchange(gw.url, data)
        assert got.startswith(b"HTTP/1.1 413 ") and closed and b"connection: close" in got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
        assert fake.requests == [] and captured.stats()["gateway_refused.request_too_large"] == 1

    def test_a_chunked_request_body_is_read(self, captured, gateway, fake):
        gw = gateway(gateway_untraced="forward")
        body = json.dumps({"model": "fake-policy", "messages": QUESTION}).encode()
        data = _post("/v1/chat/completions", b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10,
                                                                                   body[10:]),
                     "transfer-encoding: chunked")
        got, _ = _raw_exchange(gw.url, data, until=b"chat.completion")
        assert got.startswith(b"HTTP/1.1 200 OK") and fake.requests[0]["body"]["messages"] == QUESTION

    def test_malformed_http_and_http_1_0(self, captured, gateway, fake):
        """Bytes that are not HTTP: 400 and the connection closes. HTTP/1.0: answered, then closed."""
        gw = gateway(gateway_untraced="forward")
        got, closed = _raw_exchange(gw.url, b"\x00\x01 nonsense\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400 ") and closed
        got, closed = _raw_exchange(gw.url, b"GET /rtrace/health HTTP/1.0\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in got and closed
        assert captured.stats()["gateway_refused.bad_http"] == 1

    def test_routes_not_served_and_other_methods(self, captured, gateway, fake):
        """The model routes answer 405 to other methods (Starlette's route list), unknown paths 404."""
        gw = gateway()
        assert httpx.get(f"{gw.url}/v1/chat/completions").status_code == 405
        assert httpx.post(f"{gw.url}/k/some-key/v1/nothing").status_code == 404
        got = httpx.post(f"{gw.url}/v1/messages", json={})
        assert got.status_code == 404 and "POST /v1/responses" in got.json()["error"]["message"]

    def test_a_stream_the_upstream_stalls_is_cut_and_recorded(self, captured, gateway, fake):
        """A stream whose next chunk does not come within RTRACE_GATEWAY_TIMEOUT_S: the client's stream
        is cut (no final chunk), the call is an error with an incomplete gap, counted."""
        gateway(gateway_timeout_s=0.3)
        fake.chunk_delay_s = 2.0
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            stream_until_cut(access, {"model": "fake-policy", "messages": QUESTION, "stream": True},
                             httpx.RemoteProtocolError)
        (gen,) = only(captured.trajectories)
        assert gen.status == "error" and "upstream timeout during the stream" in gen.error
        assert "incomplete" in gen.attributes["rtrace.capture_gap.codes"]
        assert captured.stats()["gateway_upstream_errors.timeout"] == 1


def accept_call(listener):
    """``(connection, what it sent so far)``: the next connection of a raw test upstream whose first
    request is not ``GET /v1/models``, which the gateway sends when it starts to learn what its
    upstream is (answered 404 here, and closed)."""
    while True:
        conn, _ = listener.accept()
        data = b""
        while b"\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                break
            data += more
        if not data.startswith(b"GET ") or b"/models " not in data.split(b"\r\n", 1)[0]:
            return conn, data
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                break
            data += more
        conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        conn.close()


class SplitUpstream:
    """An upstream that sends a fixed streamed answer cut at given byte offsets, each part in a
    write of its own some milliseconds apart (so the gateway reads it in as many parts)."""

    def __init__(self, body, cuts):
        import socket

        self.body, self.cuts = body, cuts
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import socket
        import time

        conn, data = accept_call(self.listener)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
        while len(rest) < length:
            rest += conn.recv(65536)
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in self._parts()) + b"0\r\n\r\n"
        wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
        # the wire bytes cut at the same fractions, so chunk framing is split across reads too
        step = max(1, len(wire) // (len(self.cuts) + 1))
        for i in range(0, len(wire), step):
            conn.sendall(wire[i:i + step])
            time.sleep(0.01)
        time.sleep(0.2)
        conn.close()

    def _parts(self):
        edges = [0, *self.cuts, len(self.body)]
        return [self.body[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def test_a_stream_split_anywhere_across_reads(captured):
    """SSE events and the HTTP chunk framing cut at arbitrary bytes (inside JSON, inside a "\\n\\n"):
    the client gets each event whole and stripped as if it had come in one piece; the record is whole."""
    import random

    events = [{"id": "c", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None, "token_ids": None}], "prompt_token_ids": [1, 2, 3]}]
    for i, piece in enumerate(["He", "llo", " \"wor\\ld\"", ""]):
        events.append({"id": "c", "object": "chat.completion.chunk", "model": "m",
                       "choices": [{"index": 0, "delta": {"content": piece} if piece else {},
                                    "logprobs": {"content": [{"token": "x", "logprob": -0.5 * i, "bytes": [120],
                                                              "top_logprobs": []}]},
                                    "finish_reason": "stop" if not piece else None, "token_ids": [10 + i]}]})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    rnd = random.Random(7)
    up = SplitUpstream(body, sorted(rnd.sample(range(1, len(body)), 25)))
    gw = start_gateway(up.url)
    try:
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            got = chat(access.base_url, access.api_key, stream=True, tools=None)
    finally:
        gw.stop()
    received = sse(got.text)
    want = []
    for e in events:
        stripped = json.loads(json.dumps(e))
        if strip_chunk(stripped, BOTH):
            want.append(stripped)
    assert received == want + ["[DONE]"]
    (gen,) = only(captured.trajectories)
    assert gen.prompt_ids == [1, 2, 3] and gen.response_ids == [10, 11, 12, 13]
    assert gen.output["content"] == 'Hello "wor\\ld"' and gen.output["finish_reason"] == "stop"
    assert gen.token_values["logprob"].tolist() == [0.0, -0.5, -1.0, -1.5]
    assert "rtrace.capture_gap" not in gen.attributes


def test_a_record_that_cannot_be_read_is_counted_and_the_span_stays(captured):
    """The worker reads a gateway call's record (pipeline.records.Deferred): a reading that fails is
    counted (capture_errors) and the span is kept without its record."""
    from rtrace.pipeline.records import Deferred

    class Broken(Deferred):
        def resolve(self):
            raise ValueError("unreadable")

    from rtrace.gateway.recorder import SPECS
    from rtrace.instrumentation import _state

    with rtrace.rollout_context(step=1):
        span = _state.get_runtime().tracer.start_span("chat m")
        span.spec = SPECS["chat"]  # what recorder.Call.finish gives a gateway call's span
        span.args, span.kwargs, span.arg_lens, span.owner_name = (), Broken(), None, None
        span.output, span.has_output = None, False
        span.end()
    (traj,) = captured.trajectories
    (gen,) = [s for s in traj.spans if s.name == "chat m"]
    assert gen.kind == "generation" and gen.input is None and gen.response_ids is None
    assert captured.stats()["capture_errors"] == 1


@pytest.mark.parametrize("data, one_choice, ends", [
    (b"[DONE]", True, True),
    (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True, True),
    # n > 1: one choice's end is not the answer's
    (b'{"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}', False, False),
    (b'{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}', True, False),
    # the usage chunk (stream_options.include_usage) comes after every choice ended
    (b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}', False, True),
    (b'{"type":"response.completed","response":{"status":"completed"}}', True, True),
    (b'{"type":"response.output_text.delta","delta":"x"}', True, False),
    (b"not json", True, False),
])
def test_what_ends_a_stream(data, one_choice, ends):
    """The events after which a client's close ends a complete answer (protocol.ends_stream)."""
    from rtrace.gateway.protocol import ends_stream

    assert ends_stream(data, one_choice) is ends
