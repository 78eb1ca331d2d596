"""The collector's OTLP receiver (rtrace/pipeline/otlp_receiver.py), fed by the real OTel SDK
exporters over gRPC and HTTP on 127.0.0.1: exact spans, every AnyValue type, concurrent
clients without loss, callback errors, backpressure, partial success, bounded stop."""

from __future__ import annotations

import gzip
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from rtrace.pipeline.otlp_receiver import (
    Backpressure,
    OtlpReceiver,
    PartialSuccess,
    any_value,
    attributes,
    count_spans,
    spans_of,
)

WAIT_S = 30.0  # the bound on every wait; nothing here measures time


class Collected:
    """An on_request callback that keeps every request (and how many ran at once)."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.cond = threading.Condition()
        self.running = 0
        self.max_running = 0

    def __call__(self, request: ExportTraceServiceRequest) -> None:
        with self.cond:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            with self.cond:
                self.requests.append(request)
                self.cond.notify_all()
        finally:
            with self.cond:
                self.running -= 1

    def spans(self) -> list[tuple[dict, str, object]]:
        with self.cond:
            return [item for req in self.requests for item in spans_of(req)]

    def wait_spans(self, n: int) -> list[tuple[dict, str, object]]:
        with self.cond:
            self.cond.wait_for(lambda: sum(count_spans(r) for r in self.requests) >= n, WAIT_S)
        return self.spans()


@pytest.fixture
def collected():
    return Collected()


@pytest.fixture
def receiver(collected):
    with OtlpReceiver(collected, http_port=0) as rx:
        yield rx


def grpc_exporter(rx: OtlpReceiver, timeout: float = 10) -> GrpcExporter:
    return GrpcExporter(endpoint=f"http://{rx.endpoint}", insecure=True, timeout=timeout)


def http_exporter(rx: OtlpReceiver, timeout: float = 10, **kw) -> HttpExporter:
    return HttpExporter(endpoint=rx.http_endpoint + "/v1/traces", timeout=timeout, **kw)


def raw_stub(rx: OtlpReceiver):
    channel = grpc.insecure_channel(rx.endpoint)
    return channel, trace_service_pb2_grpc.TraceServiceStub(channel)


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


# ----------------------------------------------------------------------------- helpers
def test_any_value_decodes_every_type():
    """any_value: string, bool, int, double, bytes, array, kvlist (nested), empty -> None."""
    kv = KeyValueList(values=[KeyValue(key="a", value=AnyValue(int_value=1)),
                              KeyValue(key="b", value=AnyValue(array_value=ArrayValue(values=[
                                  AnyValue(bytes_value=b"\x00"), AnyValue(kvlist_value=KeyValueList())])))])
    cases = [(AnyValue(string_value="héllo"), "héllo"), (AnyValue(string_value=""), ""),
             (AnyValue(bool_value=False), False), (AnyValue(int_value=-2**63), -2**63),
             (AnyValue(double_value=-0.5), -0.5), (AnyValue(bytes_value=b"\x00\xff"), b"\x00\xff"),
             (AnyValue(array_value=ArrayValue()), []), (AnyValue(kvlist_value=kv), {"a": 1, "b": [b"\x00", {}]}),
             (AnyValue(), None)]
    for value, expected in cases:
        got = any_value(value)
        assert got == expected and type(got) is type(expected), (value, got)
    assert attributes([KeyValue(key="x", value=AnyValue(bool_value=True))]) == {"x": True}


# ----------------------------------------------------------------------------- gRPC
def _make_sdk_spans(processor) -> dict[str, object]:
    """A small trajectory made with the real SDK: rollout -> generate (event), tool (error)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "rollout-worker-3", "worker.rank": 3}))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("rtrace", "0.1.0")
    with tracer.start_as_current_span("rollout", attributes={
            "rl.step": 7, "rl.validate": False, "rl.reward": 0.25, "rl.group_id": "p17",
            "ids": [1, 2, 3], "names": ["a", "b"], "flags": [True, False], "scores": [0.5, 1.5]}) as root:
        with tracer.start_as_current_span("generate", kind=SpanKind.CLIENT) as gen:
            gen.add_event("first_token", {"ttft_ms": 12.5, "token": "Hi"})
            gen.set_attribute("gen_ai.usage.output_tokens", 4)
        with tracer.start_as_current_span("tool", record_exception=True, set_status_on_exception=True) as tool:
            try:
                raise ZeroDivisionError("division by zero")
            except ZeroDivisionError as exc:
                tool.record_exception(exc)
                tool.set_status(Status(StatusCode.ERROR, "ZeroDivisionError: division by zero"))
    provider.shutdown()
    return {"rollout": root, "generate": gen, "tool": tool}


