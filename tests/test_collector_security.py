"""The collector as a network service: bad input, load and strangers (issue #24).

Real parts: the collector's receiver (grpc.aio and the HTTP server), rtrace's worker sink
(`CollectorSink`, what `RTRACE_EXPORTER=collector` uses), raw gRPC / HTTP clients for what
no honest worker sends, certificates made here with `cryptography`, JSONL read back.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import rtrace
from rtrace import _stats
from rtrace.config import ConfigError, load_settings
from rtrace.exporters.collector import CollectorSink
from rtrace.exporters.jsonl import read_jsonl
from rtrace.exporters.otel import RECORD_ATTR, encode_compact
from rtrace.pipeline.otlp_receiver import _EXPORT_METHOD
from rtrace.trajectory import SpanRecord, Trajectory

TOKEN = "s3cret-token-for-this-job-0123456789"


def honest(trace: int, step: int, index: int, reward: float | None, children: int = 1) -> Trajectory:
    """A worker's segment: a root with coordinates and reward, ``children`` tool spans."""
    attrs = {"rl.step": step, "rl.sample_index": index, "rl.rollout_n": 0, "rl.validate": False, "rtrace.root": True}
    if reward is not None:
        attrs["rl.reward"] = reward
    root = SpanRecord(f"{trace:016x}", None, "rollout", "rollout", 10, 100, attributes=attrs)
    kids = [SpanRecord(f"{trace:08x}{c + 1:08x}", f"{trace:016x}", "calculator", "tool", 20 + c, 30 + c,
                       output=str(c)) for c in range(children)]
    return Trajectory(f"{trace:032x}", "rollout", [root] + kids)


def request_of(*trajs: Trajectory) -> ExportTraceServiceRequest:
    return encode_compact(list(trajs), {"service.name": "test"})


