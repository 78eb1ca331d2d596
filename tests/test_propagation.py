"""rtrace.inject / rtrace.extract: trace context and RL coordinates across threads, HTTP and processes,
checked on a real OTLP receiver."""

from __future__ import annotations

import json
import multiprocessing
import threading
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import rtrace
import rtrace.testing
from rtrace.instrumentation.propagation import _decode, _encode
from tests.otlp_receiver import OtlpHttpReceiver

REMOTE_TRACE = "0af7651916cd43dd8448eb211c80319c"
REMOTE_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver():
    with OtlpHttpReceiver() as rx:
        yield rx


def _configure(rx, **kw):
    rtrace.configure(**{"exporter": "otlp", "otlp_endpoint": rx.base_url, "export_interval_s": 0.05, **kw})


@rtrace.traced_tool
def run_tool(x):
    return x + 1


@rtrace.traced_tool
def dispatch():
    return rtrace.inject({})


def _carrier(flags="01", baggage="rl.step=4,rl.sample_index=9,rl.group_id=g2"):
    return {"traceparent": f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-{flags}", "baggage": baggage}


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("value, text", [
    (3, "3"),                 # ints stay ints
    (False, "false"),         # bools stay bools
    ("p17", "p17"),           # plain strings are written as is (readable in backends)
    ("3", '"3"'),             # a string that looks like JSON is quoted so it stays a string
    ("true", '"true"'),
    (" pad", '" pad"'),       # surrounding spaces would be stripped by the baggage parser
    (1.5, "1.5"),
    ([1, "a"], '[1,"a"]'),    # anything else: JSON text
])
def test_baggage_values_round_trip_with_their_type(value, text):
    """Coordinates are encoded readable and decode back to the same value and type."""
    assert _encode(value) == text
    assert _decode(text) == value and type(_decode(text)) is type(value)


# ----------------------------------------------------------------------------- inject
def test_inject_writes_current_span_and_coordinates(receiver):
    """inject() inside a traced call writes that span's traceparent (sampled) and the coordinates as baggage."""
    _configure(receiver)
    with rtrace.rollout_context(step=3, sample_index=17, rollout_n=2, validate=True, group_id="7", tag="x y") as rc:
        carrier = dispatch()
    assert rtrace.flush(10)
    [span] = [s for s in receiver.wait_for_spans(2, 10) if s.name == "dispatch"]
    assert carrier["traceparent"] == f"00-{rc.trace_id}-{span.span_id}-{carrier['traceparent'][-2:]}"
    assert int(carrier["traceparent"][-2:], 16) & 1  # sampled
    entries = dict(e.split("=", 1) for e in carrier["baggage"].split(","))
    assert entries == {"rl.step": "3", "rl.sample_index": "17", "rl.rollout_n": "2", "rl.validate": "true",
                       "rl.group_id": "%227%22", "rl.extra.tag": "x+y"}


def test_inject_in_sampled_out_trajectory_clears_the_sampled_flag(tmp_path):
    """A trajectory the per-step cap sampled out propagates traceparent with the sampled flag cleared."""
    rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), max_traces_per_step=0)
    with rtrace.rollout_context(step=1, sample_index=0):
        carrier = rtrace.inject()
    assert int(carrier["traceparent"][-2:], 16) & 1 == 0
    assert "rl.step=1" in carrier["baggage"]


def test_inject_outside_any_trajectory_writes_nothing():
    """With no trajectory and no application span, the carrier stays empty."""
    assert rtrace.inject({"keep": "me"}) == {"keep": "me"}


# ----------------------------------------------------------------------------- extract
def test_extract_makes_children_of_the_remote_span_with_its_coordinates(receiver):
    """Spans inside extract() are in the remote trace, under a segment span whose parent is the remote span, with rl.* restored."""
    _configure(receiver)
    with rtrace.extract(_carrier()) as seg:
        assert rtrace.current_coordinates() == {"step": 4, "sample_index": 9, "group_id": "g2"}
        run_tool(1)
    assert seg.traced and seg.trace_id == REMOTE_TRACE
    assert rtrace.flush(10)
    spans = {s.name: s for s in receiver.wait_for_spans(2, 10)}
    assert set(spans) == {"segment", "run_tool"}
    segment, tool = spans["segment"], spans["run_tool"]
    assert segment.trace_id == tool.trace_id == REMOTE_TRACE
    assert segment.parent_span_id == REMOTE_SPAN and tool.parent_span_id == segment.span_id
    assert segment.attributes == {"rl.step": 4, "rl.sample_index": 9, "rl.group_id": "g2", "rl.validate": False,
                                  "rtrace.kind": "segment", "rtrace.remote_parent": REMOTE_SPAN}
    assert tool.attributes["rtrace.input"] == '{"x": 1}' and tool.attributes["rl.step"] == 4
    assert rtrace.current_coordinates() == {}


