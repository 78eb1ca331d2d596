"""The capture gateway in front of a real vLLM (CPU), with real clients and agent frameworks.

Every test runs a job: a collector that serves the gateway (``start_collector(gateway_upstream=...)``),
this process as one of its workers (``RTRACE_EXPORTER=collector``), and reads the written
trajectories back from the collector's JSONL. For each recorded model call it checks, against
the upstream itself, that the prompt and completion ids are the ones vLLM gives for the same
request (asked again directly, greedy decoding), and that the text is the client's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import rtrace
from tests.gateway.model import MODEL_NAME

openai = pytest.importorskip("openai")

SYSTEM = "Use the calculator or lookup tool, then give the answer."
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"expression": {
                                               "type": "string"}}, "required": ["expression"]}}}]
AGENT = Path(__file__).with_name("blackbox_agent.py")


def calculator_result(expression: str) -> str:
    from tests.gateway.blackbox_agent import calculator

    return calculator(expression)


def gens(traj: dict) -> list[dict]:
    return [s for s in traj["spans"] if s["kind"] == "generation"]


def is_responses(span: dict) -> bool:
    """The span recorded a Responses API call (its request has ``input``; the gateway adds ``messages``)."""
    return "input" in span["input"] and "prompt" not in span["input"]


def upstream_ids(vllm: str, span: dict) -> tuple[list[int], list[int]]:
    """The ids vLLM itself gives for the request a generation span recorded, asked again directly."""
    body = {k: v for k, v in span["input"].items() if k not in ("prompt_ids", "stream", "stream_options")}
    if is_responses(span):
        del body["messages"]  # the gateway's reading of `input`, not part of the request
        body["enable_response_messages"] = True
        kind = "responses"
    else:
        body["return_token_ids"] = True
        kind = "chat/completions" if "messages" in body else "completions"
    request = urllib.request.Request(f"{vllm}/{kind}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        data = json.loads(response.read())
    if kind == "responses":
        return data["input_messages"][0]["tokens"], data["output_messages"][0]["tokens"]
    choice = data["choices"][0]
    return data.get("prompt_token_ids") or choice.get("prompt_token_ids"), choice["token_ids"]


def check_calls(vllm: str, traj: dict) -> None:
    """Every generation of the trajectory: ids equal to the upstream's, logprobs aligned (none for the
    Responses API), no gap, vLLM as its provider (asked of its /v1/models), a CLIENT span once exported."""
    for span in gens(traj):
        assert (span["prompt_ids"], span["response_ids"]) == upstream_ids(vllm, span), span["name"]
        if is_responses(span):
            assert "logprob" not in (span.get("token_values") or {})
        else:
            assert len(span["token_values"]["logprob"]) == len(span["response_ids"])
        assert "rtrace.capture_gap" not in span["attributes"]
        assert span["attributes"]["gen_ai.provider.name"] == "vllm"
    assert not [f for f in traj["health"] if f["check"] == "capture_gap"]


def test_openai_sdk_sync_async_and_streaming(job, vllm):
    """The openai SDK, sync and async, whole and streamed, chat and completions, with the rollout key:
    one trajectory, each call a generation span of it with vLLM's ids and the client's text;
    streamed calls recorded exactly as whole ones."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 + 7?"}]
    texts = []
    with rtrace.rollout_context(step=2, sample_index=5, rollout_n=1, policy_version=2) as ro:
        access = rtrace.gateway_access()
        sync = openai.OpenAI(base_url=access.base_url, api_key=access.api_key)
        whole = sync.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=0,
                                             max_tokens=60)
        texts.append(whole.choices[0].message)
        streamed = sync.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=60, stream=True)
        chunks = list(streamed)
        plain = sync.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=30)
        texts.append(plain.choices[0].message)

        async def async_calls():
            client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key)
            one = await client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                                       max_tokens=30)
            parts = []
            async for chunk in await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                                    temperature=0, max_tokens=30, stream=True):
                parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            return one.choices[0].message.content, "".join(parts)

        async_whole, async_streamed = asyncio.run(async_calls())
        completion = sync.completions.create(model=MODEL_NAME, prompt="What is 3 + 4?", temperature=0, max_tokens=8)
        rtrace.record_reward(0.5)
    (traj,) = job.read()
    assert (traj["trace_id"], traj["step"], traj["sample_index"], traj["rollout_n"], traj["policy_version"],
            traj["reward"]) == (ro.trace_id, 2, 5, 1, 2, 0.5)
    calls = gens(traj)
    assert len(calls) == 6 and {c["parent_id"] for c in calls} == {traj["spans"][0]["span_id"]}
    tool_whole, tool_streamed, plain_whole, a_whole, a_streamed, text = calls
    # the client's text and tool calls
    assert tool_whole["output"]["tool_calls"] == [c.model_dump() for c in whole.choices[0].message.tool_calls]
    streamed_args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""
                            for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert tool_streamed["output"]["tool_calls"][0]["function"]["arguments"] == streamed_args
    assert plain_whole["output"]["content"] == plain.choices[0].message.content
    assert (a_whole["output"]["content"], a_streamed["output"]["content"]) == (async_whole, async_streamed)
    assert text["output"]["text"] == completion.choices[0].text
    # streamed == whole
    for whole_span, streamed_span in ((tool_whole, tool_streamed), (a_whole, a_streamed)):
        assert (streamed_span["prompt_ids"], streamed_span["response_ids"]) == (whole_span["prompt_ids"],
                                                                              whole_span["response_ids"])
        assert streamed_span["token_values"]["logprob"] == pytest.approx(
            whole_span["token_values"]["logprob"], abs=1e-4)
        assert streamed_span["attributes"]["rtrace.time_to_first_token_ms"] > 0
    assert plain_whole["output"]["content"] == a_whole["output"]["content"] == async_streamed
    check_calls(vllm, traj)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_tool_agent(job, vllm, api):
    """The OpenAI Agents SDK, a multi-turn tool-using agent, on Chat Completions and on its default
    model's Responses API (POST /v1/responses, which the gateway serves with vLLM's ids from
    enable_response_messages): its model calls are the rollout's generations, its tool turn is in
    the conversation in order, the final text is the agent's."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # the SDK's own tracing would call OpenAI's servers
    model_class = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    ran = []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(calculator_result(expression))
        return ran[-1]

    async def rollout():
        async with rtrace.rollout_context(step=3, sample_index=0, rollout_n=0):
            access = rtrace.gateway_access()
            client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key)
            agent = Agent(name="calculator-agent", instructions=SYSTEM, tools=[calculator],
                          model=model_class(model=MODEL_NAME, openai_client=client),
                          model_settings=ModelSettings(temperature=0, max_tokens=60))
            result = await Runner.run(agent, "What is 12 + 7?", max_turns=4)
            rtrace.record_reward(1.0 if "19" in str(result.final_output) else 0.0)
            return result.final_output

    final = asyncio.run(rollout())
    (traj,) = job.read()
    calls = gens(traj)
    assert len(calls) >= 2 and ran
    assert all(c["status"] == "ok" and c["attributes"]["gen_ai.operation.name"] == "chat" for c in calls)
    roles = [m["role"] for m in traj["messages"]]
    assert roles[:5] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert traj["messages"][3]["content"] == ran[0]
    assert traj["messages"][-1]["content"] == final
    assert not [f for f in traj["health"] if f["check"] == "generation" and "no tool ran" in f["detail"]]
    check_calls(vllm, traj)


def test_langgraph_tool_agent(job, vllm):
    """LangGraph's ReAct agent with langchain-openai's ChatOpenAI: the same."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ran = []

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(calculator_result(expression))
        return ran[-1]

    with rtrace.rollout_context(step=4, sample_index=1, rollout_n=0):
        access = rtrace.gateway_access()
        model = ChatOpenAI(model=MODEL_NAME, base_url=access.base_url, api_key=access.api_key, temperature=0,
                           max_tokens=60)
        graph = create_react_agent(model, [calculator], prompt=SYSTEM)
        state = graph.invoke({"messages": [("user", "What is 12 + 7?")]}, {"recursion_limit": 8})
        final = state["messages"][-1].content
    (traj,) = job.read()
    assert len(gens(traj)) >= 2 and ran
    roles = [m["role"] for m in traj["messages"]]
    assert roles[:5] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj["messages"][3]["content"] == ran[0]
    assert traj["messages"][-1]["content"] == final
    check_calls(vllm, traj)


