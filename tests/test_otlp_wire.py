"""The OTLP sink's own encoder (rtrace/exporters/otlp_wire.py through otel.encode_request)
against the OTel SDK's OTLP encoder, and its own transport (otlp_transport.py) against real
in-process OTLP receivers: the same bytes for the same spans, and the same spans received."""

from __future__ import annotations

import math

import pytest

import rtrace
from rtrace.exporters import otel, otlp_wire
from rtrace.testing import MemorySink, reset
from rtrace.trajectory import SpanRecord, Trajectory
from tests import semconv_job
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, any_value

encode_spans = pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder").encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: E402

MODES = ("rtrace", "both", "genai")
RESOURCE = Resource.create({"service.name": "wire-test", "deployment.environment": "ci", "host.cores": 2})
SCOPE = InstrumentationScope("rtrace", "9.9.9")


def sdk_bytes(trajectories, mode, resource=RESOURCE, scope=SCOPE, max_value_chars=otel.DEFAULT_MAX_VALUE_CHARS):
    """What the OTel SDK's OTLP encoder makes of the one conversion's ReadableSpans."""
    spans = otel.to_readable_spans(trajectories, resource, scope, max_value_chars, mode)
    return encode_spans(spans).SerializeToString()


@pytest.fixture(scope="module")
def feature_trajectories(tok):
    """The feature trajectories of tests/semconv_job.py (tools, rewards, errors, a segment,
    a tensor batch, annotations, health findings, reasoning, token ids...), in memory."""
    sink = MemorySink()
    rtrace.configure(sinks=[sink], token2text=True, tokenizer=tok, experiment="exp-1", export_interval_s=0.02)
    try:
        semconv_job.run(tok)
        assert rtrace.flush(60)
    finally:
        reset()
    return sink.trajectories


def odd_trajectory() -> Trajectory:
    """Values at the edges of every rule: int64 bounds and negatives, non-finite floats,
    empty and non-ASCII text, lone surrogates, homogeneous and mixed lists, empty lists,
    tuples, nested maps (JSON text), zero times, an error without text, a remote parent,
    events without attributes or time."""
    attrs = {"i.min": -(2**63), "i.max": 2**63 - 1, "i.neg": -1, "i.zero": 0, "i.big": 2**64, "f.nan": math.nan,
             "f.inf": -math.inf, "f.zero": 0.0, "f.neg": -0.0, "b.f": False, "s.empty": "", "s.uni": "é—😀\u2028",
             "s.surrogate": "a\ud800b", "l.int": [1, -2, 2**62], "l.str": ["x", "", "ü"], "l.bool": [True, False],
             "l.float": [1.5, math.nan], "l.empty": [], "l.mixed": [1, "two"], "t.tuple": ("a", "b"),
             "m.map": {"k": [1, {"n": None}]}, "none": None, "rtrace.remote_parent": "ab" * 8}
    root = SpanRecord("1" * 16, None, "seg\ud800ment", "segment", 0, 0, attributes=attrs,
                      events=[{"name": "plain"}, {"name": "", "time_ns": 5, "attributes": {"x": [1, 2], "y": "z"}},
                              {"name": "exception", "attributes": {"exception.type": "KeyError"}}])
    child = SpanRecord("2" * 16, "1" * 16, "", "tool", 10, 5, status="error", error="",
                       attributes={"gen_ai.tool.name": "t"}, input={"q": "é"}, output=None)
    failed = SpanRecord("3" * 16, "1" * 16, "gen", "generation", 7, 9, status="error",
                        error="ValueError: bad \ud800", attributes={"gen_ai.request.model": "m",
                                                                  "rtrace.gateway.join": "key"},  # CLIENT
                        prompt_ids=[1, 2, 3], response_ids=[])
    return Trajectory("f" * 32, "segment", [root, child, failed], reward=math.nan, outcome={"ok": True})


@pytest.mark.parametrize("mode", MODES)
def test_the_same_bytes_as_the_sdk_encoder(feature_trajectories, mode):
    """encode_request writes, byte for byte, the request the SDK's encoder makes of the same
    spans: every feature trajectory, in each RTRACE_SEMCONV mode."""
    spans = [s for t in feature_trajectories for s in t.spans]
    assert any(s.status == "error" for s in spans) and any(s.events for s in spans)
    assert any(t.spans[0].attributes.get("rtrace.remote_parent") for t in feature_trajectories)  # a segment
    wire = otel.encode_request(feature_trajectories, RESOURCE, SCOPE, semconv=mode)
    assert wire == sdk_bytes(feature_trajectories, mode)
    # and one trajectory at a time, with a small max_value_chars (truncated values)
    for traj in feature_trajectories:
        assert otel.encode_request(traj, RESOURCE, SCOPE, 40, mode) == sdk_bytes([traj], mode, max_value_chars=40)