def test_unsampled_traceparent_records_nothing_but_restores_coordinates(receiver):
    """With the sampled flag cleared nothing is exported; the coordinates are still visible inside."""
    _configure(receiver)
    with rtrace.extract(_carrier(flags="00")) as seg:
        assert rtrace.current_coordinates()["step"] == 4
        run_tool(1)
    assert not seg.traced
    assert rtrace.flush(10)
    assert receiver.spans == [] and "sink.otlp.exported" not in rtrace.stats()


def test_worker_cap_does_not_sample_out_segments(receiver):
    """The driver decided: a worker with max_traces_per_step=0 still records extracted segments."""
    _configure(receiver, max_traces_per_step=0)
    with rtrace.extract(_carrier()):
        run_tool(1)
    assert rtrace.flush(10)
    assert sorted(s.name for s in receiver.wait_for_spans(2, 10)) == ["run_tool", "segment"]


def test_no_traceparent_leaves_calls_as_their_own_trajectories(receiver):
    """Without a traceparent extract() does not invent a trace: a decorated call is its own root."""
    _configure(receiver)
    with rtrace.extract({"baggage": "rl.step=1"}) as seg:
        run_tool(1)
    assert not seg.traced and seg.trace_id is None
    assert rtrace.flush(10)
    [span] = receiver.wait_for_spans(1, 10)
    assert span.name == "run_tool" and span.parent_span_id is None and span.trace_id != REMOTE_TRACE