def _run_agent(env: dict[str, str], question: str) -> dict:
    out = subprocess.run([sys.executable, str(AGENT), question], env=env, capture_output=True, text=True,
                         timeout=300, cwd=str(AGENT.parent))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_black_box_agent_through_a_session(job, vllm):
    """A black-box agent in a subprocess, given only OPENAI_BASE_URL and OPENAI_API_KEY by a trainer
    that opened a session over HTTP; the reward is set through the session, whose end ends the
    trajectory."""
    from rtrace.gateway import open_session

    results = {}
    for index, question in enumerate(("What is 12 + 7?", "What is 30 - 4?")):
        session = open_session(job.gateway_url, step=5, sample_index=index, rollout_n=0, group_id="q",
                               policy_version=5)
        env = {"PATH": os.environ["PATH"], **session.env}  # nothing else: a black box
        results[index] = (session, _run_agent(env, question))
        session.set_reward(float(index), solved=bool(index))
        session.end()
    trajectories = {t["sample_index"]: t for t in job.read()}
    assert sorted(trajectories) == [0, 1]
    for index, (session, transcript) in results.items():
        traj = trajectories[index]
        assert (traj["trace_id"], traj["step"], traj["group_id"], traj["reward"], traj["outcome"]) == (
            session.trace_id, 5, "q", float(index), {"solved": bool(index)})
        assert traj["messages"] == transcript["messages"]
        assert len(gens(traj)) == sum(1 for m in transcript["messages"] if m["role"] == "assistant")
        check_calls(vllm, traj)