def send_raw(endpoint: str, request: ExportTraceServiceRequest | bytes, metadata=None, creds=None):
    """One Export call with a raw gRPC client; returns the status code."""
    target = endpoint.split("://", 1)[-1]
    channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    try:
        call = channel.unary_unary(_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        body = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            call(body, timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()
    finally:
        channel.close()


def written(c, tmp_path) -> list:
    """Everything the collector wrote, once stopped (what waits for a root is written partial)."""
    assert c.flush(30)
    c.stop()
    path = tmp_path / "traces.jsonl"
    return read_jsonl(path) if path.exists() else []


# ----------------------------------------------------------------------------- bad spans
def _mutate(request: ExportTraceServiceRequest, index: int, fn) -> ExportTraceServiceRequest:
    """``request`` with ``fn`` applied to its ``index``-th span."""
    out = ExportTraceServiceRequest.FromString(request.SerializeToString())
    fn(out.resource_spans[0].scope_spans[0].spans[index])
    return out


def _set_record(span, data) -> None:
    for kv in span.attributes:
        if kv.key == RECORD_ATTR:
            kv.value.string_value = data if isinstance(data, str) else json.dumps(data)


def _set_attr(span, key, fn) -> None:
    for kv in span.attributes:
        if kv.key == key:
            fn(kv.value)
            return
    fn(span.attributes.add(key=key).value)


def _drop_record(span) -> None:
    keep = [kv for kv in span.attributes if kv.key != RECORD_ATTR]
    del span.attributes[:]
    span.attributes.extend(keep)
    span.attributes.add(key="rtrace.root").value.bool_value = True


def _array_step(value) -> None:
    value.ClearField("int_value")
    value.array_value.values.add().int_value = 1


BAD_SPANS = {
    # a record nested deeper than any worker writes (the json module's recursion limit)
    "deep_record": (lambda s: _set_record(s, "[" * 100_000 + "]" * 100_000), "record"),
    # a record whose attributes are a string, not an object
    "string_attributes": (lambda s: _set_record(s, {"kind": "tool", "attributes": "x"}), "record"),
    # a coordinate that is a list: it would break the sample's and the metrics' keys
    "array_step": (lambda s: _set_record(s, {"kind": "rollout", "attributes": {
        "rl.step": [1], "rl.sample_index": 9, "rtrace.root": True}}), "coordinates"),
    # the same in the OTLP attributes of a sender in the full attribute form (no record)
    "array_step_attribute": (lambda s: (_drop_record(s), _set_attr(s, "rl.step", _array_step)), "coordinates"),
    # ids OTLP does not allow: 3 bytes, all zero, empty
    "short_trace_id": (lambda s: setattr(s, "trace_id", b"\x01\x02\x03"), "trace_id"),
    "zero_trace_id": (lambda s: setattr(s, "trace_id", bytes(16)), "trace_id"),
    "empty_span_id": (lambda s: setattr(s, "span_id", b""), "span_id"),
    "short_parent_id": (lambda s: setattr(s, "parent_span_id", b"\x01"), "parent_span_id"),
    # a million attributes
    "many_attributes": (lambda s: [s.attributes.add(key=f"k{i}").value.__setattr__("int_value", i)
                                   for i in range(2000)], "attributes"),
    # a 12 MiB string attribute
    "huge_span": (lambda s: _set_attr(s, "blob", lambda v: setattr(v, "string_value", "x" * (12 << 20))), "size"),
}


class TestOneBadSpan:
    @pytest.mark.parametrize("case", sorted(BAD_SPANS))
    def test_costs_only_itself(self, collector, tmp_path, case):
        """A request with one malformed span (in the root of one trajectory) and three honest
        trajectories: the three are written whole, the bad span is refused and counted under
        its reason, and the trajectory it belonged to is written partial with what came."""
        mutate, why = BAD_SPANS[case]
        c = collector()
        _stats.reset()
        good = [honest(t, 1, t, 1.0) for t in (1, 2, 3)]
        req = request_of(honest(9, 1, 9, 0.0), *good)
        assert send_raw(c.endpoint, _mutate(req, 0, mutate)) == grpc.StatusCode.OK
        trajs = written(c, tmp_path)
        whole = sorted(t.sample_index for t in trajs if not t.partial)
        assert whole == [1, 2, 3]
        assert all(len(t.spans) == 2 and t.reward == 1.0 for t in trajs if not t.partial)
        stats = c.stats()
        assert stats["collector_spans_refused"] == 1
        assert stats[f"collector_refused.{why}"] == 1
        # the bad root's child still arrived: written partial (not lost, not mixed into another)
        partial = [t for t in trajs if t.partial]
        assert [t.trace_id for t in partial] == [f"{9:032x}"]
        assert [s.span_id for s in partial[0].spans if s.kind == "tool"] == ["0000000900000001"]

    def test_bad_annotation_spans_never_cost_an_honest_worker(self, collector, tmp_path):
        """Annotation spans with a non-hex trace id, values that are not an object, or values
        too large, sent between an honest worker's requests: every honest trajectory is
        written, the annotations refused and counted."""
        c = collector()
        _stats.reset()

        def annotation(values, trace_hex):
            attrs = {"rtrace.annotation.values": values, "rl.step": 1, "rl.sample_index": 1}
            if trace_hex is not None:
                attrs["rtrace.annotation.trace_id"] = trace_hex
            span = SpanRecord("00000000000000aa", None, "rtrace.annotation", "span", 1, 2, attributes=attrs)
            return request_of(Trajectory(f"{77:032x}", "annotation", [span]))

        bad = [annotation('{"reward": 5}', "not-hex-at-all-not-hex-at-all-00"),
               annotation('["a list"]', None),
               annotation(json.dumps({"x": "y" * 10_000}), None),
               annotation('{"reward": 5}', "0" * 32)]
        for i in range(24):
            assert send_raw(c.endpoint, bad[i % len(bad)]) == grpc.StatusCode.OK
            assert send_raw(c.endpoint, request_of(honest(100 + i, 2, i, 1.0))) == grpc.StatusCode.OK
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if not t.partial) == list(range(24))
        assert all(t.reward == 1.0 and not t.annotations for t in trajs)
        assert c.stats()["collector_refused.annotation"] == 24

    def test_times_repaired_and_duplicates_dropped(self, collector, tmp_path):
        """A span that ends before it starts is written with zero length (counted); a span id
        sent twice is kept once (counted)."""
        c = collector()
        _stats.reset()
        traj = honest(5, 1, 5, 1.0, children=2)
        req = _mutate(request_of(traj), 1, lambda s: setattr(s, "end_time_unix_nano", s.start_time_unix_nano - 5))
        dup = request_of(Trajectory(traj.trace_id, "rollout", [traj.spans[2]]))
        assert send_raw(c.endpoint, dup) == grpc.StatusCode.OK  # the child, before the rest
        assert send_raw(c.endpoint, req) == grpc.StatusCode.OK
        (t,) = written(c, tmp_path)
        assert [s.span_id for s in t.spans].count(traj.spans[2].span_id) == 1 and len(t.spans) == 3
        child = next(s for s in t.spans if s.span_id == traj.spans[1].span_id)
        assert child.end_ns == child.start_ns
        assert c.stats()["collector_spans_repaired_times"] == 1
        assert c.stats()["collector_spans_duplicate"] == 1


class TestLateSpans:
    def test_a_span_after_its_trajectory_was_written_is_counted_not_written_again(self, collector, tmp_path):
        """A tool span of trace 7 that comes after trace 7 was written (past its settle time): counted as
        collector_spans_late, and trace 7 stays one trajectory (before: a second, partial trajectory of
        the same trace id, a duplicate row in every sink and in the step's counts)."""
        c = collector()
        _stats.reset()
        traj = honest(7, 1, 7, 1.0, children=1)
        assert send_raw(c.endpoint, request_of(traj)) == grpc.StatusCode.OK
        assert c.flush(30)
        late = SpanRecord(f"{7:08x}{99:08x}", f"{7:016x}", "calculator", "tool", 40, 50, output="late")
        assert send_raw(c.endpoint, request_of(Trajectory(traj.trace_id, "rollout", [late]))) == grpc.StatusCode.OK
        assert c.flush(30)
        stats = c.stats()
        trajs = written(c, tmp_path)
        assert [(t.trace_id, t.partial, len(t.spans)) for t in trajs] == [(traj.trace_id, False, 2)]
        assert stats["collector_spans_late"] == 1

    def test_the_root_of_an_expired_trajectory_is_late(self, collector, tmp_path):
        """A child whose root does not come within the orphan timeout is written partial; the root that
        comes after that is counted late, not written as a second trajectory."""
        c = collector(orphan_timeout_s=0.3)
        _stats.reset()
        traj = honest(8, 1, 8, 1.0, children=1)
        assert send_raw(c.endpoint, request_of(Trajectory(traj.trace_id, "rollout", [traj.spans[1]]))) == \
            grpc.StatusCode.OK
        deadline = time.monotonic() + 20
        while c.stats().get("trajectories_partial", 0) < 1:
            assert time.monotonic() < deadline, "the orphan was never expired"
            time.sleep(0.05)
        assert send_raw(c.endpoint, request_of(Trajectory(traj.trace_id, "rollout", [traj.spans[0]]))) == \
            grpc.StatusCode.OK
        assert c.flush(30)
        stats = c.stats()
        trajs = written(c, tmp_path)
        assert [(t.trace_id, t.partial) for t in trajs] == [(traj.trace_id, True)]
        assert stats["collector_spans_late"] == 1

    def test_finished_trace_ids_are_bounded(self):
        """The memory of finished trace ids keeps the last ``finished_bound``, oldest out first."""
        from rtrace.pipeline.records import TrajectoryState
        from rtrace.pipeline.registry import TrajectoryRegistry

        reg = TrajectoryRegistry(100, 10)
        reg.remember_finished(3)
        for tid in range(1, 6):
            state = TrajectoryState(tid, None, "rollout", "rollout", {})
            assert reg.register(state)
            reg.remove(state)
        assert [t for t in range(1, 6) if reg.was_finished(t)] == [3, 4, 5]
        plain = TrajectoryRegistry(100, 10)  # one process: nothing kept
        state = TrajectoryState(9, None, "rollout", "rollout", {})
        plain.register(state)
        plain.remove(state)
        assert not plain.was_finished(9)


# ----------------------------------------------------------------------------- load
class TestFullTable:
    def test_never_finishing_trace_ids_do_not_cost_the_next_honest_worker(self, collector, tmp_path):
        """A table filled with trace ids whose root never comes: the receiver pushes back
        (RESOURCE_EXHAUSTED with RetryInfo), the least recently active are written partial to
        make room, and an honest worker that comes next (rtrace's own sink, which retries)
        loses nothing."""
        c = collector(max_open_trajectories=200, orphan_timeout_s=3600)
        _stats.reset()
        junk = [Trajectory(f"{0xdead0000 + i:032x}", "rollout",
                           [SpanRecord(f"{i + 1:016x}", "00000000000000ff", "x", "tool", 1, 2)]) for i in range(200)]
        assert send_raw(c.endpoint, request_of(*junk)) == grpc.StatusCode.OK
        time.sleep(1.0)  # assembled: the table is full
        assert c.pipeline.registry.held_bytes > 0
        sink = CollectorSink(load_settings({"exporter": "collector", "collector_endpoint": c.endpoint,
                                            "otlp_timeout_s": 20}))
        try:
            for i in range(10):
                sink.export([honest(500 + i, 3, i, 1.0)])
            assert sink.flush(60)  # the collector's lane sent them all, retrying on push-back
        finally:
            sink.shutdown()
        stats = c.stats()
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if not t.partial) == list(range(10))
        assert stats["receiver.backpressure_requests"] >= 1
        assert stats["trajectories_evicted"] >= 20
        assert stats.get("spans_dropped_open_limit", 0) == 0
        # every junk trace is written partial (evicted, or at stop): none lost
        assert sum(1 for t in trajs if t.partial) == 200

    def test_silent_grpc_calls_do_not_block_honest_exports(self, collector, tmp_path):
        """Eight gRPC calls that never send their message (more than the receiver's worker
        threads) leave honest exports alone; each silent call ends at the message deadline."""
        c = collector()
        channel = grpc.insecure_channel(c.endpoint)
        stop = threading.Event()

        def never():
            stop.wait(30)
            return
            yield b""  # noqa: unreachable - a generator that sends nothing

        calls = [channel.stream_unary(_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
                 .future(never(), timeout=30) for _ in range(8)]
        try:
            time.sleep(0.5)
            started = time.monotonic()
            for i in range(5):
                assert send_raw(c.endpoint, request_of(honest(40 + i, 1, i, 1.0))) == grpc.StatusCode.OK
            assert time.monotonic() - started < 5  # not waiting for a thread a silent call holds
        finally:
            stop.set()
            for call in calls:
                call.cancel()
            channel.close()
        assert sorted(t.sample_index for t in written(c, tmp_path)) == list(range(5))

    def test_slow_http_connections_do_not_shut_out_honest_clients(self, collector, tmp_path):
        """More slow connections than the cap (each sends a header line now and then): an
        honest OTLP/HTTP client still gets its request answered; the slowest were closed."""
        from rtrace.pipeline.otlp_receiver import HTTP_MAX_CONNECTIONS

        c = collector(http_port=0)
        port = int(c.receiver.http_endpoint.rsplit(":", 1)[1])
        slow = []
        try:
            for _ in range(HTTP_MAX_CONNECTIONS + 20):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")
                slow.append(s)
            time.sleep(1.5)  # older than HTTP_EVICT_AFTER_S
            body = request_of(honest(61, 1, 0, 1.0)).SerializeToString()
            req = urllib.request.Request(c.receiver.http_endpoint + "/v1/traces", data=body, method="POST",
                                         headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
        finally:
            for s in slow:
                s.close()
        assert [t.sample_index for t in written(c, tmp_path)] == [0]
        assert c.stats()["receiver.http_evicted_connections"] >= 1


# ----------------------------------------------------------------------------- token
class TestToken:
    def test_requests_without_the_token_are_refused_and_counted(self, collector, tmp_path):
        """With a token, gRPC and HTTP requests without it (or with another) are refused
        (UNAUTHENTICATED, 401) and counted; nothing of them is written; rtrace's worker
        sink, configured from collector.env, is let in."""
        c = collector(collector_token=TOKEN, http_port=0)
        assert c.env["RTRACE_COLLECTOR_TOKEN"] == TOKEN
        assert send_raw(c.endpoint, request_of(honest(1, 1, 1, 1.0))) == grpc.StatusCode.UNAUTHENTICATED
        assert send_raw(c.endpoint, request_of(honest(2, 1, 2, 1.0)),
                        metadata=(("authorization", "Bearer wrong-token-wrong-token"),)) == \
            grpc.StatusCode.UNAUTHENTICATED
        body = request_of(honest(3, 1, 3, 1.0)).SerializeToString()
        req = urllib.request.Request(c.receiver.http_endpoint + "/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401
        sink = CollectorSink(load_settings({"exporter": "collector"}, environ=c.env))
        try:
            sink.export([honest(4, 1, 4, 1.0)])
        finally:
            sink.shutdown()
        assert [t.sample_index for t in written(c, tmp_path)] == [4]
        assert c.stats()["receiver.unauthenticated_requests"] == 3

    def test_strangers_cannot_overwrite_rewards(self, collector, tmp_path):
        """An annotation sent without the token does not change a running job's rewards."""
        c = collector(collector_token=TOKEN, await_annotations="reward", annotation_timeout_s=60)
        meta = (("authorization", f"Bearer {TOKEN}"),)
        for i in range(5):
            assert send_raw(c.endpoint, request_of(honest(10 + i, 1, i, None)), metadata=meta) == grpc.StatusCode.OK
        span = SpanRecord("00000000000000aa", None, "rtrace.annotation", "span", 1, 2,
                          attributes={"rtrace.annotation.values": '{"reward": -100.0}', "rl.step": 1,
                                      "rl.sample_index": 0, "rl.rollout_n": 0, "rl.validate": False})
        for i in range(5):
            span.attributes["rl.sample_index"] = i
            assert send_raw(c.endpoint, request_of(Trajectory(f"{90 + i:032x}", "a", [span]))) == \
                grpc.StatusCode.UNAUTHENTICATED
        rtrace.annotate_batch(step=1, sample_index=list(range(5)), rollout_n=[0] * 5, reward=[0.5] * 5)
        trajs = written(c, tmp_path)
        assert sorted((t.sample_index, t.reward) for t in trajs) == [(i, 0.5) for i in range(5)]

    def test_beyond_loopback_a_token_is_generated_and_never_logged(self, collector, tmp_path, caplog):
        """Bound beyond loopback with no token, the collector makes one (in collector.env,
        in the env file written 0600), warns that there is no TLS, and the token appears in
        no log line, no counter and no repr of the settings."""
        caplog.set_level(logging.DEBUG)
        c = collector(host="0.0.0.0")
        token = c.env["RTRACE_COLLECTOR_TOKEN"]
        assert len(token) >= 32 and c.token == token
        assert any("without TLS" in r.getMessage() for r in caplog.records)
        path = c.write_env(str(tmp_path / "collector.env"))
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert f"export RTRACE_COLLECTOR_TOKEN={token}\n" in open(path).read()
        assert send_raw(f"127.0.0.1:{c.receiver.port}", request_of(honest(1, 1, 1, 1.0)),
                        metadata=(("authorization", "Bearer nope-nope-nope-nope"),)) == grpc.StatusCode.UNAUTHENTICATED
        s = load_settings({"exporter": "collector"}, environ={**c.env, "RTRACE_COLLECTOR_ENDPOINT":
                                                              f"127.0.0.1:{c.receiver.port}"})
        assert token not in repr(s)
        text = "\n".join(r.getMessage() + str(r.args) for r in caplog.records)
        assert token not in text and token not in json.dumps(c.stats(), default=str)

    def test_no_token_beyond_loopback_warns_naming_the_risk(self, collector, caplog):
        """RTRACE_COLLECTOR_TOKEN=none beyond loopback: no token, and a warning that anyone
        can inject trajectories and overwrite rewards."""
        c = collector(host="0.0.0.0", collector_token="none")
        assert c.token is None and "RTRACE_COLLECTOR_TOKEN" not in c.env
        assert any("overwrite the rewards" in r.getMessage() for r in caplog.records)

    @pytest.mark.parametrize("value", ["short", "has space in the middle of it"])
    def test_bad_token_fails_at_configure(self, value):
        """A token too short or with spaces is refused at start, naming the variable."""
        with pytest.raises(ConfigError, match="RTRACE_COLLECTOR_TOKEN"):
            load_settings({"collector_token": value})


# ----------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA made here, a server certificate for 127.0.0.1 and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, key, cert):
        (d / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(cn, ca_key, ca_cert, san=None, ca=False):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn))
             .issuer_name(ca_cert.subject if ca_cert else name(cn)).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        # key identifiers: Python 3.13's default TLS context is strict (VERIFY_X509_STRICT)
        issuer_key = (ca_key or key).public_key()
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key), critical=False)
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                              crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        return key, b.sign(ca_key or key, hashes.SHA256())

    ca_key, ca_cert = issue("rtrace test CA", None, None, ca=True)
    write("ca", ca_key, ca_cert)
    write("server", *issue("127.0.0.1", ca_key, ca_cert,
                           san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]))
    write("client", *issue("worker", ca_key, ca_cert))
    return d