def test_concurrent_segments_of_one_trace_share_one_unit(receiver):
    """Two threads extracting the same trace at once export one unit holding both segments, each under its remote span."""
    _configure(receiver)
    barrier = threading.Barrier(2)

    def work(i):
        carrier = {"traceparent": f"00-{REMOTE_TRACE}-{i:016x}-01", "baggage": "rl.step=2"}
        with rtrace.extract(carrier, name=f"segment-{i}"):
            barrier.wait()
            run_tool(i)
            barrier.wait()  # both are inside before either leaves

    threads = [threading.Thread(target=work, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rtrace.flush(10)
    spans = {s.span_id: s for s in receiver.wait_for_spans(4, 10)}
    segments = {s.name: s for s in spans.values() if s.name.startswith("segment")}
    assert {n: s.parent_span_id for n, s in segments.items()} == {"segment-1": f"{1:016x}", "segment-2": f"{2:016x}"}
    tools = [s for s in spans.values() if s.name == "run_tool"]
    assert sorted((spans[t.parent_span_id].name, t.attributes["rtrace.input"]) for t in tools) == [
        ("segment-1", '{"x": 1}'), ("segment-2", '{"x": 2}')]
    assert {s.attributes["rtrace.kind"] for s in segments.values()} == {"segment"}
    stats = rtrace.stats()
    assert (stats["segments_started"], stats["segments_joined"], stats["sink.otlp.exported"]) == (1, 1, 1)
    assert "spans_late" not in stats


def test_sequential_segments_lose_nothing(receiver):
    """Segments of one trace run back to back (before the worker assembled the previous one) all arrive, none late."""
    _configure(receiver, export_interval_s=0.5)
    for i in range(5):
        with rtrace.extract(_carrier(), name=f"turn-{i}"):
            run_tool(i)
    assert rtrace.flush(10)
    spans = receiver.wait_for_spans(10, 10)
    names = sorted(s.name for s in spans)
    assert names == ["run_tool"] * 5 + [f"turn-{i}" for i in range(5)]
    assert {s.parent_span_id for s in spans if s.name.startswith("turn")} == {REMOTE_SPAN}
    assert "spans_late" not in rtrace.stats()


def test_extract_from_http_headers_joins_the_driver_trajectory(receiver):
    """A real HTTP hop: the server extracts from request headers; its spans join the open driver trajectory."""
    _configure(receiver)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            with rtrace.extract(self.headers, name="http-server"):  # headers: case-insensitive Message
                body = json.dumps({"y": run_tool(41), "coords": rtrace.current_coordinates()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        @rtrace.traced_tool
        def call_server():
            req = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/",
                                         headers=rtrace.inject({}))
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())

        with rtrace.rollout_context(step=6, sample_index=1) as rc:
            reply = call_server()
    finally:
        server.shutdown()
        server.server_close()
    assert reply == {"y": 42, "coords": {"step": 6, "sample_index": 1}}
    assert rtrace.flush(10)
    spans = {s.name: s for s in receiver.wait_for_spans(4, 10)}
    assert set(spans) == {"rollout", "call_server", "http-server", "run_tool"}
    assert {s.trace_id for s in spans.values()} == {rc.trace_id}
    assert spans["http-server"].parent_span_id == spans["call_server"].span_id
    assert spans["run_tool"].parent_span_id == spans["http-server"].span_id
    assert spans["run_tool"].attributes["rl.step"] == 6
    assert rtrace.stats()["sink.otlp.exported"] == 1  # one trajectory: the server's spans are in it


# ----------------------------------------------------------------------------- processes
def _worker(carriers):
    """Runs in a spawned process: configured from the environment (RTRACE_EXPORTER=otlp, ...)."""
    import rtrace as rt

    @rt.traced_tool
    def sandbox(code):
        return len(code)

    @rt.traced(kind="chain")
    def grade(n):
        return sandbox("x" * n) > 2

    for i, carrier in enumerate(carriers):
        with rt.extract(carrier, name="worker"):
            grade(i % 5)
    ok = rt.flush(60)
    stats = rt.stats()
    rt.shutdown()
    return ok, stats


@pytest.mark.integration
def test_four_worker_processes_join_driver_trajectories(receiver, monkeypatch):
    """4 spawned workers x 250 trajectories: every worker span arrives under its driver's trace id with its coordinates."""
    monkeypatch.setenv("RTRACE_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    monkeypatch.setenv("RTRACE_EXPORT_INTERVAL_S", "0.1")
    rtrace.configure()
    carriers, expected = [], {}
    for i in range(1000):
        with rtrace.rollout_context(step=i // 100, sample_index=i, group_id=f"g{i // 8}") as rc:
            carrier = dispatch()
        carriers.append(carrier)
        expected[rc.trace_id] = {"rl.step": i // 100, "rl.sample_index": i, "rl.group_id": f"g{i // 8}"}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(4, mp_context=ctx) as pool:
        results = list(pool.map(_worker, [carriers[k::4] for k in range(4)]))
    assert all(ok for ok, _ in results)
    assert sum(s["segments_started"] for _, s in results) == 1000
    assert sum(s["sink.otlp.exported"] for _, s in results) == 1000
    assert rtrace.flush(30)

    spans = receiver.wait_for_spans(1000 * 5, 60)
    assert len(spans) == 1000 * 5 and receiver.store.overflow == 0
    by_trace = receiver.by_trace()
    assert set(by_trace) == set(expected)
    for trace_id, group in by_trace.items():
        names = {s.name: s for s in group}
        assert sorted(names) == ["dispatch", "grade", "rollout", "sandbox", "worker"], trace_id
        assert names["worker"].parent_span_id == names["dispatch"].span_id
        assert names["grade"].parent_span_id == names["worker"].span_id
        assert names["sandbox"].parent_span_id == names["grade"].span_id
        for span in group:
            assert {k: span.attributes.get(k) for k in expected[trace_id]} == expected[trace_id], span.name
        assert names["worker"].resource["service.name"] == "rtrace"


def test_assembled_segment_units_are_let_go():
    """Segment units that ended and were assembled are not kept for rejoining (they hold their spans'
    records): after hundreds of extracts only the units still in flight are remembered."""
    from rtrace.instrumentation import propagation

    with rtrace.testing.capture() as got:
        for i in range(300):
            tid = format(i + 1, "032x")
            with rtrace.extract({"traceparent": f"00-{tid}-{'1' * 16}-01"}):
                run_tool(i)
            if i % 50 == 49:
                got.trajectories  # flushed: the worker assembled every unit so far
        assert len(got.trajectories) == 300
        assert len(propagation._closing) <= 64