@pytest.mark.parametrize("mode", MODES)
def test_odd_values_are_written_as_the_sdk_writes_them(mode):
    """Edge values (module docstring of odd_trajectory) give the SDK encoder's bytes."""
    traj = odd_trajectory()
    wire = otel.encode_request([traj], RESOURCE, SCOPE, semconv=mode)
    assert wire == sdk_bytes([traj], mode)
    spans = otel.otlp_spans(ExportTraceServiceRequest.FromString(wire))
    assert spans[0].flags == 0x300 and spans[0].parent_span_id.hex() == "ab" * 8  # remote parent
    assert "?" in spans[0].name and spans[2].status.message == "ValueError: bad ?"


def test_what_the_sdk_encoder_cannot_encode_is_still_readable():
    """A key or event name with a lone surrogate (which the SDK encoder drops, or fails the
    request on) is written with '?' in its place: protobuf parsers refuse invalid UTF-8."""
    rec = SpanRecord("1" * 16, None, "root", "rollout", 1, 2, attributes={"k\ud800": 1},
                     events=[{"name": "e\udfff", "attributes": {"a\ud800": "v"}}])
    spans = otel.otlp_spans(ExportTraceServiceRequest.FromString(
        otel.encode_request(Trajectory("e" * 32, "root", [rec]), RESOURCE, SCOPE)))
    assert {kv.key: any_value(kv.value) for kv in spans[0].attributes}["k?"] == 1
    assert spans[0].events[0].name == "e?" and spans[0].events[0].attributes[0].key == "a?"