class TestTls:
    def test_workers_send_over_tls_with_the_env_they_are_given(self, collector, tmp_path, pki):
        """A TLS collector: workers configured from collector.env (https endpoint, the CA as
        OTEL_EXPORTER_OTLP_CERTIFICATE, the token) are let in; a plaintext client is not."""
        c = collector(collector_token=TOKEN, collector_tls_cert=str(pki / "server.pem"),
                      collector_tls_key=str(pki / "server.key"), collector_tls_ca=str(pki / "ca.pem"), http_port=0)
        assert c.env["RTRACE_COLLECTOR_ENDPOINT"].startswith("https://127.0.0.1:")
        assert c.env["OTEL_EXPORTER_OTLP_CERTIFICATE"] == str(pki / "ca.pem")
        assert send_raw(c.endpoint, request_of(honest(1, 1, 1, 1.0)),
                        metadata=(("authorization", f"Bearer {TOKEN}"),)) == grpc.StatusCode.UNAVAILABLE
        sink = CollectorSink(load_settings({"exporter": "collector"}, environ=c.env))
        try:
            sink.export([honest(2, 1, 2, 1.0)])
        finally:
            sink.shutdown()
        # OTLP/HTTP over TLS, verified with the same CA
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        body = request_of(honest(3, 1, 3, 1.0)).SerializeToString()
        req = urllib.request.Request(c.receiver.http_endpoint + "/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf",
                                              "Authorization": f"Bearer {TOKEN}"})
        assert c.receiver.http_endpoint.startswith("https://")
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            assert resp.status == 200
        assert sorted(t.sample_index for t in written(c, tmp_path)) == [2, 3]

    def test_mutual_tls_needs_a_client_certificate(self, collector, tmp_path, pki):
        """With a client CA, a worker without a client certificate is refused; one with
        OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE / _CLIENT_KEY is let in."""
        c = collector(collector_tls_cert=str(pki / "server.pem"), collector_tls_key=str(pki / "server.key"),
                      collector_tls_ca=str(pki / "ca.pem"), collector_tls_client_ca=str(pki / "ca.pem"))
        anonymous = CollectorSink(load_settings({"exporter": "collector", "otlp_timeout_s": 2}, environ=c.env))
        _stats.reset()
        try:
            anonymous.export([honest(1, 1, 1, 1.0)])
            assert anonymous.flush(10) is False  # refused at the handshake: counted as lost
            assert _stats.snapshot()["sink.collector.failed_trajectories"] == 1
        finally:
            anonymous.shutdown()
        env = {**c.env, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(pki / "client.pem"),
               "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(pki / "client.key")}
        sink = CollectorSink(load_settings({"exporter": "collector"}, environ=env))
        try:
            sink.export([honest(2, 1, 2, 1.0)])
        finally:
            sink.shutdown()
        assert [t.sample_index for t in written(c, tmp_path)] == [2]

    def test_a_certificate_without_its_key_fails_at_start(self, pki):
        """RTRACE_COLLECTOR_TLS_CERT without RTRACE_COLLECTOR_TLS_KEY is refused at start."""
        with pytest.raises(ConfigError, match="RTRACE_COLLECTOR_TLS_CERT is set but RTRACE_COLLECTOR_TLS_KEY"):
            load_settings({"collector_tls_cert": str(pki / "server.pem")})


@pytest.mark.integration
def test_secure_multi_node_recipe_of_the_docs(tmp_path, pki):
    """docs/collector.md's recipe on one node: `rtrace collect --host 0.0.0.0` with TLS
    prints no token, writes the worker environment 0600 (token, https endpoint, CA), and
    a worker process started with that file (the address filled in) is let in."""
    import multiprocessing as mp
    import shlex
    import signal

    from tests import collector_workers as workers
    from tests.test_collector import _rtrace_collect

    env_file = tmp_path / "collector.env"
    path = tmp_path / "cli.jsonl"
    proc, printed = _rtrace_collect(path, "--host", "0.0.0.0", "--tls-cert", str(pki / "server.pem"),
                                    "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"),
                                    "--env-file", str(env_file))
    try:
        assert "RTRACE_COLLECTOR_TOKEN" not in printed
        assert os.stat(env_file).st_mode & 0o777 == 0o600
        worker_env = {}
        for line in env_file.read_text().splitlines():
            key, _, value = line[len("export "):].partition("=")
            worker_env[key] = shlex.split(value)[0]
        assert len(worker_env["RTRACE_COLLECTOR_TOKEN"]) >= 32
        assert worker_env["OTEL_EXPORTER_OTLP_CERTIFICATE"] == str(pki / "ca.pem")
        endpoint = worker_env["RTRACE_COLLECTOR_ENDPOINT"]
        assert endpoint.startswith("https://<this host's address>:")
        worker_env["RTRACE_COLLECTOR_ENDPOINT"] = endpoint.replace("<this host's address>", "127.0.0.1")
        worker = mp.get_context("spawn").Process(target=workers.rollouts, args=(worker_env, 0, 1, 1, 3, 1))
        worker.start()
        worker.join(120)
        assert worker.exitcode == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert sorted(t.sample_index for t in read_jsonl(path)) == [0, 1, 2]


