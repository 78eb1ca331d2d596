"""OTLP sink: real OTLP receivers (HTTP/protobuf and gRPC, decoded with opentelemetry-proto),
a real MLflow server's /v1/traces, retries, an unreachable collector, and the compose stack files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rtrace
from rtrace.config import ConfigError, load_settings
from rtrace.exporters.jsonl import read_jsonl
from rtrace.exporters.otlp import traces_endpoint
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from tests.servers import free_port
from tests.test_collector_security import pki  # noqa: F401 - the fixture: a CA and certificates made here

ROOT = Path(__file__).resolve().parents[1]
UNSET, ERROR = 0, 2  # OTLP status codes


@pytest.fixture
def receiver():
    with OtlpHttpReceiver() as rx:
        yield rx


# ----------------------------------------------------------------------------- the agent
@rtrace.traced_generation(model="tiny-chat")
def generate(prompt_ids):
    return {"response_ids": [7, 8, 9], "finish_reason": "stop"}


@rtrace.traced_tool(tool_name="calculator")
def calculate(expression, tool_call_id=None):
    if expression == "1/0":
        raise ZeroDivisionError("division by zero")
    return {"value": eval(expression)}  # noqa: S307 (test input)


@rtrace.traced(kind="chain")
def parse(text):
    return [{"name": "calculator", "arguments": {"expression": text}}]


@rtrace.traced_rollout
def agent(question_ids):
    generate(question_ids)
    parse("2+2")
    calculate("2+2", tool_call_id="call-1")
    try:
        calculate("1/0", tool_call_id="call-2")
    except ZeroDivisionError:
        pass
    return "4"


def _run_one(step=1, sample_index=0):
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=2, group_id="q7",
                                policy_version=3, dataset="gsm8k"):
        agent([1, 2, 3])
        rtrace.record_reward(1.0, correct=True)


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("env, expected", [
    # base endpoint: /v1/traces is appended (OTel spec), trailing slash or not
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces"),
    # the traces endpoint is used as is and wins over the base
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:9999/custom"}, "http://b:9999/custom"),
    # nothing set: the SDK's default collector address
    ({}, "http://localhost:4318/v1/traces"),
    # gRPC: a host:port without scheme is plaintext
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"},
     "http://collector:4317"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"},
     "https://collector:4317"),
])
def test_endpoint_resolution(env, expected):
    """The traces endpoint follows the OTel spec from the standard environment variables."""
    assert traces_endpoint(load_settings({}, env)) == expected


def test_missing_exporter_package_names_the_extra():
    """Without the HTTP client the OTLP sink sends with (requests, which rtrace[otlp] installs),
    configure(exporter='otlp') raises ConfigError naming rtrace[otlp]."""
    code = textwrap.dedent("""
        import sys
        sys.modules["requests"] = None  # as if not installed
        import rtrace
        try:
            rtrace.configure(exporter="otlp")
        except rtrace.ConfigError as exc:
            print("ConfigError:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.startswith("ConfigError:") and "pip install 'rtrace[otlp]'" in out


# ----------------------------------------------------------------------------- HTTP receiver
def test_http_export_keeps_ids_tree_times_status_and_attributes(receiver, tmp_path, monkeypatch):
    """Spans sent over OTLP/HTTP equal the trajectory the JSONL sink wrote: ids, parents, times, status, events, rl.* and gen_ai.* attributes."""
    monkeypatch.setenv("RTRACE_EXPORTER", "otlp,jsonl")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=rl%20infra,authorization=Bearer abc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "grpo-driver")
    rtrace.configure(jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=0.05, experiment="run-7")
    _run_one(step=1, sample_index=4)
    assert rtrace.flush(20)
    [traj] = read_jsonl(tmp_path / "t.jsonl")
    got = {s.span_id: s for s in receiver.wait_for_spans(len(traj.spans), 10)}

    assert sorted(got) == sorted(s.span_id for s in traj.spans)
    by_name = {}
    for rec in traj.spans:
        span = got[rec.span_id]
        assert span.trace_id == traj.trace_id
        assert span.parent_span_id == rec.parent_id
        assert (span.name, span.start_ns, span.end_ns) == (rec.name, rec.start_ns, rec.end_ns)
        assert span.resource["service.name"] == "grpo-driver"
        assert span.scope == "rtrace"
        assert span.headers["x-team"] == "rl infra" and span.headers["authorization"] == "Bearer abc"
        by_name.setdefault(rec.name, []).append(span)

    rl = {"rl.step": 1, "rl.sample_index": 4, "rl.rollout_n": 2, "rl.group_id": "q7", "rl.policy_version": 3,
          "rl.validate": False, "rl.experiment": "run-7", "rl.extra.dataset": "gsm8k"}
    [root] = by_name["rollout"]
    assert root.parent_span_id is None
    assert root.attributes == {**rl, "rl.reward": 1.0, "rl.outcome.correct": True, "rtrace.kind": "rollout",
                               "rl.staleness": -2}
    [loop] = by_name["agent"]
    assert loop.parent_span_id == root.span_id
    assert loop.attributes == {**rl, "rtrace.kind": "agent", "rtrace.input": '{"question_ids": [1, 2, 3]}',
                               "rtrace.output": '"4"'}
    [gen] = by_name["tiny-chat"]  # a generation is named after its model, a tool after its tool
    assert gen.parent_span_id == loop.span_id
    assert gen.attributes == {**rl, "rtrace.kind": "generation", "gen_ai.operation.name": "chat",
                              "gen_ai.request.model": "tiny-chat", "gen_ai.usage.input_tokens": 3,
                              "gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": ["stop"],
                              "rtrace.input": "{}", "rtrace.output": '{"finish_reason": "stop"}',
                              "code.function.name": f"{__name__}.generate", "rtrace.message_index": 1, "rtrace.prompt_ids": [1, 2, 3],
                              "rtrace.response_ids": [7, 8, 9]}
    [chain] = by_name["parse"]
    assert chain.attributes["rtrace.kind"] == "chain" and chain.parent_span_id == loop.span_id
    assert json.loads(chain.attributes["rtrace.output"]) == [
        {"name": "calculator", "arguments": {"expression": "2+2"}}]
    ok, failed = sorted(by_name["calculator"], key=lambda s: s.start_ns)
    assert ok.attributes == {**rl, "rtrace.kind": "tool", "gen_ai.operation.name": "execute_tool",
                             "gen_ai.tool.name": "calculator", "gen_ai.tool.call.id": "call-1",
                             "code.function.name": f"{__name__}.calculate",
                             "rtrace.input": '{"expression": "2+2", "tool_call_id": "call-1"}',
                             "rtrace.output": '{"value": 4}'}
    assert (ok.status_code, failed.status_code) == (UNSET, ERROR)
    assert failed.status_message == "ZeroDivisionError: division by zero"
    assert [e["name"] for e in failed.events] == ["exception"]
    assert failed.events[0]["attributes"]["exception.type"] == "ZeroDivisionError"
    assert "rtrace.output" not in failed.attributes
    assert rtrace.stats()["sink.otlp.exported"] == 1