def _assert_same_spans(sdk: dict[str, object], got: list[tuple[dict, str, object]]) -> None:
    by_name = {span.name: (resource, scope, span) for resource, scope, span in got}
    assert sorted(by_name) == ["generate", "rollout", "tool"] and len(got) == 3
    trace_id = _hex(sdk["rollout"].context.trace_id, 32)
    for name, sdk_span in sdk.items():
        resource, scope, span = by_name[name]
        assert resource["service.name"] == "rollout-worker-3" and resource["worker.rank"] == 3
        assert scope == "rtrace"
        assert span.trace_id.hex() == trace_id
        assert span.span_id.hex() == _hex(sdk_span.context.span_id, 16)
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (sdk_span.start_time, sdk_span.end_time)
    root, gen, tool = (by_name[n][2] for n in ("rollout", "generate", "tool"))
    assert root.parent_span_id == b""
    assert gen.parent_span_id.hex() == tool.parent_span_id.hex() == root.span_id.hex()
    assert attributes(root.attributes) == {
        "rl.step": 7, "rl.validate": False, "rl.reward": 0.25, "rl.group_id": "p17",
        "ids": [1, 2, 3], "names": ["a", "b"], "flags": [True, False], "scores": [0.5, 1.5]}
    assert attributes(gen.attributes) == {"gen_ai.usage.output_tokens": 4}
    assert gen.kind == 3 and root.kind == 1  # SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL
    [event] = gen.events
    assert (event.name, attributes(event.attributes)) == ("first_token", {"ttft_ms": 12.5, "token": "Hi"})
    assert event.time_unix_nano == sdk["generate"].events[0].timestamp
    assert (root.status.code, gen.status.code) == (0, 0)  # UNSET
    assert (tool.status.code, tool.status.message) == (2, "ZeroDivisionError: division by zero")
    [exc_event] = tool.events
    assert exc_event.name == "exception"
    exc_attrs = attributes(exc_event.attributes)
    assert (exc_attrs["exception.type"], exc_attrs["exception.message"]) == ("ZeroDivisionError", "division by zero")


def test_grpc_receives_sdk_spans_exactly(receiver, collected):
    """Spans from the SDK's gRPC exporter arrive with their ids, parents, times, attributes, events, status, resource and scope."""
    sdk = _make_sdk_spans(SimpleSpanProcessor(grpc_exporter(receiver)))
    _assert_same_spans(sdk, collected.wait_spans(3))
    stats = receiver.stats()
    assert stats["requests"] == 3 and stats["accepted_spans"] == 3  # SimpleSpanProcessor: one request a span
    assert stats["failed_requests"] == stats["backpressure_requests"] == stats["invalid_requests"] == 0
    assert receiver.endpoint.startswith("127.0.0.1:") and receiver.http_endpoint.startswith("http://127.0.0.1:")