def test_an_otel_instrumented_agent_joins_by_traceparent(job, vllm):
    """An agent instrumented with the OpenTelemetry SDK continues the trainer's context (given as
    TRACEPARENT / BAGGAGE) and sends traceparent with its calls, with no rollout key: its calls
    are generation spans of the trainer's trajectory, children of the agent's own span."""
    with rtrace.rollout_context(step=6, sample_index=0, rollout_n=0) as ro:
        carrier = rtrace.inject({})
        env = {"PATH": os.environ["PATH"], "OPENAI_BASE_URL": f"{job.gateway_url}/v1", "OPENAI_API_KEY": "no-key",
               "TRACEPARENT": carrier["traceparent"], "BAGGAGE": carrier.get("baggage", ""),
               "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        transcript = _run_agent(env, "What is 12 + 7?")
    (traj,) = job.read()
    assert traj["trace_id"] == ro.trace_id and traj["step"] == 6
    calls = gens(traj)
    assert calls and {c["parent_id"] for c in calls} == {transcript["span_id"]}
    assert {c["attributes"]["rtrace.gateway.join"] for c in calls} == {"traceparent"}
    check_calls(vllm, traj)


#: what differs between two identical requests: ids (of the answer, its items, its tool calls), creation times
_VARYING = frozenset(("id", "created", "created_at", "call_id", "item_id"))


def _normal(data):
    """An answer without what differs between two identical requests (ids, creation times)."""
    if isinstance(data, dict):
        return {k: ("<id>" if k in _VARYING else _normal(v)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_normal(v) for v in data]
    return data


def _raw(url: str, body: dict, key: str | None = None) -> tuple[int, str]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_client_sees_what_vllm_answers(job, vllm):
    """Through the gateway, which asks vLLM for token ids and logprobs on its own behalf, the client
    gets vLLM's answer to its own request: whole, streamed chunk for chunk, and errors."""
    body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "What is 12 + 7?"}],
            "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    with rtrace.rollout_context(step=1):
        access = rtrace.gateway_access()
        for stream in (False, True):
            direct = _raw(f"{vllm}/chat/completions", {**body, "stream": stream})
            via = _raw(f"{access.base_url}/chat/completions", {**body, "stream": stream}, access.api_key)
            assert direct[0] == via[0] == 200
            if stream:
                events = [[json.loads(e[6:]) if e[6:] != "[DONE]" else e for e in text.split("\n\n") if e]
                          for text in (direct[1], via[1])]
                assert _normal(events[0]) == _normal(events[1])
            else:
                assert _normal(json.loads(direct[1])) == _normal(json.loads(via[1]))
        bad = {**body, "max_tokens": 100000}  # beyond --max-model-len: vLLM's 400
        direct, via = _raw(f"{vllm}/chat/completions", bad), _raw(f"{access.base_url}/chat/completions", bad,
                                                                    access.api_key)
        assert direct[0] == via[0] == 400 and json.loads(direct[1]) == json.loads(via[1])
    (traj,) = job.read()
    calls = gens(traj)
    assert [c["status"] for c in calls] == ["ok", "ok", "error"]
    assert calls[2]["attributes"]["http.response.status_code"] == 400


def _events(text: str) -> list:
    """A streamed answer's events, each ``(its other lines, its data JSON-decoded)`` (``[DONE]`` as is)."""
    out = []
    for event in text.split("\n\n"):
        if event:
            lines = event.split("\n")
            data = "\n".join(x[6:] for x in lines if x.startswith("data: "))
            out.append(([x for x in lines if not x.startswith("data: ")],
                        data if data == "[DONE]" else json.loads(data)))
    return out


