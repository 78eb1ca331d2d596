"""The GenAI conventions on exported spans (rtrace/exporters/semconv.py through the one
conversion, rtrace/exporters/otel.py) and the rewards as MLflow assessments: what the
OTLP receiver and MLflow read back, exactly (docs/semconv.md)."""

from __future__ import annotations

import json

import pytest

import rtrace
import rtrace.testing
from rtrace.config import ConfigError
from rtrace.exporters import otel, semconv
from rtrace.trajectory import SpanRecord, Trajectory
from tests.otlp_receiver import OtlpHttpReceiver
from tests.servers import mlflow_server  # noqa: F401  (the session's real mlflow server)

TRACE = "0af7651916cd43dd8448eb211c80319c"
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 6 * 7?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"a": 6, "b": 7}'}}
ASK = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "c1", "name": "calc", "content": "42"}
ANSWER = {"role": "assistant", "content": "<think>6*7=42</think>The answer is 42."}


def _resource():
    from opentelemetry.sdk.resources import Resource

    return Resource.get_empty()


def trajectory(**kw) -> Trajectory:
    """A rollout root, two generations (given chat messages) and a tool call, with its conversation."""
    root = SpanRecord("a" * 16, None, "rollout", "rollout", 1, 90, attributes={"rl.step": 3})
    gen1 = SpanRecord("b" * 16, "a" * 16, "toy", "generation", 10, 20,
                      attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "toy",
                                  "gen_ai.response.finish_reasons": ["tool_calls"], "rtrace.message_index": 2},
                      input={"messages": [SYSTEM, USER], "temperature": 0.7}, output={"id": "resp-1", "model": "toy-v2"})
    tool = SpanRecord("c" * 16, "a" * 16, "calc", "tool", 30, 40,
                      attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc",
                                  "gen_ai.tool.call.id": "c1"},
                      input={"tool_call_id": "c1", "a": 6, "b": 7}, output=42)
    gen2 = SpanRecord("d" * 16, "a" * 16, "toy", "generation", 50, 60,
                      attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "toy",
                                  "gen_ai.response.finish_reasons": ["stop"], "rtrace.message_index": 4},
                      input={"messages": [SYSTEM, USER, ASK, RESULT]})
    kw.setdefault("messages", [SYSTEM, USER, ASK, RESULT, ANSWER])
    kw.setdefault("reward", 1.0)
    kw.setdefault("outcome", {"correct": True, "format": 0.5, "answer": "42"})
    return Trajectory(TRACE, "rollout", [root, gen1, tool, gen2], **kw)


PARTS = {
    "system": {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
    "user": {"role": "user", "parts": [{"type": "text", "content": "What is 6 * 7?"}]},
    "ask": {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "calc",
                                            "arguments": {"a": 6, "b": 7}}]},
    "result": {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "42"}]},
    "answer": {"role": "assistant", "parts": [{"type": "reasoning", "content": "6*7=42"},
                                              {"type": "text", "content": "The answer is 42."}]},
}