def test_tls_http_at_the_cap_never_stalls_the_accept_loop(pki, monkeypatch):
    """At the HTTP connection cap on a TLS port, a client that connects and never starts
    its handshake is closed without a word (writing the plaintext 503 made the accept loop
    run that client's TLS handshake, waiting on it: every later client hung); an honest
    HTTPS client that comes a second later is served (the silent slot holder is evicted)."""
    import socket
    import time as _time

    from rtrace.pipeline import otlp_receiver
    from rtrace.pipeline.otlp_receiver import OtlpReceiver, TlsFiles

    monkeypatch.setattr(otlp_receiver, "HTTP_MAX_CONNECTIONS", 1)
    got = []
    rx = OtlpReceiver(got.append, http_port=0, tls=TlsFiles(str(pki / "server.pem"), str(pki / "server.key")))
    rx.start()
    holder = silent = None
    try:
        holder = socket.create_connection(("127.0.0.1", rx.http_port), timeout=5)  # takes the one slot
        _time.sleep(0.2)
        silent = socket.create_connection(("127.0.0.1", rx.http_port), timeout=5)  # at the cap, says nothing
        assert silent.recv(1) == b""  # closed at once, no plaintext answer on a TLS port
        _time.sleep(1.2)  # the holder has now waited over HTTP_EVICT_AFTER_S for its request
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        body = request_of(honest(1, 1, 1, 1.0)).SerializeToString()
        req = urllib.request.Request(rx.http_endpoint + "/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            assert resp.status == 200
        assert len(got) == 1 and rx.stats()["http_evicted_connections"] == 1
    finally:
        for sock in (holder, silent):
            if sock is not None:
                sock.close()  # without the fix, this ends the handshake the accept loop waits on
        rx.stop(0)