def test_token2text_text_travels_as_span_attributes(receiver):
    """With token2text on, generation spans carry rtrace.prompt_text / rtrace.response_text and no id lists."""
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    prompt, response = tok.encode("what is two plus two"), tok.encode("four")
    rtrace.configure(exporter="otlp", otlp_endpoint=receiver.base_url, export_interval_s=0.05,
                     token2text=True, tokenizer=tok)

    @rtrace.traced_generation
    def gen(prompt_ids):
        return response

    with rtrace.rollout_context(step=2):
        gen(prompt)
    assert rtrace.flush(20)
    [span] = [s for s in receiver.wait_for_spans(2, 10) if s.name.endswith("gen")]
    assert span.attributes["rtrace.prompt_text"] == "what is two plus two"
    assert span.attributes["rtrace.response_text"] == "four"
    assert "rtrace.prompt_ids" not in span.attributes and "rtrace.response_ids" not in span.attributes


def test_retryable_status_is_retried_then_delivered(receiver):
    """A 503 from the collector is retried with backoff and the batch is then delivered, not counted as failed."""
    receiver.fail_next(1, 503)
    rtrace.configure(exporter="otlp", otlp_endpoint=receiver.base_url, export_interval_s=0.05, otlp_timeout_s=10)
    _run_one()
    assert rtrace.flush(30)
    spans = receiver.wait_for_spans(6, 10)
    assert sorted(s.name for s in spans) == ["agent", "calculator", "calculator", "parse", "rollout", "tiny-chat"]
    stats = rtrace.stats()
    assert stats["sink.otlp.exported"] == 1 and "sink.otlp.failed_batches" not in stats


