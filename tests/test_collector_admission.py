"""The collector's answers are true (issue #37): it pushes back before it accepts what it
cannot keep, says which spans it refused, counts each lost trajectory once, and evicts
without sorting its table.

Real parts: the collector's receiver (grpc.aio, HTTP), rtrace's worker sink
(`CollectorSink`), raw gRPC / HTTP clients that read the whole answer, JSONL read back.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from rtrace import _stats
from rtrace.config import load_settings
from rtrace.exporters.collector import CollectorSink
from rtrace.pipeline.admission import Ticket
from rtrace.pipeline.otlp_receiver import _EXPORT_METHOD, Backpressure, OtlpReceiver, PartialSuccess
from rtrace.pipeline.records import TrajectoryState
from rtrace.pipeline.registry import TrajectoryRegistry
from tests.test_collector_security import BAD_SPANS, _mutate, honest, request_of, written

#: the refusals checked at the request, answered to the sender; the others (the record,
#: the coordinates) need the worker's decoding and are counted after the answer
AT_THE_REQUEST = {"trace_id", "span_id", "parent_span_id", "size", "attributes"}


def export(endpoint: str, request) -> tuple[grpc.StatusCode, ExportTraceServiceResponse | None, dict]:
    """One Export call; (status, the decoded answer when OK, the trailing metadata)."""
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        call = channel.unary_unary(_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        try:
            body, info = call.with_call(request.SerializeToString(), timeout=30)
            return grpc.StatusCode.OK, ExportTraceServiceResponse.FromString(body), dict(info.trailing_metadata())
        except grpc.RpcError as exc:
            return exc.code(), None, dict(exc.trailing_metadata() or ())
    finally:
        channel.close()


def trajectories(first: int, n: int, step: int = 1) -> list:
    """Whole trajectories (a root and a tool span) of sample indices first ... first + n - 1."""
    return [honest(first + i + 1, step, first + i, 1.0) for i in range(n)]


class TestPushBackBeforeAccepting:
    def test_room_is_reserved_for_what_queued_requests_will_open(self, collector, tmp_path):
        """Two requests of 60 new trajectories against a table of 100, the first still queued (the
        worker has not run): the second is pushed back (RESOURCE_EXHAUSTED with RetryInfo) before
        anything of it is taken, and sent again later it is taken whole. Before, admission looked at
        the table alone (empty), answered both OK, and the worker dropped 20 trajectories."""
        c = collector(max_open_trajectories=100, export_interval_s=3600)  # the worker runs when woken
        _stats.reset()
        first, second = request_of(*trajectories(0, 60)), request_of(*trajectories(60, 60))
        assert export(c.endpoint, first)[0] == grpc.StatusCode.OK
        code, _, trailers = export(c.endpoint, second)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "google.rpc.retryinfo-bin" in trailers
        assert c.flush(30)  # the first is assembled and written: its room is free again
        code, answer, _ = export(c.endpoint, second)
        assert code == grpc.StatusCode.OK and answer.partial_success.rejected_spans == 0
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if not t.partial) == list(range(120))
        stats = c.stats()
        assert stats["receiver.backpressure_requests"] == 1
        assert stats["receiver.accepted_spans"] == 240 and stats["collector_backpressure_spans"] == 120
        assert "trajectories_dropped_open_limit" not in stats and "spans_dropped_open_limit" not in stats

    def test_a_full_queue_pushes_back_until_the_worker_drained_it(self, collector, tmp_path):
        """max_queue_size spans queued while the worker is busy (a sink's prepare holds it): the
        next request is pushed back, nothing of it taken; once the worker drained the queue it
        is taken."""
        import threading

        import rtrace

        class Stall(rtrace.Sink):
            name = "stall"

            def __init__(self):
                super().__init__(None)
                self.entered, self.release = threading.Event(), threading.Event()

            def prepare(self, trajectories):  # on the collector's worker thread
                self.entered.set()
                assert self.release.wait(30)

            def export(self, trajectories):
                pass

        stall = Stall()
        c = collector(max_queue_size=10, sinks=[stall])
        _stats.reset()
        assert export(c.endpoint, request_of(*trajectories(0, 1)))[0] == grpc.StatusCode.OK
        assert stall.entered.wait(30)  # the worker is inside prepare() now
        assert export(c.endpoint, request_of(*trajectories(1, 4)))[0] == grpc.StatusCode.OK  # 8 spans
        assert export(c.endpoint, request_of(*trajectories(5, 1)))[0] == grpc.StatusCode.OK  # 10: full
        code, _, trailers = export(c.endpoint, request_of(*trajectories(6, 1)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "google.rpc.retryinfo-bin" in trailers
        assert c.stats()["queued_spans"] == 10
        stall.release.set()
        assert c.flush(30)
        assert export(c.endpoint, request_of(*trajectories(6, 1)))[0] == grpc.StatusCode.OK
        assert sorted(t.sample_index for t in written(c, tmp_path)) == list(range(7))
        assert c.stats()["collector_backpressure_spans"] == 2

    def test_annotations_reserve_no_room(self, collector, tmp_path):
        """A driver's annotations (one span each, on a trace of its own) open no trajectory: a
        request of 50 is taken while 60 new trajectories are on their way into a table of 100,
        and every trajectory is written with its annotation."""
        from rtrace.pipeline.annotations import Annotation, coord_key
        from rtrace.pipeline.stream import _annotation_shell

        c = collector(max_open_trajectories=100, export_interval_s=3600)
        _stats.reset()
        assert export(c.endpoint, request_of(*trajectories(0, 60)))[0] == grpc.StatusCode.OK
        notes = [_annotation_shell(Annotation(coord_key({"step": 1, "sample_index": i, "rollout_n": 0, "validate": False}), None,
                                              {"advantage": i / 10})) for i in range(50)]
        code, answer, _ = export(c.endpoint, request_of(*notes))
        assert code == grpc.StatusCode.OK and answer.partial_success.rejected_spans == 0
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if "advantage" in t.annotations) == list(range(50))
        assert "collector_backpressure_spans" not in c.stats()

    def test_http_push_back_is_429_with_retry_after(self, collector, tmp_path):
        """The same over OTLP/HTTP: 429 with Retry-After, nothing taken."""
        c = collector(max_open_trajectories=100, export_interval_s=3600, http_port=0)
        _stats.reset()
        assert export(c.endpoint, request_of(*trajectories(0, 60)))[0] == grpc.StatusCode.OK
        req = urllib.request.Request(c.receiver.http_endpoint + "/v1/traces", method="POST",
                                     data=request_of(*trajectories(60, 60)).SerializeToString(),
                                     headers={"Content-Type": "application/x-protobuf"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
        assert sorted(t.sample_index for t in written(c, tmp_path)) == list(range(60))

    def test_a_request_larger_than_the_table_is_taken_in_part_and_the_sender_told(self, collector, tmp_path):
        """One request of 1,500 whole trajectories against max_open_trajectories=1000 (issue #37's
        reproduction: answered OK, 1,000 written, 500 dropped and counted 1,000 times): its first
        1,000 are taken and written, the other 500 refused at the request, answered as
        partial_success (their 1,000 spans, and why), and each counted once."""
        c = collector(max_open_trajectories=1000)
        _stats.reset()
        code, answer, _ = export(c.endpoint, request_of(*trajectories(0, 1500)))
        assert code == grpc.StatusCode.OK
        assert answer.partial_success.rejected_spans == 1000
        assert "max_open_trajectories" in answer.partial_success.error_message
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if not t.partial) == list(range(1000))
        stats = c.stats()
        assert stats["trajectories_dropped_open_limit"] == 500
        assert stats["collector_refused.capacity"] == 1000
        assert (stats["receiver.accepted_spans"], stats["receiver.rejected_spans"]) == (2000, 1000)
        assert "spans_dropped_open_limit" not in stats

    def test_the_worker_counts_a_trajectory_it_has_no_room_for_once(self, collector, tmp_path):
        """Should the worker still find the table full (every open trajectory settling, a request
        admitted without a reservation), each trajectory it cannot open is counted once in
        trajectories_dropped_open_limit, however many of its spans come (before: once per span)."""
        c = collector(max_open_trajectories=3, export_interval_s=3600, settle_s=3600)
        _stats.reset()
        pipeline = c.pipeline
        for tid in (901, 902, 903):  # the table full of trajectories whose root arrived (settling)
            state = pipeline.registry.open_or_get(tid, lambda tid=tid: TrajectoryState(tid, None, "r", "rollout", {}))
            assert pipeline.registry.claim_root(state, tid)
        request = request_of(*[honest(10 + i, 1, i, 1.0, children=3) for i in range(5)])
        sizes = [span.ByteSize() for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        with pipeline.admission._lock:  # queued as if admitted, with no room reserved
            pipeline.admission._tickets.append(Ticket(request, sizes, len(sizes), 0, 0))
            pipeline.admission.queued += len(sizes)
        assert c.flush(30)
        stats = c.stats()
        assert stats["trajectories_dropped_open_limit"] == 5 and stats["spans_dropped_open_limit"] == 20
        assert stats["queued_spans"] == 0 and stats["reserved_trajectories"] == 0


class TestRefusedSpansAreAnswered:
    @pytest.mark.parametrize("case", sorted(BAD_SPANS))
    def test_the_answer_says_what_was_refused(self, collector, tmp_path, case):
        """A request with one malformed span and three honest trajectories: a span refused at the
        request (ids, size, attributes) is answered partial_success.rejected_spans = 1 with the
        reason, and receiver.accepted_spans does not count it; one only the worker can read (its
        record, its coordinates) is refused there, after the answer, and counted."""
        mutate, why = BAD_SPANS[case]
        c = collector()
        _stats.reset()
        req = _mutate(request_of(honest(9, 1, 9, 0.0), *trajectories(1, 3)), 0, mutate)
        code, answer, _ = export(c.endpoint, req)
        assert code == grpc.StatusCode.OK
        rejected = 1 if why in AT_THE_REQUEST else 0
        assert answer.partial_success.rejected_spans == rejected
        assert (f"({why})" in answer.partial_success.error_message) is bool(rejected)
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs if not t.partial) == [1, 2, 3]
        stats = c.stats()
        assert stats["receiver.accepted_spans"] == 8 - rejected and stats["receiver.rejected_spans"] == rejected
        assert stats[f"collector_refused.{why}"] == 1 and stats["collector_spans_refused"] == 1

    def test_over_http_the_200_body_carries_the_partial_success(self, collector, tmp_path):
        c = collector(http_port=0)
        req = _mutate(request_of(*trajectories(1, 2)), 1, lambda s: setattr(s, "trace_id", bytes(16)))
        http = urllib.request.Request(c.receiver.http_endpoint + "/v1/traces", data=req.SerializeToString(),
                                      method="POST", headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(http, timeout=10) as resp:
            assert resp.status == 200
            answer = ExportTraceServiceResponse.FromString(resp.read())
        assert answer.partial_success.rejected_spans == 1
        assert "trace id not 16 bytes or all zero (trace_id)" in answer.partial_success.error_message
        assert c.stats()["receiver.accepted_spans"] == 3


class TestTheWorkersSink:
    def test_it_waits_the_delay_the_push_back_names(self):
        """RESOURCE_EXHAUSTED with RetryInfo: the worker's sink waits the delay it names. A delay
        beyond OTEL_EXPORTER_OTLP_TIMEOUT fails the request at once (counted: the segment as failed,
        for its collector too), without a second try (before: retried after 50 ms regardless)."""
        calls = []

        def busy(request):
            calls.append(request)
            raise Backpressure("full", retry_after_s=5.0)

        _stats.reset()
        with OtlpReceiver(busy) as rx:
            sink = CollectorSink(load_settings({"exporter": "collector", "collector_endpoint": rx.endpoint,
                                                "otlp_timeout_s": 2}))
            try:
                sink.export(trajectories(1, 1))  # routes and queues; the collector's lane sends
                assert sink.flush(10) is False
            finally:
                sink.shutdown()
            stats = _stats.snapshot()
            assert stats["sink.collector.failed_trajectories"] == 1 and stats["sink.collector.failed_batches"] == 1
            assert stats[f"collector_endpoint.{rx.endpoint}.failed"] == 1
            assert "sink.collector.sent" not in stats
        assert len(calls) == 1

    def test_it_counts_the_spans_the_collector_refused(self):
        """A partial success is counted at the sender (sink.collector.rejected_spans) and its next
        flush() says not everything was written."""
        with OtlpReceiver(lambda request: PartialSuccess(2, "two refused")) as rx:
            sink = CollectorSink(load_settings({"exporter": "collector", "collector_endpoint": rx.endpoint}))
            try:
                sink.export(trajectories(1, 2))
                assert sink.flush(1) is False and sink.flush(1) is True
            finally:
                sink.shutdown()
        assert _stats.snapshot()["sink.collector.rejected_spans"] == 2


class TestEviction:
    def test_evicting_one_reads_one_trajectory_not_the_table(self):
        """Eviction takes the least recently active trajectory waiting for its root from the front
        of an ordered table: evicting one of 20,000 looks at one (before: the whole table was
        sorted by last activity for each span that found it full)."""
        reads = [0]

        class Counted(TrajectoryState):
            __slots__ = ("_touched",)

            @property
            def touched(self):
                reads[0] += 1
                return self._touched

            @touched.setter
            def touched(self, value):
                self._touched = value

        registry = TrajectoryRegistry(20_000, 10)
        states = [registry.open_or_get(t, lambda t=t: Counted(t, None, "r", "rollout", {})) for t in range(1, 20_001)]
        registry.touch(states[0], 10)  # trace 1 active again: trace 2 is now the least recent
        reads[0] = 0
        [evicted] = registry.evict(19_999, 1 << 30)
        assert evicted.trace_id == 2 and evicted.partial
        assert reads[0] <= 1
        assert len(registry) == 19_999 and registry.lookup(2) is None


class TestFlushReleasesEverything:
    def test_a_flush_waits_for_room_in_a_sinks_queue_instead_of_dropping(self, collector, tmp_path):
        """A flush releases everything the collector holds at once (here 40 trajectories still
        settling, 10 batches of 4, into a sink whose queue holds 2): the collector's worker waits
        for room while the sink makes progress, and the sink gets all 40; before, the queue
        thinned 32 of them (counted as dropped) and flush() was False. Found by bench_collector
        (c), where a flush of a full table overran the JSONL sink's queue."""
        import time as time_mod

        import rtrace

        class Slow(rtrace.Sink):
            name = "slow"

            def __init__(self):
                super().__init__(None)
                self.got = []

            def export(self, trajectories):
                time_mod.sleep(0.02)  # a backend that takes a moment per batch
                self.got.extend(trajectories)

        slow = Slow()
        c = collector(settle_s=3600, sinks=[slow], sink_queue_size=2, max_export_batch_size=4)
        _stats.reset()
        assert export(c.endpoint, request_of(*trajectories(0, 40)))[0] == grpc.StatusCode.OK
        assert c.flush(60)
        assert sorted(t.sample_index for t in slow.got) == list(range(40))
        stats = c.stats()
        assert stats["sink.slow.exported"] == 40 and "sink.slow.dropped_trajectories" not in stats


class TestASinkBehind:
    def test_a_slow_sink_holds_the_senders_back_instead_of_dropping(self, collector, tmp_path):
        """A sink slower than the senders, its queue small: the collector's worker waits for room
        while the sink makes progress, its queue fills, the receiver pushes back, and rtrace's
        worker sink waits and sends again: every trajectory reaches the slow sink, none thinned
        (before: the sink's full queue thinned what the senders had been told was taken; the
        16-client load test saw it on a busy machine)."""
        import time as time_mod

        import rtrace

        class Slow(rtrace.Sink):
            name = "slow"

            def __init__(self):
                super().__init__(None)
                self.got = []

            def export(self, trajectories):
                time_mod.sleep(0.01 * len(trajectories))  # 100 trajectories/s
                self.got.extend(trajectories)

        slow = Slow()
        # no settle time: the worker hands each request's trajectories to the slow sink in the round
        # that assembles it, and waits there (~0.2 s a request) while the next requests come (finished
        # trajectories that settle wait apart from the open table, so they do not fill it: issue 40)
        c = collector(settle_s=0, sinks=[slow], sink_queue_size=1, max_export_batch_size=4,
                      max_queue_size=64, max_open_trajectories=40)
        _stats.reset()
        sink = CollectorSink(load_settings({"exporter": "collector", "collector_endpoint": c.endpoint,
                                            "otlp_timeout_s": 60}))
        try:
            for i in range(10):  # 200 trajectories, 20 a request: 2 s of the slow sink's time
                sink.export(trajectories(20 * i, 20))
            assert sink.flush(60)  # the collector's lane sent them all, retrying on push-back
        finally:
            sink.shutdown()
        assert c.flush(60)
        assert sorted(t.sample_index for t in slow.got) == list(range(200))
        stats = c.stats()
        assert "sink.slow.dropped_trajectories" not in stats and stats["sink.slow.exported"] == 200
        assert stats["receiver.backpressure_requests"] >= 1  # the senders were held back

    def test_a_stuck_sink_is_not_waited_for(self, collector, tmp_path):
        """A sink stuck in one export longer than sink_timeout_s is not waited for: it thins what it
        cannot take (counted), and the other sink gets every trajectory."""
        import threading
        import time as time_mod

        import rtrace
        from rtrace.testing import MemorySink

        class Stuck(rtrace.Sink):
            name = "stuck"

            def __init__(self):
                super().__init__(None)
                self.release = threading.Event()

            def export(self, trajectories):
                self.release.wait(60)

        stuck, memory = Stuck(), MemorySink()
        c = collector(settle_s=0.05, sinks=[stuck, memory], sink_queue_size=1, max_export_batch_size=2,
                      sink_timeout_s=0.5)
        _stats.reset()
        try:
            for i in range(4):
                assert export(c.endpoint, request_of(*trajectories(10 * i, 10)))[0] == grpc.StatusCode.OK
            assert not c.flush(30)  # the stuck sink did not write (and dropped) what it got
            # that flush's markers share one deadline and the stuck sink's used it up: the other
            # sink may still be writing its last batch (bounded wait)
            deadline = time_mod.monotonic() + 10
            while len(memory.trajectories) < 40 and time_mod.monotonic() < deadline:
                time_mod.sleep(0.02)
            assert sorted(t.sample_index for t in memory.trajectories) == sorted(
                10 * i + k for i in range(4) for k in range(10))
            stats = c.stats()
            assert stats["sink.stuck.dropped_trajectories"] >= 30 and stats["sink.memory.exported"] == 40
        finally:
            stuck.release.set()