def _coalesced(events: list) -> list:
    """``_events``' list with each run of text deltas as one: vLLM merges the tokens a client has not
    read yet into one delta (its output collector aggregates), so two identical requests may split
    their text differently; ``sequence_number`` follows the split and is left out. That the gateway
    passes each event as it came is tests/test_gateway_wire.py's, against a deterministic upstream."""
    out: list = []
    for lines, data in events:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k != "sequence_number"}
            kind = data.get("type") or data.get("object")
            prev = out[-1][1] if out and isinstance(out[-1][1], dict) else None
            if prev is not None and (prev.get("type") or prev.get("object")) == kind and out[-1][0] == lines:
                if kind == "response.output_text.delta" and prev.get("item_id") == data.get("item_id"):
                    prev["delta"] += data["delta"]
                    prev["logprobs"] = (prev.get("logprobs") or []) + (data.get("logprobs") or [])
                    continue
                if (kind == "text_completion" and len(prev["choices"]) == len(data["choices"]) == 1
                        and prev["choices"][0]["finish_reason"] is None and not prev.get("usage")):
                    prev["choices"][0]["text"] += data["choices"][0]["text"]
                    prev["choices"][0]["finish_reason"] = data["choices"][0]["finish_reason"]
                    prev["choices"][0]["stop_reason"] = data["choices"][0].get("stop_reason")
                    prev["usage"] = data.get("usage")
                    continue
        out.append((lines, data))
    return out


def test_completions_and_responses_streams_event_for_event(job, vllm):
    """/v1/completions streams (vLLM sends an event per token, with empty text for a token that ends
    mid-character) and /v1/responses, whole and streamed: the client gets vLLM's answer through the
    gateway, which asked for ids (and logprobs) on its own behalf: the same events, the text deltas
    compared as runs (``_coalesced``)."""
    prompts = ["Écris « douze plus sept » en 日本語 :", "What is 3 + 4?"]
    with rtrace.rollout_context(step=1):
        access = rtrace.gateway_access()
        for prompt in prompts:
            body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "max_tokens": 16, "stream": True}
            direct = _raw(f"{vllm}/completions", body)
            via = _raw(f"{access.base_url}/completions", body, access.api_key)
            assert direct[0] == via[0] == 200
            assert _normal(_coalesced(_events(direct[1]))) == _normal(_coalesced(_events(via[1])))
        for stream in (False, True):
            body = {"model": MODEL_NAME, "instructions": SYSTEM, "input": "What is 12 + 7?", "temperature": 0,
                    "max_output_tokens": 40, "stream": stream}
            direct = _raw(f"{vllm}/responses", body)
            via = _raw(f"{access.base_url}/responses", body, access.api_key)
            assert direct[0] == via[0] == 200
            if stream:
                assert _normal(_coalesced(_events(direct[1]))) == _normal(_coalesced(_events(via[1])))
            else:
                assert _normal(json.loads(direct[1])) == _normal(json.loads(via[1]))
                assert json.loads(via[1])["output_messages"] is None  # what the gateway asked for, taken out
    (traj,) = job.read()
    calls = gens(traj)
    assert len(calls) == 4 and all(c["status"] == "ok" for c in calls)
    check_calls(vllm, traj)


def test_sdk_streams_are_recorded_whole(job, vllm):
    """The openai SDK closes a stream's connection as soon as it reads `data: [DONE]`, which can reach it
    before vLLM's body has ended: each stream is recorded whole (no error, no `incomplete` gap), its ids
    vLLM's (it was recorded cut in one stream of four)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 + 7?"}]
    texts = []
    with rtrace.rollout_context(step=8):
        access = rtrace.gateway_access()
        client = openai.OpenAI(base_url=access.base_url, api_key=access.api_key)
        for i in range(8):
            if i % 2:
                chunks = client.completions.create(model=MODEL_NAME, prompt="What is 3 + 4?", temperature=0,
                                                   max_tokens=8, stream=True)
                texts.append("".join(c.choices[0].text for c in chunks if c.choices))
            else:
                chunks = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                                        max_tokens=8, stream=True)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    (traj,) = job.read()
    calls = gens(traj)
    assert [c["status"] for c in calls] == ["ok"] * 8
    assert [c["output"].get("text", c["output"].get("content")) for c in calls] == texts
    check_calls(vllm, traj)