def test_non_primitive_attributes_become_json_text(receiver):
    """Outcome values that are not OTel attribute types arrive as JSON text, never dropped."""
    rtrace.configure(exporter="otlp", otlp_endpoint=receiver.base_url, export_interval_s=0.05)
    with rtrace.rollout_context(step=1):
        rtrace.record_reward(0.5, detail=[1, "two"], big=2**70)
    assert rtrace.flush(20)
    [root] = receiver.wait_for_spans(1, 10)
    # the builder stamps only valid attribute values on spans; the rest stay on the Trajectory
    assert root.attributes["rl.reward"] == 0.5
    from rtrace.exporters.otel import attributes as _attributes  # the one validity check

    assert _attributes({"a": {"k": 1}, "b": [1, "two"], "c": 2**70, "d": [1.5, 2.5], "e": None}) == {
        "a": '{"k": 1}', "b": '[1, "two"]', "c": str(2**70), "d": [1.5, 2.5]}


# ----------------------------------------------------------------------------- settings, passed explicitly
@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"])
def test_a_blank_certificate_variable_leaves_exports_alone(receiver, monkeypatch, var):
    """A blank OTEL_EXPORTER_OTLP_*CLIENT_* variable is unset for configure() (the OTel rule), and
    so for the exporter too: the TLS files are passed to it explicitly (before, it read the raw
    variable itself, loaded a certificate named '   ' and failed every export)."""
    monkeypatch.setenv(var, "   ")
    rtrace.configure(exporter="otlp", otlp_endpoint=receiver.base_url, export_interval_s=0.05, otlp_timeout_s=5)
    _run_one()
    assert rtrace.flush(30)
    assert len(receiver.wait_for_spans(6, 10)) == 6
    stats = rtrace.stats()
    assert stats["sink.otlp.exported"] == 1 and "sink.otlp.failed_batches" not in stats


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_tls_files_and_compression_from_configure_are_what_the_exporter_uses(protocol, pki, monkeypatch):
    """Mutual TLS to a real receiver (rtrace's own, a certificate from a CA made here): the CA,
    client certificate and key given to configure() are the ones the exporter uses, and so is
    the compression; variables configure() did not take (blank ones) change nothing."""
    from rtrace.pipeline.otlp_receiver import OtlpReceiver, TlsFiles

    for var in ("OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
                "OTEL_EXPORTER_OTLP_CLIENT_KEY", "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        monkeypatch.setenv(var, " ")
    spans = []
    tls = TlsFiles(str(pki / "server.pem"), str(pki / "server.key"), client_ca=str(pki / "ca.pem"))
    with OtlpReceiver(lambda request: spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans
                                                   for s in ss.spans), http_port=0, tls=tls) as rx:
        endpoint = rx.endpoint if protocol == "grpc" else rx.http_endpoint
        rtrace.configure(exporter="otlp", otlp_protocol=protocol, otlp_endpoint=endpoint, otlp_timeout_s=5,
                         otlp_certificate=str(pki / "ca.pem"), otlp_client_certificate=str(pki / "client.pem"),
                         otlp_client_key=str(pki / "client.key"), otlp_compression="gzip", export_interval_s=0.05)
        _run_one()
        assert rtrace.flush(30)
        assert sorted(s.name for s in spans) == ["agent", "calculator", "calculator", "parse", "rollout", "tiny-chat"]
    assert "sink.otlp.failed_batches" not in rtrace.stats()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_without_the_client_certificate_mutual_tls_refuses(protocol, pki):
    """The converse, so the test above can fail: without the client certificate the same receiver
    refuses, and the batch is counted as failed."""
    from rtrace.pipeline.otlp_receiver import OtlpReceiver, TlsFiles

    tls = TlsFiles(str(pki / "server.pem"), str(pki / "server.key"), client_ca=str(pki / "ca.pem"))
    with OtlpReceiver(lambda request: None, http_port=0, tls=tls) as rx:
        endpoint = rx.endpoint if protocol == "grpc" else rx.http_endpoint
        rtrace.configure(exporter="otlp", otlp_protocol=protocol, otlp_endpoint=endpoint, otlp_timeout_s=1,
                         otlp_certificate=str(pki / "ca.pem"), export_interval_s=0.05)
        _run_one()
        assert not rtrace.flush(30)
    assert rtrace.stats()["sink.otlp.failed_batches"] == 1