class TestGenAiSpans:
    def test_names_and_attributes_of_each_span(self):
        """invoke_agent / chat / execute_tool names; messages as typed parts; ids, model, request parameters."""
        spans = otel.to_readable_spans(trajectory(), _resource(), semconv="both")
        assert [s.name for s in spans] == ["invoke_agent rollout", "chat toy", "execute_tool calc", "chat toy"]
        root, gen1, tool, gen2 = (dict(s.attributes) for s in spans)
        assert {k: v for k, v in root.items() if k.startswith("gen_ai.")} == {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "rollout", "gen_ai.conversation.id": TRACE,
            "gen_ai.input.messages": json.dumps([PARTS["system"], PARTS["user"]], separators=(",", ":")),
            "gen_ai.output.messages": json.dumps([{**PARTS["answer"], "finish_reason": "stop"}],
                                                 separators=(",", ":"))}
        assert json.loads(gen1["gen_ai.input.messages"]) == [PARTS["system"], PARTS["user"]]
        assert json.loads(gen1["gen_ai.output.messages"]) == [{**PARTS["ask"], "finish_reason": "tool_calls"}]
        assert (gen1["gen_ai.response.id"], gen1["gen_ai.response.model"], gen1["gen_ai.request.temperature"],
                gen1["gen_ai.conversation.id"]) == ("resp-1", "toy-v2", 0.7, TRACE)
        assert json.loads(gen2["gen_ai.input.messages"]) == [PARTS[k] for k in ("system", "user", "ask", "result")]
        assert {k: v for k, v in tool.items() if k.startswith("gen_ai.")} == {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc", "gen_ai.tool.call.id": "c1",
            "gen_ai.tool.call.arguments": '{"a": 6, "b": 7}', "gen_ai.tool.call.result": "42"}
        # rtrace's names are still there in `both`
        assert gen1["rtrace.input"] and tool["rtrace.output"] == "42" and root["rtrace.kind"] == "rollout"

    def test_rewards_are_evaluation_events_on_the_root(self):
        """One gen_ai.evaluation.result per reward term: the total labelled with the verdict, each
        numeric / boolean component (strings stay rl.outcome.*); a tool's step reward on the tool."""
        traj = trajectory()
        traj.spans[2].attributes["rl.tool.reward"] = 0.25
        spans = otel.to_readable_spans(traj, _resource(), semconv="both")
        assert [(e.name, dict(e.attributes), e.timestamp) for e in spans[0].events] == [
            ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "reward", "gen_ai.evaluation.score.value": 1.0,
                                          "gen_ai.evaluation.score.label": "correct"}, 90),
            ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "correct", "gen_ai.evaluation.score.value": 1.0,
                                          "gen_ai.evaluation.score.label": "true"}, 90),
            ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "format",
                                          "gen_ai.evaluation.score.value": 0.5}, 90)]
        assert [dict(e.attributes) for e in spans[2].events] == [
            {"gen_ai.evaluation.name": "tool_reward", "gen_ai.evaluation.score.value": 0.25}]

    def test_a_failed_rollout_is_judged_error_with_its_explanation(self):
        traj = trajectory(reward=None, outcome={}, status="error", error="ZeroDivisionError: division by zero")
        traj.spans[0].status, traj.spans[0].error = "error", traj.error
        [root, *_] = otel.to_readable_spans(traj, _resource(), semconv="both")
        assert [dict(e.attributes) for e in root.events] == [
            {"gen_ai.evaluation.name": "reward", "gen_ai.evaluation.score.label": "error",
             "gen_ai.evaluation.explanation": "ZeroDivisionError: division by zero"}]
        assert root.attributes["error.type"] == "ZeroDivisionError"

    def test_nothing_judged_no_event(self):
        [root, *_] = otel.to_readable_spans(trajectory(reward=None, outcome={}), _resource(), semconv="both")
        assert list(root.events) == []

    def test_modes(self):
        """genai drops rtrace's copies; rtrace writes what rtrace wrote before; rl.* never changes."""
        both, genai, plain = (otel.to_readable_spans(trajectory(), _resource(), semconv=m)
                              for m in ("both", "genai", "rtrace"))
        assert [s.name for s in plain] == ["rollout", "toy", "calc", "toy"]
        assert all(not s.events for s in plain)
        assert not any(k.startswith("gen_ai.") and k not in ("gen_ai.operation.name", "gen_ai.request.model",
                                                              "gen_ai.response.finish_reasons", "gen_ai.tool.name",
                                                              "gen_ai.tool.call.id")
                       for s in plain for k in s.attributes)
        for b, g in zip(both, genai):
            dropped = set(b.attributes) - set(g.attributes)
            kind = b.attributes["rtrace.kind"]
            assert dropped == {k for k in semconv.DUPLICATES.get(kind, ()) if k in b.attributes}
        assert [{k: v for k, v in s.attributes.items() if k.startswith("rl.")} for s in both] == \
            [{k: v for k, v in s.attributes.items() if k.startswith("rl.")} for s in plain]
        with pytest.raises(ValueError, match="semconv"):
            otel.to_readable_spans(trajectory(), _resource(), semconv="otel")

    def test_the_provider_name(self):
        """gen_ai.provider.name, required on chat and invoke_agent: what a generation recorded (the
        gateway's upstream), else the root's, else RTRACE_GENAI_PROVIDER; on invoke_agent the root's,
        else the one its generations agree on, else the setting; never guessed, never on tools."""
        def provider(traj, semconv="both", setting=None):
            return [s.attributes.get("gen_ai.provider.name")
                    for s in otel.to_readable_spans(traj, _resource(), semconv=semconv, provider=setting)]

        assert provider(trajectory()) == [None] * 4  # not known, not set: not written
        assert provider(trajectory(), setting="sglang") == ["sglang", "sglang", None, "sglang"]
        assert provider(trajectory(), "rtrace", "sglang") == [None] * 4  # rtrace's names only
        traj = trajectory()
        for gen in (traj.spans[1], traj.spans[3]):
            gen.attributes["gen_ai.provider.name"] = "vllm"
        assert provider(traj, setting="sglang") == ["vllm", "vllm", None, "vllm"]  # what they recorded
        traj.spans[3].attributes["gen_ai.provider.name"] = "openai"  # they disagree: the root is the setting's
        assert provider(traj, setting="sglang") == ["sglang", "vllm", None, "openai"]
        assert provider(traj) == [None, "vllm", None, "openai"]
        traj = trajectory()
        traj.spans[0].attributes["gen_ai.provider.name"] = "vllm"  # the root's (an engine adapter's) own
        assert provider(traj, setting="sglang") == ["vllm", "vllm", None, "vllm"]

    def test_a_call_over_http_is_a_client_span(self):
        """A generation the capture gateway recorded (a call to a model server over HTTP) is a CLIENT span,
        in the SDK's spans and in the OTLP bytes; the rest (decorated generations included) INTERNAL."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.trace import SpanKind

        traj = trajectory()
        traj.spans[3].attributes["rtrace.gateway.join"] = "key"
        for mode in semconv.MODES:
            assert [s.kind for s in otel.to_readable_spans(traj, _resource(), semconv=mode)] == [
                SpanKind.INTERNAL, SpanKind.INTERNAL, SpanKind.INTERNAL, SpanKind.CLIENT]
            request = ExportTraceServiceRequest.FromString(otel.encode_request(traj, _resource(), semconv=mode))
            assert [s.kind for s in otel.otlp_spans(request)] == [1, 1, 1, 3]  # INTERNAL, CLIENT

    def test_the_setting_is_validated(self):
        with pytest.raises(ConfigError, match="RTRACE_SEMCONV"):
            rtrace.configure(exporter="none", semconv="openinference")
        with pytest.raises(ConfigError, match="RTRACE_GENAI_PROVIDER.*lower case"):
            rtrace.configure(exporter="none", genai_provider="my provider")
        assert rtrace.configure(exporter="none", genai_provider="AWS.Bedrock").genai_provider == "aws.bedrock"


class TestMessages:
    @pytest.mark.parametrize("message, parts", [
        # a tool's answer
        (RESULT, PARTS["result"]),
        # reasoning_content first, then the text
        ({"role": "assistant", "content": "42", "reasoning_content": "think"},
         {"role": "assistant", "parts": [{"type": "reasoning", "content": "think"}, {"type": "text", "content": "42"}]}),
        # OpenAI content parts: text joined, media as markers
        ({"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
         {"role": "user", "parts": [{"type": "text", "content": "look [image]"}]}),
        # nothing at all: one empty text part (parts is never empty)
        ({"role": "assistant", "content": None}, {"role": "assistant", "parts": [{"type": "text", "content": ""}]}),
        # arguments that are not JSON stay text; the participant's name is kept
        ({"role": "assistant", "content": "", "name": "bot",
          "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "not json"}}]},
         {"role": "assistant", "parts": [{"type": "tool_call", "id": "x", "name": "f", "arguments": "not json"}],
          "name": "bot"}),
    ])
    def test_message_parts(self, message, parts):
        assert semconv.message_parts(message) == parts
        assert json.loads(semconv.encode_message(message)) == parts

    @pytest.mark.parametrize("message", [
        SYSTEM, USER, RESULT, ANSWER, ASK,  # the shorter road (plain text, a tool's answer) and the others
        {"role": "assistant", "content": "<think>x"}, {"role": "tool", "tool_call_id": 7, "content": "1"},
        {"role": "tool", "tool_call_id": None, "content": "1", "name": "t"}, {"role": "user", "content": ""},
        {"role": "user", "content": "hi", "name": "ann"}, {"role": 5, "content": "x"}, "just text",
    ])
    def test_encode_message_is_the_json_of_message_parts(self, message):
        """The plain messages' shorter road gives the same text as the general one."""
        assert semconv.encode_message(message) == semconv._json(semconv.message_parts(message))

    @pytest.mark.parametrize("raw", ['{"a": 1}', ' {"a": [1, 2.5]}\n', "not json", '{"a": 1} tail', "", "NaN",
                                     "123456789012345678901234567890", '"\\ud800"', "\ufeff{}", "[1,"])
    def test_tool_arguments_are_read_as_json_loads_reads_them(self, raw):
        try:
            expected = json.loads(raw)
        except ValueError:
            expected = raw
        got = semconv._arguments(raw)
        assert got == expected or (got != got and expected != expected)  # NaN
        assert type(got) is type(expected)

    def test_input_messages_are_bounded_keeping_the_task_and_the_latest(self):
        encoded = [json.dumps({"n": i, "pad": "x" * 50}) for i in range(20)]
        kept = json.loads(semconv.input_messages(encoded, task=2, limit=400))
        assert [m["n"] for m in kept] == [0, 1, 17, 18, 19]  # ~71 chars each: 3 of the latest fit
        assert len(semconv.input_messages(encoded, 2, 10_000)) == sum(map(len, encoded)) + 21

    def test_each_message_is_encoded_once_per_trajectory(self, monkeypatch):
        """A generation's input is a prefix of the conversation: N turns cost N encodings."""
        calls = []
        real = semconv.encode_message
        monkeypatch.setattr(semconv, "encode_message", lambda m: calls.append(m) or real(m))
        otel.to_readable_spans(trajectory(), _resource(), semconv="both")
        assert len(calls) == 5  # the five messages, whatever the spans that show them