@pytest.mark.parametrize("value", [
    0, 1, 127, 128, 16383, 16384, 2**63 - 1, -1, -(2**63), 0.0, -2.5, math.inf, True, False, "", "x" * 200,
    "é", [], [1, 2], ["a"], (1.5,), [[1], ["x"]], {"k": "v", "n": [None, 1]}, {}, None, b"\x00\xff",
])
def test_any_value(value):
    """otlp_wire.any_value is the SDK's AnyValue for each kind of value it takes (read from
    the SDK encoder's output for a span holding it as its one attribute)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    span = ReadableSpan("s", SpanContext(1, 1, False), resource=RESOURCE, attributes={"v": value})
    [proto] = otel.otlp_spans(encode_spans([span]))
    assert otlp_wire.any_value(value) == proto.attributes[0].value.SerializeToString()


def test_empty_batch_is_the_empty_request():
    assert otel.encode_request([], RESOURCE, SCOPE) == b"" == sdk_bytes([], "both")


# ----------------------------------------------------------------------------- through receivers
def _decoded(proto_span) -> dict:
    return {"trace_id": proto_span.trace_id.hex(), "span_id": proto_span.span_id.hex(),
            "parent": proto_span.parent_span_id.hex() or None, "name": proto_span.name, "kind": proto_span.kind,
            "start": proto_span.start_time_unix_nano, "end": proto_span.end_time_unix_nano,
            "status": (proto_span.status.code, proto_span.status.message), "flags": proto_span.flags,
            "attributes": {kv.key: any_value(kv.value) for kv in proto_span.attributes},
            "events": [(e.name, e.time_unix_nano, {kv.key: any_value(kv.value) for kv in e.attributes})
                       for e in proto_span.events]}


def _received(span) -> dict:
    return {"trace_id": span.trace_id, "span_id": span.span_id, "parent": span.parent_span_id, "name": span.name,
            "kind": span.kind, "start": span.start_ns, "end": span.end_ns,
            "status": (span.status_code, span.status_message), "flags": span.flags, "attributes": span.attributes,
            "events": [(e["name"], e["time_ns"], e["attributes"]) for e in span.events]}


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_sink_sends_what_the_sdk_encoder_makes(tok, protocol):
    """The otlp sink, to a real in-process receiver (RTRACE_SEMCONV=both): every span it
    received (name, ids, times, status, flags, attributes, events, and its protobuf bytes)
    is what the SDK's encoder makes of the same trajectories, and the resource is the sink's."""
    memory = MemorySink()
    receiver = OtlpGrpcReceiver() if protocol == "grpc" else OtlpHttpReceiver()
    with receiver as rx:
        endpoint = rx.address if protocol == "grpc" else rx.base_url
        rtrace.configure(exporter="otlp", otlp_protocol=protocol, otlp_endpoint=endpoint, sinks=[memory],
                         semconv="both", token2text=True, tokenizer=tok, service_name="wire-svc",
                         export_interval_s=0.02)
        semconv_job.run(tok)
        assert rtrace.flush(60)
        trajectories = memory.trajectories
        n = sum(len(t.spans) for t in trajectories)
        got = rx.wait_for_spans(n, 20)
    assert len(got) == n and n > 30
    assert {s.resource["service.name"] for s in got} == {"wire-svc"} and {s.scope for s in got} == {"rtrace"}
    expected = otel.otlp_spans(ExportTraceServiceRequest.FromString(sdk_bytes(trajectories, "both")))
    by_id = {s.span_id: s for s in got}
    for want in expected:
        span = by_id[want.span_id.hex()]
        assert _received(span) == _decoded(want)
        assert span.proto == want.SerializeToString()
    stats = rtrace.stats()
    assert stats["sink.otlp.exported"] == len(trajectories) and "sink.otlp.failed_batches" not in stats


# ----------------------------------------------------------------------------- retries
def _one_rollout():
    @rtrace.traced_tool
    def tool(x):
        return x

    with rtrace.rollout_context(step=1, sample_index=0):
        tool(1)


def test_http_retry_after_is_the_delay_waited():
    """A 429 naming its delay (Retry-After: 0) is retried after that delay: within a 0.5 s
    timeout, where the default backoff (1 s +- 20 %) would have given up."""
    with OtlpHttpReceiver() as rx:
        rx.fail_next(2, 429, retry_after="0")
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url, otlp_timeout_s=0.5, export_interval_s=0.02)
        _one_rollout()
        assert rtrace.flush(20)
        assert len(rx.wait_for_spans(2, 10)) == 2
    stats = rtrace.stats()
    assert stats["sink.otlp.exported"] == 1 and "sink.otlp.failed_batches" not in stats


def test_a_server_that_keeps_naming_no_delay_is_asked_six_times():
    """Attempts are bounded (6, the SDK exporters' number): a server answering 429 with
    Retry-After: 0 again and again is not asked until the timeout; the batch is counted."""
    with OtlpHttpReceiver() as rx:
        rx.fail_next(20, 429, retry_after="0")
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url, otlp_timeout_s=30, export_interval_s=0.02)
        _one_rollout()
        assert not rtrace.flush(20)
        assert rx.failures_left() == 14 and rx.spans == []
    assert rtrace.stats()["sink.otlp.failed_batches"] == 1


def test_closing_ends_a_retry_wait():
    """shutdown() (the sender's close) ends a retry's wait at once: a request told to come
    back in 20 s gives up as soon as the sender is closed, and raises."""
    import threading

    from rtrace.exporters.otlp_transport import ExportFailed, HttpSender

    with OtlpHttpReceiver() as rx:
        rx.fail_next(1, 503, retry_after="20")
        sender = HttpSender(rx.traces_url, {}, timeout_s=30)
        outcome = []

        def send():
            try:
                sender.send(otel.encode_request(odd_trajectory(), RESOURCE, SCOPE))
            except ExportFailed as exc:
                outcome.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        for _ in range(1000):  # (bounded) until the first attempt was answered: the sender then waits
            if not rx.failures_left():
                break
            thread.join(0.01)
        sender.close()
        thread.join(10)  # (bounded: without close() it would wait 20 s)
        assert not thread.is_alive() and len(outcome) == 1 and rx.spans == []


def test_http_without_a_named_delay_backs_off_within_the_timeout():
    """The converse: a 503 without Retry-After waits the default backoff, which does not fit
    in a 0.5 s timeout: the batch fails and is counted."""
    with OtlpHttpReceiver() as rx:
        rx.fail_next(1, 503)
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url, otlp_timeout_s=0.5, export_interval_s=0.02)
        _one_rollout()
        assert not rtrace.flush(20)
        assert rx.spans == []
    assert rtrace.stats()["sink.otlp.failed_batches"] == 1


def test_http_client_errors_are_not_retried():
    """A 400 is final: counted as failed at once, not sent again."""
    with OtlpHttpReceiver() as rx:
        rx.fail_next(1, 400)
        rtrace.configure(exporter="otlp", otlp_endpoint=rx.base_url, otlp_timeout_s=5, export_interval_s=0.02)
        _one_rollout()
        assert not rtrace.flush(20)
        _one_rollout()  # the next batch is delivered
        assert rtrace.flush(20)
        assert len(rx.wait_for_spans(2, 10)) == 2
    stats = rtrace.stats()
    assert stats["sink.otlp.failed_batches"] == 1 and stats["sink.otlp.exported"] == 1


def test_grpc_resource_exhausted_waits_the_retry_info_delay():
    """gRPC push-back (RESOURCE_EXHAUSTED with RetryInfo 0.05 s, as an rtrace collector
    answers) is retried after the named delay, within a 0.5 s timeout; a code that is not
    retryable (INVALID_ARGUMENT) fails the batch."""
    import grpc

    with OtlpGrpcReceiver() as rx:
        rx.fail_next(2, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_delay_s=0.05)
        rtrace.configure(exporter="otlp", otlp_protocol="grpc", otlp_endpoint=rx.address, otlp_timeout_s=0.5,
                         export_interval_s=0.02)
        _one_rollout()
        assert rtrace.flush(20)
        assert len(rx.wait_for_spans(2, 10)) == 2
        rx.fail_next(1, grpc.StatusCode.INVALID_ARGUMENT)
        _one_rollout()
        assert not rtrace.flush(20)
    stats = rtrace.stats()
    assert stats["sink.otlp.exported"] == 1 and stats["sink.otlp.failed_batches"] == 1