def test_every_any_value_type_travels(receiver, collected):
    """kvlists, bytes, mixed arrays, empty values and int64 limits, as the SDK encodes them, decode to the same Python values."""
    values = {"s": "naïve ✓", "empty": "", "t": True, "imin": -2**63, "imax": 2**63 - 1, "d": 1e300,
              "inf": float("inf"), "raw": b"\x00\x01\xfe", "mixed": [1, "two", 3.5, False, b"x"],
              "nothing": [], "kv": {"k": 1, "nested": {"list": [{"deep": "yes"}], "b": b""}}}
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = SpanContext(trace_id, 0xB7AD6B7169203331, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    linked = SpanContext(0x1, 0x2, is_remote=True)
    span = ReadableSpan(
        name="all-values", context=ctx, parent=parent, resource=Resource.create({"service.name": "typed"}),
        attributes=values, events=[Event("e", {"kv": {"a": [1, 2]}}, timestamp=1_000)],
        links=[Link(linked, {"why": "follows"})], kind=SpanKind.INTERNAL, status=Status(StatusCode.OK),
        start_time=1_000, end_time=2_000, instrumentation_scope=InstrumentationScope("typed-scope"))
    assert grpc_exporter(receiver).export([span]) is SpanExportResult.SUCCESS
    [(resource, scope, got)] = collected.wait_spans(1)
    assert (resource["service.name"], scope) == ("typed", "typed-scope")
    assert got.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and got.span_id.hex() == "00f067aa0ba902b7"
    assert got.parent_span_id.hex() == "b7ad6b7169203331"
    assert attributes(got.attributes) == values
    assert [(e.name, e.time_unix_nano, attributes(e.attributes)) for e in got.events] == [("e", 1_000, {"kv": {"a": [1, 2]}})]
    [link] = got.links
    assert (link.trace_id.hex(), link.span_id.hex(), attributes(link.attributes)) == (
        _hex(1, 32), _hex(2, 16), {"why": "follows"})
    assert (got.status.code, got.start_time_unix_nano, got.end_time_unix_nano) == (1, 1_000, 2_000)


def test_concurrent_clients_lose_nothing(collected):
    """4 client threads x 500 SDK spans (BatchSpanProcessor, own exporter each) arrive exactly once; at most max_workers callbacks run at once."""
    threads, per_thread = 4, 500
    with OtlpReceiver(collected, max_workers=2) as rx:
        def client(t: int) -> None:
            provider = TracerProvider(resource=Resource.create({"client": t}))
            provider.add_span_processor(BatchSpanProcessor(grpc_exporter(rx), max_export_batch_size=64,
                                                           schedule_delay_millis=20))
            tracer = provider.get_tracer("load")
            for i in range(per_thread):
                with tracer.start_as_current_span(f"s-{t}-{i}", attributes={"t": t, "i": i}):
                    pass
            assert provider.force_flush(int(WAIT_S * 1000))
            provider.shutdown()

        workers = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(WAIT_S)
        assert not any(w.is_alive() for w in workers)
        got = collected.wait_spans(threads * per_thread)
        stats = rx.stats()
    assert len(got) == threads * per_thread
    seen = [(resource["client"], attributes(span.attributes)["i"]) for resource, _, span in got]
    assert sorted(seen) == [(t, i) for t in range(threads) for i in range(per_thread)]
    assert all(span.name == f"s-{t}-{i}" for (t, i), (_, _, span) in zip(seen, got))
    assert len({span.span_id for _, _, span in got}) == threads * per_thread
    assert stats["accepted_spans"] == threads * per_thread and stats["requests"] == len(collected.requests)
    assert 1 <= collected.max_running <= 2


def test_callback_error_fails_the_export_and_is_counted():
    """on_request raising -> gRPC INTERNAL -> the SDK exporter returns FAILURE (no retry); the receiver counts it and keeps serving."""
    calls = []

    def on_request(request):
        calls.append(request)
        if len(calls) == 1:
            raise ValueError("queue closed")

    with OtlpReceiver(on_request) as rx:
        exporter = grpc_exporter(rx)
        spans = _readable_spans(3)
        assert exporter.export(spans) is SpanExportResult.FAILURE
        assert len(calls) == 1  # INTERNAL is not retried
        stats = rx.stats()
        assert (stats["failed_requests"], stats["failed_spans"], stats["accepted_spans"]) == (1, 3, 0)
        assert stats["last_error"] == "on_request failed: ValueError: queue closed"
        # the server survived: the same exporter goes on
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert rx.stats()["accepted_spans"] == 3
        # what a client sees
        channel, stub = raw_stub(rx)
        calls.clear()
        with pytest.raises(grpc.RpcError) as err:
            stub.Export(_request(spans), timeout=WAIT_S)
        channel.close()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "on_request failed: ValueError: queue closed"


def test_backpressure_makes_the_sdk_retry_then_deliver():
    """Backpressure -> RESOURCE_EXHAUSTED with RetryInfo -> the SDK exporter waits that long, resends the whole request, SUCCESS."""
    accepted = []

    def on_request(request):
        if len(accepted) == 0 and rx.stats()["backpressure_requests"] < 2:
            raise Backpressure("queue full (4096 spans)", retry_after_s=0.05)
        accepted.append(request)

    with OtlpReceiver(on_request) as rx:
        assert grpc_exporter(rx).export(_readable_spans(5)) is SpanExportResult.SUCCESS
        stats = rx.stats()
    assert [count_spans(r) for r in accepted] == [5]
    assert (stats["backpressure_requests"], stats["backpressure_spans"]) == (2, 10)
    assert (stats["requests"], stats["accepted_spans"], stats["failed_requests"]) == (3, 5, 0)


def test_backpressure_status_and_retry_info_on_the_wire():
    """The gRPC answer to Backpressure carries the message and a google.rpc.RetryInfo with retry_after_s."""
    def on_request(request):
        raise Backpressure("queue full", retry_after_s=0.25)

    with OtlpReceiver(on_request) as rx:
        channel, stub = raw_stub(rx)
        with pytest.raises(grpc.RpcError) as err:
            stub.Export(_request(_readable_spans(1)), timeout=WAIT_S)
        channel.close()
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    info = RetryInfo.FromString(dict(err.value.trailing_metadata())["google.rpc.retryinfo-bin"])
    assert info.retry_delay.ToNanoseconds() == 250_000_000


def test_persistent_backpressure_ends_in_failure_within_the_client_timeout():
    """A receiver that stays full: the SDK exporter retries until its own timeout, then returns FAILURE."""
    def on_request(request):
        raise Backpressure(retry_after_s=0.2)

    with OtlpReceiver(on_request) as rx:
        assert grpc_exporter(rx, timeout=1).export(_readable_spans(2)) is SpanExportResult.FAILURE
        stats = rx.stats()
    assert stats["backpressure_requests"] >= 2 and stats["accepted_spans"] == 0


def test_partial_success_is_answered_but_not_retried():
    """PartialSuccess -> OK with partial_success (rejected_spans, error_message); the SDK reports SUCCESS and does not resend."""
    calls = []

    def on_request(request):
        calls.append(request)
        return PartialSuccess(2, "2 spans over the size limit")

    with OtlpReceiver(on_request) as rx:
        assert grpc_exporter(rx).export(_readable_spans(5)) is SpanExportResult.SUCCESS
        assert len(calls) == 1
        channel, stub = raw_stub(rx)
        response = stub.Export(_request(_readable_spans(3)), timeout=WAIT_S)
        channel.close()
        stats = rx.stats()
    assert (response.partial_success.rejected_spans, response.partial_success.error_message) == (
        2, "2 spans over the size limit")
    assert (stats["accepted_spans"], stats["rejected_spans"]) == (3 + 1, 2 + 2)


def test_message_size_limit():
    """A gRPC request over max_message_bytes is refused by gRPC (RESOURCE_EXHAUSTED) before on_request."""
    collected = Collected()
    with OtlpReceiver(collected, max_message_bytes=10_000) as rx:
        channel, stub = raw_stub(rx)
        with pytest.raises(grpc.RpcError) as err:
            stub.Export(_request(_readable_spans(1, payload="x" * 20_000)), timeout=WAIT_S)
        assert stub.Export(_request(_readable_spans(1)), timeout=WAIT_S) is not None
        channel.close()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(collected.requests) == 1


def test_stop_is_bounded_and_frees_the_port():
    """The port is exclusive while serving; stop() returns within its grace even with a callback stuck, and the port can be bound again."""
    release = threading.Event()
    entered = threading.Event()

    def stuck(request):
        entered.set()
        release.wait(WAIT_S)

    rx = OtlpReceiver(stuck)
    rx.start()
    port = rx.port
    try:
        with pytest.raises(OSError):  # no silent SO_REUSEPORT sharing
            OtlpReceiver(lambda r: None, port=port).start()
        result = []
        client = threading.Thread(target=lambda: result.append(grpc_exporter(rx, timeout=2).export(_readable_spans(1))))
        client.start()
        assert entered.wait(WAIT_S)
        stopper = threading.Thread(target=rx.stop, kwargs={"grace_s": 0.2})
        stopper.start()
        stopper.join(WAIT_S)
        assert not stopper.is_alive()
        client.join(WAIT_S)
        assert result == [SpanExportResult.FAILURE]  # its RPC was cancelled, the receiver is gone
        again = OtlpReceiver(lambda r: None, port=port)
        again.start()
        assert again.port == port
        again.stop()
        rx.stop()  # idempotent
    finally:
        release.set()
        rx.stop(0)


def test_start_twice_and_endpoint_before_start():
    rx = OtlpReceiver(lambda r: None)
    with pytest.raises(RuntimeError):
        rx.endpoint
    assert rx.http_endpoint is None
    with rx:
        with pytest.raises(RuntimeError):
            rx.start()
    with pytest.raises(RuntimeError):
        rx.start()


# ----------------------------------------------------------------------------- HTTP
def test_http_receives_sdk_spans_exactly(receiver, collected):
    """The SDK's OTLP/HTTP exporter (gzip) to POST /v1/traces: the same spans as over gRPC."""
    sdk = _make_sdk_spans(SimpleSpanProcessor(http_exporter(receiver, compression=Compression.Gzip)))
    _assert_same_spans(sdk, collected.wait_spans(3))
    assert receiver.stats()["accepted_spans"] == 3


def test_http_errors_and_backpressure():
    """HTTP: on_request raising -> 500 -> FAILURE; Backpressure -> 429 + Retry-After -> retried -> SUCCESS."""
    mode = ["raise"]
    kept = []

    def on_request(request):
        if mode[0] == "raise":
            raise RuntimeError("boom")
        if mode[0] == "full":
            mode[0] = "ok"
            raise Backpressure(retry_after_s=0.01)
        kept.append(request)

    with OtlpReceiver(on_request, http_port=0) as rx:
        exporter = http_exporter(rx)
        assert exporter.export(_readable_spans(2)) is SpanExportResult.FAILURE
        mode[0] = "full"
        assert exporter.export(_readable_spans(3)) is SpanExportResult.SUCCESS
        stats = rx.stats()
        # on the wire
        mode[0] = "full"
        status, headers, _ = _post(rx, _request(_readable_spans(1)).SerializeToString())
    assert (status, headers["Retry-After"]) == (429, "1")  # whole seconds, at least 1
    assert [count_spans(r) for r in kept] == [3]
    assert (stats["failed_requests"], stats["failed_spans"]) == (1, 2)
    assert (stats["backpressure_requests"], stats["accepted_spans"]) == (1, 3)


def test_http_refuses_bad_requests_and_keeps_serving(collected):
    """Wrong path, JSON, garbage, an oversized or over-inflating body: a 4xx each, counted, never reaching on_request."""
    with OtlpReceiver(collected, http_port=0, max_message_bytes=50_000) as rx:
        good = _request(_readable_spans(1)).SerializeToString()
        assert _post(rx, good, path="/v1/metrics")[0] == 404
        assert _post(rx, b"{}", ctype="application/json")[0] == 415
        assert _post(rx, b"\xff\xff\xff\xff")[0] == 400
        assert _post(rx, b"x" * 60_000)[0] == 413
        assert _post(rx, gzip.compress(b"\0" * 1_000_000), encoding="gzip")[0] == 413
        assert _post(rx, good, encoding="br")[0] == 415
        assert _post(rx, gzip.compress(good), encoding="gzip")[0] == 200
        stats = rx.stats()
    assert stats["invalid_requests"] == 6 and stats["accepted_spans"] == 1
    assert len(collected.requests) == 1


# ----------------------------------------------------------------------------- fixtures
def _readable_spans(n: int, payload: str = "") -> list[ReadableSpan]:
    resource = Resource.create({"service.name": "t"})
    flags = TraceFlags(TraceFlags.SAMPLED)
    return [ReadableSpan(name=f"span-{i}", context=SpanContext(0xABC, 0x100 + i, False, flags),
                         resource=resource, attributes={"i": i, "payload": payload},
                         start_time=1, end_time=2, instrumentation_scope=InstrumentationScope("t"))
            for i in range(n)]


def _request(spans: list[ReadableSpan]) -> ExportTraceServiceRequest:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


def _post(rx: OtlpReceiver, body: bytes, path: str = "/v1/traces", ctype: str = "application/x-protobuf",
          encoding: str | None = None) -> tuple[int, dict, bytes]:
    headers = {"Content-Type": ctype}
    if encoding:
        headers["Content-Encoding"] = encoding
    req = urllib.request.Request(rx.http_endpoint + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()



def test_http_connections_are_bounded_and_stop_closes_idle_ones(collected, monkeypatch):
    """Beyond HTTP_MAX_CONNECTIONS a connection gets 503 + Retry-After (retryable); stop() closes idle keep-alive connections and frees the port."""
    import socket

    from rtrace.pipeline import otlp_receiver

    monkeypatch.setattr(otlp_receiver, "HTTP_MAX_CONNECTIONS", 1)
    rx = OtlpReceiver(collected, http_port=0)
    rx.start()
    try:
        idle = socket.create_connection(("127.0.0.1", rx.http_port), timeout=WAIT_S)  # holds the one slot
        # connections are accepted in order: `idle` holds the slot, the next one is refused at once
        with socket.create_connection(("127.0.0.1", rx.http_port), timeout=WAIT_S) as refused:
            answer = b""
            while chunk := refused.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in answer
        port = rx.http_port
        rx.stop(grace_s=0.2)
        assert idle.recv(1) == b""  # closed by stop(), not by the idle timeout
        idle.close()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as any server does
            s.bind(("127.0.0.1", port))
    finally:
        rx.stop(0)


@pytest.mark.parametrize("body, compression, code, counter", [
    # larger than max_message_bytes: gRPC itself refuses it before the handler has it
    ("big", None, grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc_refused_calls"),
    # a gzip bomb: small on the wire, too large once decompressed
    ("big", grpc.Compression.Gzip, grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc_refused_calls"),
    # bytes that are no ExportTraceServiceRequest
    ("garbage", None, grpc.StatusCode.INVALID_ARGUMENT, "invalid_requests"),
], ids=["oversize", "gzip-bomb", "undecodable"])
def test_grpc_refusals_are_counted(body, compression, code, counter):
    """What gRPC or the decoder refuses is answered with the right code and counted; the
    callback never sees it."""
    from rtrace.pipeline.otlp_receiver import _EXPORT_METHOD

    got = []
    with OtlpReceiver(got.append, max_message_bytes=64 * 1024) as rx:
        if body == "big":
            req = ExportTraceServiceRequest()
            req.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\1" * 16, span_id=b"\1" * 8,
                                                                 name="x" * (1 << 20))
            payload = req.SerializeToString()
        else:
            payload = b"\xff\xff not protobuf"
        channel = grpc.insecure_channel(rx.endpoint, compression=compression)
        try:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(_EXPORT_METHOD)(payload, timeout=WAIT_S)
        finally:
            channel.close()
        assert err.value.code() == code
        # gRPC may answer a message it refused (too large once decompressed) before the
        # handler has run and counted it: the count follows within a moment
        deadline = time.monotonic() + WAIT_S
        while rx.stats()[counter] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = rx.stats()
    assert got == []
    assert stats[counter] == 1 and stats["grpc_calls"] == 1 and stats["requests"] == 0


@pytest.mark.parametrize("messages", [0, 2], ids=["none", "two"])
def test_a_grpc_call_carries_exactly_one_request(messages):
    """Export is unary: a call whose stream ends with no message, or carries two, is refused
    (INVALID_ARGUMENT) and counted; its stream is read to its end either way (reading only its
    first message kept the body in a reference cycle until a full GC, issue #37)."""
    from rtrace.pipeline.otlp_receiver import _EXPORT_METHOD

    got = []
    body = _request(_readable_spans(1)).SerializeToString()
    with OtlpReceiver(got.append) as rx:
        channel = grpc.insecure_channel(rx.endpoint)
        try:
            with pytest.raises(grpc.RpcError) as err:
                channel.stream_unary(_EXPORT_METHOD)(iter([body] * messages), timeout=WAIT_S)
        finally:
            channel.close()
        stats = rx.stats()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert got == [] and stats["grpc_refused_calls"] == 1 and stats["requests"] == 0