# ----------------------------------------------------------------------------- through the sinks
@rtrace.traced_generation(model="toy")
def generate(messages):
    return {"id": "resp-9", "content": "calc(6, 7)" if len(messages) == 1 else "42", "finish_reason": "stop"}


@rtrace.traced_tool
def calc(tool_call_id, a, b):
    return a * b


def _loop(step=1):
    with rtrace.rollout_context(step=step, sample_index=0, rollout_n=0) as ctx:
        messages = [USER]
        generate(list(messages))
        messages += [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": str(calc("c1", 6, 7))}]
        generate(list(messages))
        rtrace.record_reward(1.0, correct=True)
    return ctx.trace_id


def test_otlp_receiver_reads_the_genai_spans():
    """The OTLP sink sends the GenAI names, messages and evaluation events (RTRACE_SEMCONV=both), and
    the configured provider (RTRACE_GENAI_PROVIDER) on the chat and invoke_agent spans."""
    with OtlpHttpReceiver() as rx:
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url, export_interval_s=0.05, semconv="both",
                         genai_provider="vllm")
        trace_id = _loop()
        assert rtrace.flush(20)
        spans = {s.name: s for s in rx.wait_for_spans(4, 10)}
    assert sorted(spans) == ["chat toy", "execute_tool calc", "invoke_agent rollout"]
    root = spans["invoke_agent rollout"]
    assert root.attributes["gen_ai.conversation.id"] == trace_id
    assert root.attributes["gen_ai.provider.name"] == spans["chat toy"].attributes["gen_ai.provider.name"] == "vllm"
    assert "gen_ai.provider.name" not in spans["execute_tool calc"].attributes
    assert {s.kind for s in spans.values()} == {1}  # SPAN_KIND_INTERNAL: decorated calls, in the process
    assert [(e["name"], e["attributes"]["gen_ai.evaluation.name"]) for e in root.events] == [
        ("gen_ai.evaluation.result", "reward"), ("gen_ai.evaluation.result", "correct")]
    tool = spans["execute_tool calc"]
    assert (tool.attributes["gen_ai.tool.call.arguments"], tool.attributes["gen_ai.tool.call.result"]) == (
        '{"a": 6, "b": 7}', "42")