def test_http_compression_reaches_the_wire(receiver, monkeypatch):
    """OTEL_EXPORTER_OTLP_TRACES_COMPRESSION (read before OTEL_EXPORTER_OTLP_COMPRESSION) is the
    compression the exporter sends with."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "deflate")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    rtrace.configure(exporter="otlp", otlp_endpoint=receiver.base_url, export_interval_s=0.05)
    _run_one()
    assert rtrace.flush(30)
    assert {s.headers.get("content-encoding") for s in receiver.wait_for_spans(6, 10)} == {"gzip"}


# ----------------------------------------------------------------------------- gRPC
def test_grpc_protocol_sends_the_same_spans():
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc sends over OTLP/gRPC with headers as metadata."""
    with OtlpGrpcReceiver() as rx:
        rtrace.configure(exporter="otlp", otlp_protocol="grpc", otlp_endpoint=rx.address,
                         otlp_headers={"x-tenant": "rl"}, export_interval_s=0.05)
        _run_one(step=5, sample_index=1)
        assert rtrace.flush(20)
        spans = rx.wait_for_spans(6, 10)
    assert sorted(s.name for s in spans) == ["agent", "calculator", "calculator", "parse", "rollout", "tiny-chat"]
    assert {s.attributes["rl.step"] for s in spans} == {5}
    assert {s.headers.get("x-tenant") for s in spans} == {"rl"}
    [root] = [s for s in spans if s.name == "rollout"]
    assert all(s.parent_span_id for s in spans if s is not root)


# ----------------------------------------------------------------------------- collector down
DOWN_SCRIPT = textwrap.dedent("""
    import json, rtrace
    @rtrace.traced_tool
    def tool(x):
        return x
    for i in range(40):
        with rtrace.rollout_context(step=1, sample_index=i):
            tool(i)
    rtrace.flush(5)
    rtrace.shutdown()
    print(json.dumps(rtrace.stats()))
""")