def test_mlflow_sink_writes_rewards_as_assessments(tmp_path):
    """Reward, verdict and components are MLflow assessments, searchable with feedback.<name>."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/m.db"
    rtrace.configure(exporter="mlflow", mlflow_tracking_uri=uri, project="assess", export_interval_s=0.05)
    trace_id = _loop(step=1)
    with rtrace.rollout_context(step=1, sample_index=1, rollout_n=0) as ctx:
        rtrace.record_reward(0.0, correct=False)
    assert rtrace.flush(60)
    assert rtrace.stats()["sink.mlflow.assessments"] == 6
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("assess").experiment_id
    got = {t.info.trace_id: {a.name: a.value for a in t.info.assessments}
           for t in client.search_traces(locations=[exp])}
    assert got == {"tr-" + trace_id: {"reward": 1.0, "verdict": "correct", "correct": True},
                   "tr-" + ctx.trace_id: {"reward": 0.0, "verdict": "wrong", "correct": False}}
    wrong = client.search_traces(locations=[exp], filter_string="feedback.verdict = 'wrong'")
    assert [t.info.trace_id for t in wrong] == ["tr-" + ctx.trace_id]
    assert [t.info.trace_id for t in client.search_traces(locations=[exp], filter_string="feedback.reward > 0.5")] \
        == ["tr-" + trace_id]


def test_rtrace_names_are_the_default():
    """RTRACE_SEMCONV is `rtrace` unless set: the GenAI conventions cost the OTLP sink ~1.4x its CPU."""
    from rtrace.config import load_settings

    assert load_settings({}, environ={}).semconv == "rtrace" == otel.DEFAULT_SEMCONV
    assert [s.name for s in otel.to_readable_spans(trajectory(), _resource())] == ["rollout", "toy", "calc", "toy"]


def test_mlflow_assessments_can_be_turned_off(tmp_path):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/m.db"
    rtrace.configure(exporter="mlflow", mlflow_tracking_uri=uri, project="off", export_interval_s=0.05,
                     mlflow_assessments=False)
    _loop()
    assert rtrace.flush(60)
    assert "sink.mlflow.assessments" not in rtrace.stats()


@pytest.mark.integration
def test_mlflow_server_gets_assessments_only_when_asked(mlflow_server, tmp_path):  # noqa: F811
    """Against a server, RTRACE_MLFLOW_ASSESSMENTS=auto writes none (one request each); true writes them."""
    from mlflow import MlflowClient

    for wanted, expected in (("auto", {}), (True, {"reward": 1.0, "verdict": "correct", "correct": True})):
        rtrace.configure(exporter="mlflow", mlflow_tracking_uri=mlflow_server, project=f"assess-{wanted}",
                         export_interval_s=0.05, mlflow_assessments=wanted)
        trace_id = _loop()
        assert rtrace.flush(60)
        stats = rtrace.stats()
        rtrace.testing.reset()
        assert stats.get("sink.mlflow.assessments", 0) == len(expected)
        trace = MlflowClient(tracking_uri=mlflow_server).get_trace("tr-" + trace_id)
        assert {a.name: a.value for a in trace.info.assessments} == expected