def test_unreachable_collector_bounded_and_counted(tmp_path):
    """With nothing listening, the program still finishes and every trajectory is counted as failed or dropped."""
    port = free_port()  # nothing listens there
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RTRACE_EXPORTER": "otlp",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
           "RTRACE_SINK_TIMEOUT_S": "5", "RTRACE_EXPORT_INTERVAL_S": "0.05", "RTRACE_MAX_EXPORT_BATCH_SIZE": "8"}
    # The bound: the run must end well inside this (a hang fails the test with TimeoutExpired).
    proc = subprocess.run([sys.executable, "-c", DOWN_SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["trajectories_completed"] == 40
    assert "sink.otlp.exported" not in stats
    lost = stats.get("sink.otlp.failed_trajectories", 0) + stats.get("sink.otlp.dropped_trajectories", 0)
    # batches still queued when shutdown's deadline passed are neither sent nor counted as
    # failed: they are what is left of the 40
    assert 0 < lost <= 40 and stats.get("sink.otlp.failed_batches", 0) >= 1


# ----------------------------------------------------------------------------- MLflow server
@pytest.mark.integration
def test_export_to_mlflow_server_otlp_endpoint(mlflow_server, tmp_path, monkeypatch):
    """Sent to a real MLflow server's /v1/traces, the trajectory is found by mlflow.search_traces with its span tree and rl.* attributes."""
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    experiment_id = mlflow.create_experiment(f"otlp-{tmp_path.name}")
    monkeypatch.setenv("RTRACE_EXPORTER", "otlp,jsonl")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{mlflow_server}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-mlflow-experiment-id={experiment_id}")
    rtrace.configure(jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=0.05)
    _run_one(step=1, sample_index=9)
    assert rtrace.flush(60)
    assert rtrace.stats()["sink.otlp.exported"] == 1
    [traj] = read_jsonl(tmp_path / "t.jsonl")

    traces = mlflow.search_traces(locations=[experiment_id], return_type="list")
    assert len(traces) == 1
    trace = traces[0]
    spans = {s.span_id: s for s in trace.data.spans}
    assert sorted(spans) == sorted(s.span_id for s in traj.spans)
    for rec in traj.spans:
        span = spans[rec.span_id]
        assert span.name == rec.name
        assert span.parent_id == rec.parent_id
        assert span.get_attribute("rl.step") == 1 and span.get_attribute("rl.sample_index") == 9
        assert span.get_attribute("rtrace.kind") == rec.kind
    [tool] = [s for s in trace.data.spans if s.get_attribute("gen_ai.tool.call.id") == "call-1"]
    assert tool.get_attribute("gen_ai.tool.name") == "calculator"


# ----------------------------------------------------------------------------- compose stack
def _yaml(path):
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


def test_compose_and_collector_config_are_consistent():
    """docker-compose.yml and the collector config parse, mount files that exist, publish on 127.0.0.1 only,
    bind receivers to 0.0.0.0, use no removed exporters, and have a health check per service."""
    compose = _yaml(ROOT / "docker-compose.yml")
    services = compose["services"]
    assert {"otel-collector", "jaeger", "mlflow"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc and svc["healthcheck"]["test"], name
        for port in svc.get("ports", []):
            assert re.fullmatch(r"127\.0\.0\.1:\d+:\d+", str(port)), (name, port)
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).resolve().exists(), (name, source)
            else:  # a named volume must be declared
                assert source in (compose.get("volumes") or {}), (name, source)
    assert "4317" in str(services["otel-collector"]["ports"]) and "4318" in str(services["otel-collector"]["ports"])

    collector = _yaml(ROOT / "deploy" / "otel-collector.yaml")
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    exporters = collector["exporters"]
    names = {key.split("/")[0] for key in exporters}
    assert not names & {"jaeger", "logging"}
    assert {"otlp", "otlphttp", "debug"} <= names
    mlflow = next(v for k, v in exporters.items() if k.startswith("otlphttp"))
    assert "x-mlflow-experiment-id" in mlflow["headers"]
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "batch" in pipeline["processors"]
    assert set(pipeline["exporters"]) <= set(exporters)
    assert set(pipeline["processors"]) <= set(collector["processors"])
    # the exporters point at the compose services by name
    hosts = {re.sub(r"^https?://", "", v["endpoint"]).split(":")[0] for v in exporters.values() if "endpoint" in v}
    assert hosts <= set(services)
