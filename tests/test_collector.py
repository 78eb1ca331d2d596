"""The job's collector with real worker processes (spawned, configured only by collector.env).

Real parts: the collector's OTLP/gRPC receiver, the OTel SDK's OTLP exporter in each
worker, the JSONL sink read back from disk.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

import rtrace
from rtrace.exporters.jsonl import read_jsonl
from rtrace.pipeline.sampling import priority
from tests import collector_workers as workers




@pytest.mark.integration
class TestJobWideSampling:
    def test_exact_cap_per_step_whole_groups_across_four_processes(self, collector, tmp_path):
        """4 worker processes, cap 8 per step with whole groups: exactly 8 per step job-wide (not 8 per
        worker), each kept trajectory once with one root, and the kept groups are the 2 of lowest
        priority (not the first to arrive); validation has its own cap."""
        c = collector(max_traces_per_step=8, max_val_traces_per_step=3, sample_groups=True, sample_seed=7)
        procs = [workers.start(workers.rollouts, c.env, w, 4, 2, 8, 4, 8) for w in range(4)]
        workers.join_all(procs)
        assert c.flush(30)
        trajs = read_jsonl(tmp_path / "traces.jsonl")
        train = [t for t in trajs if not t.validate]
        assert Counter(t.step for t in train) == {0: 8, 1: 8}
        assert Counter(t.step for t in trajs if t.validate) == {0: 3, 1: 3}
        for step in (0, 1):
            kept = {t.sample_index for t in train if t.step == step}
            expected = sorted(range(8), key=lambda p: priority(
                {"step": step, "sample_index": p, "group_id": f"p{p}", "validate": False}, 7, True))[:2]
            assert kept == set(expected)  # two whole groups (4 rollouts each), chosen by priority
        assert len({t.trace_id for t in trajs}) == len(trajs)  # each once
        for t in trajs:
            assert [s.kind for s in t.spans] == ["rollout", "agent", "tool"] and not t.partial
            assert sum(1 for s in t.spans if s.parent_id is None) == 1
            assert t.spans[2].attributes["gen_ai.tool.name"] == "calculator"
            assert t.spans[2].output == t.sample_index * 2  # captured values crossed the wire
        stats = c.stats()
        assert stats["trajectories_sampled_out"] == 2 * (32 - 8) + 2 * (8 - 3)
        assert stats["receiver.accepted_spans"] == 2 * (32 + 8) * 3

    def test_no_cap_keeps_everything(self, collector, tmp_path):
        """Without a cap every trajectory of every worker arrives, once."""
        c = collector()
        workers.join_all([workers.start(workers.rollouts, c.env, w, 2, 1, 6, 2) for w in range(2)])
        assert c.flush(30)
        trajs = read_jsonl(tmp_path / "traces.jsonl")
        assert sorted((t.sample_index, t.rollout_n) for t in trajs) == [(p, r) for p in range(6) for r in range(2)]
        assert [t.reward for t in sorted(trajs, key=lambda t: (t.sample_index, t.rollout_n))] == [0.0, 1.0] * 6


@pytest.mark.integration
class TestAnnotations:
    def test_driver_annotations_join_trajectories_from_two_processes(self, collector, tmp_path):
        """3 steps x 16 groups x 4 rollouts in 2 processes; the driver annotates advantages afterwards
        from shuffled tensors: every trajectory carries its own value, none missing or misassigned."""
        torch = pytest.importorskip("torch")
        c = collector(await_annotations="advantage", annotation_timeout_s=60)
        workers.join_all([workers.start(workers.rollouts, c.env, w, 2, 3, 16, 4) for w in range(2)])
        for step in range(3):
            perm = torch.randperm(64, generator=torch.Generator().manual_seed(step))
            index = torch.arange(16).repeat_interleave(4)[perm]
            rollout = torch.arange(4).repeat(16)[perm]
            advantage = (step * 1000 + index * 10 + rollout).float()
            assert rtrace.annotate_batch(step=step, sample_index=index, rollout_n=rollout,
                                         advantage=advantage, returns=advantage / 2) == 64
        assert c.flush(30), c.stats()
        assert (tmp_path / "traces.jsonl").exists(), c.stats()
        trajs = read_jsonl(tmp_path / "traces.jsonl")
        assert len(trajs) == 3 * 64
        for t in trajs:
            expected = float(t.step * 1000 + t.sample_index * 10 + t.rollout_n)
            assert t.annotations == {"advantage": expected, "returns": expected / 2}
            assert t.root.attributes["rl.advantage"] == expected
        assert c.stats().get("trajectories_missing_annotations", 0) == 0

    def test_annotate_batch_checks_shapes(self, collector):
        """A column of the wrong length raises ValueError naming it."""
        collector()
        with pytest.raises(ValueError, match="advantage has 3 entries; sample_index has 4"):
            rtrace.annotate_batch(step=1, sample_index=[0, 1, 2, 3], rollout_n=[0, 0, 0, 0], advantage=[1, 2, 3])


@pytest.mark.integration
class TestAcrossProcesses:
    def test_driver_worker_tool_server_is_one_tree(self, collector, tmp_path):
        """A trajectory that runs in the driver, a worker and a tool server (3 processes) is one
        trajectory with one root and the right parents."""
        c = collector()
        rtrace.configure(**{k.lower().removeprefix("rtrace_"): v for k, v in c.env.items()
                            if k in ("RTRACE_EXPORTER", "RTRACE_COLLECTOR_ENDPOINT")})
        port_q, stop, out = workers.SPAWN.Queue(), workers.SPAWN.Event(), workers.SPAWN.Queue()
        server = workers.start(workers.tool_server, c.env, port_q, stop)
        port = port_q.get(timeout=60)

        @rtrace.traced(kind="chain", name="driver.dispatch")
        def dispatch():
            carrier = rtrace.inject({})
            worker = workers.start(workers.hop_worker, c.env, carrier, port, out)
            result = out.get(timeout=60)
            worker.join(60)
            return result

        with rtrace.rollout_context(step=2, sample_index=5, rollout_n=1) as ctx:
            assert dispatch() == 42
        stop.set()
        server.join(60)
        assert rtrace.flush(10)
        assert c.flush(30)
        (traj,) = read_jsonl(tmp_path / "traces.jsonl")
        assert traj.trace_id == ctx.trace_id and not traj.partial
        by_name = {s.name: s for s in traj.spans}
        # the tool span is named after its tool ("doubler"), the function's name kept in code.function.name
        assert set(by_name) == {"rollout", "driver.dispatch", "worker", "worker.plan", "tool-server", "doubler"}
        parent = {s.name: next((p.name for p in traj.spans if p.span_id == s.parent_id), None) for s in traj.spans}
        assert parent == {"rollout": None, "driver.dispatch": "rollout", "worker": "driver.dispatch",
                          "worker.plan": "worker", "tool-server": "worker.plan", "doubler": "tool-server"}
        assert by_name["doubler"].output == 42 and by_name["doubler"].attributes["code.function.name"] == (
            "tests.collector_workers.tool_server.<locals>.double")
        assert {s.attributes["rl.sample_index"] for s in traj.spans} == {5}


@pytest.mark.integration
class TestFailures:
    def test_killed_worker_keeps_finished_and_writes_open_as_partial(self, collector, tmp_path):
        """SIGKILL a worker mid-rollout: what it finished before is there, its open rollout is
        written as partial with the span that did arrive."""
        c = collector(orphan_timeout_s=2.0)
        ready = workers.SPAWN.Event()
        proc = workers.start(workers.finish_then_hang, c.env, 5, ready)
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and c.stats().get("trajectories_partial", 0) < 1:
            time.sleep(0.2)
        assert c.flush(30)
        trajs = sorted(read_jsonl(tmp_path / "traces.jsonl"), key=lambda t: t.sample_index)
        assert [(t.sample_index, t.partial) for t in trajs] == [(i, False) for i in range(5)] + [(5, True)]
        partial = trajs[-1]
        assert [s.kind for s in partial.spans] == ["rollout", "tool"] and partial.spans[1].output == 0
        assert partial.step == 0  # coordinates recovered from the spans that arrived

    def test_collector_down_leaves_the_program_alone_and_counts(self, tmp_path):
        """Workers pointed at a collector that is not there: results unchanged, failures counted."""
        from tests.servers import free_port

        env = {"RTRACE_EXPORTER": "collector", "RTRACE_COLLECTOR_ENDPOINT": f"127.0.0.1:{free_port()}",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "500"}
        out = workers.SPAWN.Queue()
        proc = workers.start(workers.against_dead_collector, env, 20, out)
        results, flushed, stats = out.get(timeout=120)
        proc.join(30)
        assert results == [i * 3 for i in range(20)]
        assert flushed is False
        lost = stats.get("sink.collector.failed_batches", 0) + stats.get("sink.collector.dropped_batches", 0)
        assert lost >= 1 and stats.get("sink.collector.sent", 0) == 0
        # every segment routed to the collector's send queue (exported) is counted as lost
        assert stats["sink.collector.failed_trajectories"] + stats.get("sink.collector.dropped_trajectories", 0) \
            == stats["sink.collector.exported"] == stats["segments_streamed"]


@pytest.mark.integration
class TestLoad:
    def test_sixteen_clients_lose_nothing_uncounted(self, collector, tmp_path):
        """Issue #37's load: 16 worker processes send 1,600 whole trajectories each, 400 per request,
        at once, into a collector whose table takes 2,000 new trajectories (each request reserves room
        for its 400 until it is assembled; then they settle 2 s in the waiting table, apart: issue 40):
        more than the table holds. The collector pushes back before it accepts; rtrace's worker
        sink waits the delay it names and sends again. All 25,600 are written, each once, whole (or a
        loss is counted at the sender); the worker never drops what it accepted (before: 17,952 to
        20,576 written, all 64 requests answered OK)."""
        clients, n, per_request = 16, 1600, 400
        c = collector(settle_s=2.0, max_open_trajectories=2000)
        ready_events, go = [workers.SPAWN.Event() for _ in range(clients)], workers.SPAWN.Event()
        queues = [workers.SPAWN.Queue() for _ in range(clients)]
        procs = [workers.start(workers.load_client, c.endpoint, i, n, per_request, 30.0, ready_events[i], go, queues[i])
                 for i in range(clients)]
        for ready in ready_events:
            assert ready.wait(120)
        go.set()
        reports = [q.get(timeout=300) for q in queues]
        workers.join_all(procs)
        failed = sum(r[0] for r in reports)
        rejected = sum(r[1] for r in reports)
        stats = c.stats()
        trajs = written(c, tmp_path)
        ids = Counter(t.trace_id for t in trajs)
        assert all(k == 1 for k in ids.values())  # each once
        whole = sum(1 for t in trajs if not t.partial and len(t.spans) == 3)
        # every trajectory is written whole, or the sender counted its loss
        assert whole + failed == clients * n and rejected == 0
        assert whole == clients * n, f"{failed} lost at the senders (push-back past their timeout)"
        assert stats["receiver.backpressure_requests"] >= 1  # the burst was more than the table
        assert sum(r[2] for r in reports) == stats["receiver.backpressure_requests"]
        for lost in ("spans_dropped_open_limit", "trajectories_dropped_open_limit", "trajectories_evicted",
                     "collector_spans_refused"):
            assert lost not in stats, lost


def written(c, tmp_path):
    """What the collector wrote to JSONL, once flushed and stopped."""
    assert c.flush(120)
    c.stop()
    path = tmp_path / "traces.jsonl"
    return read_jsonl(path) if path.exists() else []


@pytest.mark.integration
class TestDecodingInTheCollector:
    def test_worker_sends_ids_collector_decodes(self, collector, tmp_path, tok):
        """token2text runs in the collector: the worker has no tokenizer, the texts are on the spans."""
        c = collector(token2text=True, tokenizer=tok)
        prompt = tok.encode("What is 6 * 7?")
        response = tok.encode("The answer is 42.")
        workers.join_all([workers.start(workers.generations, c.env, prompt, response)])
        assert c.flush(30)
        (traj,) = read_jsonl(tmp_path / "traces.jsonl")
        gen = next(s for s in traj.spans if s.kind == "generation")
        assert gen.attributes["rtrace.prompt_text"] == tok.decode(prompt, skip_special_tokens=True)
        assert gen.attributes["rtrace.response_text"] == tok.decode(response, skip_special_tokens=True)
        assert gen.attributes["gen_ai.usage.input_tokens"] == len(prompt)
        assert gen.attributes["gen_ai.request.model"] == "toy"


@pytest.mark.integration
class TestRestart:
    def test_collector_restarted_mid_run_loses_at_most_what_was_in_flight(self, tmp_path):
        """Stop the collector mid-run and start a new one on the same port: the worker's retries
        reach the new one; every trajectory is written by one of them, or counted as lost."""
        from tests.servers import free_port

        port = free_port()
        first = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "a.jsonl"), port=port,
                                       settle_s=0.3, orphan_timeout_s=1.0)
        env = dict(first.env, OTEL_EXPORTER_OTLP_TIMEOUT="20000")
        out = workers.SPAWN.Queue()
        proc = workers.start(workers.steady, env, 120, 0.025, out)
        time.sleep(2.0)
        first.stop()  # open trajectories written as partial; the worker's next batches are retried
        time.sleep(0.5)
        second = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "b.jsonl"), port=port,
                                        settle_s=0.3, orphan_timeout_s=1.0)
        try:
            flushed, stats = out.get(timeout=120)
            proc.join(30)
            assert second.flush(30)
        finally:
            second.stop()
        written = read_jsonl(tmp_path / "a.jsonl") + read_jsonl(tmp_path / "b.jsonl")
        complete = {t.sample_index for t in written if not t.partial}
        partial = {t.sample_index for t in written if t.partial}
        lost_batches = stats.get("sink.collector.failed_batches", 0) + stats.get("sink.collector.dropped_batches", 0)
        missing = set(range(120)) - complete - partial
        assert flushed is (lost_batches == 0)
        # nothing silently lost: what is missing was in a batch the worker counted as lost
        assert not missing or lost_batches > 0
        assert len(partial) <= 5  # only what was open at the stop
        assert len(complete) >= 110


def _rtrace_collect(jsonl_path, *args):
    """`rtrace collect --exporter jsonl` as a process writing ``jsonl_path``, and the worker
    environment it printed (its ``export KEY=VALUE`` lines, read for up to 60 s)."""
    from tests.servers import start_rtrace_collect

    env = dict(os.environ, RTRACE_JSONL_PATH=str(jsonl_path), HF_HUB_OFFLINE="1")
    return start_rtrace_collect(env, "jsonl", *args)


@pytest.mark.integration
class TestCollectCli:
    def test_rtrace_collect_prints_the_worker_env_and_writes_on_sigterm(self, tmp_path):
        """`rtrace collect` runs the collector as a process: its printed environment is all a worker
        needs, and SIGTERM writes what it holds."""
        path = tmp_path / "cli.jsonl"
        proc, worker_env = _rtrace_collect(path, "--project", "cli-proj", "--max-traces-per-step", "3")
        try:
            assert worker_env["RTRACE_EXPORTER"] == "collector" and worker_env["RTRACE_PROJECT"] == "cli-proj"
            workers.join_all([workers.start(workers.rollouts, worker_env, 0, 1, 2, 4, 2)])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        assert proc.returncode == 0
        trajs = read_jsonl(path)
        assert Counter(t.step for t in trajs) == {0: 3, 1: 3}  # the job-wide cap of the CLI

    def test_torchrun_ranks_configured_by_the_printed_env(self, tmp_path):
        """docs/multi-process.md's torchrun line on one node: `rtrace collect`, then torchrun with
        RTRACE_EXPORTER=collector and the endpoint; every rank's trajectories reach the one collector."""
        import subprocess
        import sys

        pytest.importorskip("torch")
        path = tmp_path / "torchrun.jsonl"
        proc, worker_env = _rtrace_collect(path)
        try:
            endpoint = worker_env.get("RTRACE_COLLECTOR_ENDPOINT")
            assert endpoint, "rtrace collect printed no endpoint"
            run_env = {k: v for k, v in os.environ.items() if not k.startswith("RTRACE_")}
            run_env.update(RTRACE_EXPORTER="collector", RTRACE_COLLECTOR_ENDPOINT=endpoint, HF_HUB_OFFLINE="1",
                           PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                                   "--nproc-per-node=2", os.path.join(os.path.dirname(__file__), "torchrun_train.py")],
                                  env=run_env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        assert proc.returncode == 0
        trajs = read_jsonl(path)
        assert sorted((t.step, t.sample_index, t.reward) for t in trajs) == sorted(
            (step, rank * 4 + i, float(rank)) for rank in range(2) for step in range(2) for i in range(4))
        assert all(not t.partial and len(t.spans) == 2 for t in trajs)


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json-module"])
def test_compact_form_round_trips_every_field(orjson, monkeypatch):
    """encode_compact (worker) -> protobuf bytes -> unpack + _record (collector): the
    same SpanRecords, with error status, events, a remote parent, non-ASCII text, a lone
    surrogate, a non-finite float and token ids; records written by orjson (when
    installed) or by the json module alike."""
    from rtrace import _serialize

    if orjson:
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(_serialize, "_orjson_dumps", None)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from rtrace.exporters.otel import encode_compact
    from rtrace.pipeline.collector import _record, unpack
    from rtrace.pipeline.otlp_receiver import spans_of
    from rtrace.trajectory import SpanRecord, Trajectory

    root = SpanRecord("00000000000000a1", None, "rollout", "segment", 10, 20,
                      attributes={"rl.step": 3, "rl.sample_index": 7, "rl.validate": False, "rtrace.root": True,
                                  "rtrace.remote_parent": "00000000000000f0", "rl.reward": 0.5})
    child = SpanRecord("00000000000000a2", "00000000000000a1", "gen\u00e9ration", "generation", 11, 19,
                       status="error", error="boom \u00fc", attributes={"gen_ai.usage.output_tokens": 4},
                       input={"messages": [{"role": "user", "content": "\u4f60\u597d"}]}, output={"x": [1, 2.5]},
                       events=[{"name": "exception", "time_ns": 12, "attributes": {"exception.type": "ValueError"}}],
                       prompt_ids=[1, 2, 3], response_ids=[4, 5])
    odd = SpanRecord("00000000000000a3", "00000000000000a1", "bad\ud800name", "tool", 12, 12,
                     attributes={"score": float("nan"), "big": -(2**64) + 1, "near": 2**63 + 5},
                     output={"u": 2**64 - 1, "x": 1e300, "esc": "\\ud800 \u0000"})
    wide = SpanRecord("00000000000000a4", "00000000000000a1", "wide", "tool", 13, 14,
                      output={"v": -(2**63) - 1})  # plain, but beyond what orjson writes: the json module
    request = encode_compact([Trajectory("0" * 31 + "9", "rollout", [root, child, odd, wide])],
                             {"service.name": "w"})
    request = ExportTraceServiceRequest.FromString(request.SerializeToString())
    resource, _, _ = next(iter(spans_of(request)))
    decoded = [_record(span, *unpack(span)) for _, _, span in spans_of(request)]
    assert [int.from_bytes(s.trace_id, "big") for _, _, s in spans_of(request)] == [9, 9, 9, 9]
    assert decoded[3] == wide and type(decoded[3].output["v"]) is int

    assert decoded[0] == SpanRecord("00000000000000a1", "00000000000000f0", "rollout", "segment", 10, 20,
                                    attributes={"rl.step": 3, "rl.sample_index": 7, "rl.validate": False,
                                                "rtrace.remote_parent": "00000000000000f0", "rl.reward": 0.5})
    assert decoded[1] == child
    assert decoded[2] == SpanRecord("00000000000000a3", "00000000000000a1", "bad?name", "tool", 12, 12,
                                    attributes={"score": "NaN", "big": -(2**64) + 1, "near": 2**63 + 5},
                                    output={"u": 2**64 - 1, "x": 1e300, "esc": "\\ud800 \u0000"})
    assert type(decoded[2].attributes["big"]) is int and type(decoded[2].output["u"]) is int

    # the coordinates are real OTLP attributes on the root only (routable by an OTel Collector)
    spans = [s for _, _, s in spans_of(request)]
    assert {kv.key for kv in spans[0].attributes} == {"rl.step", "rl.sample_index", "rl.validate", "rl.reward",
                                                       "rtrace.record"}
    assert [kv.key for kv in spans[1].attributes] == ["rtrace.record"]
    assert spans[0].flags == 0x300 and spans[1].flags == 0x100


@pytest.mark.parametrize("value", [-(2**64) + 1, -(2**63) - 1, -(2**63), 2**63, 2**64 - 1, 0.1, -0.0, 1e-320, -1.0,
                                   -1234567890123456789, -1.5e300,
                                   "-1 and -9", "\\ud800", ["a", 1, None, True]])
def test_compact_record_values_read_back_exactly(value):
    """The collector reads a record's values exactly as the json module does (it may use
    orjson, which reads integers outside [-2**63, 2**64) as floats), token ids too."""
    import json

    from rtrace.pipeline.collector import _record_json

    for record in ({"kind": "tool", "output": value}, {"kind": "generation", "prompt_ids": [1, 2**64 + 5, 3],
                                                       "response_ids": [2**70]}):
        text = json.dumps(record, ensure_ascii=False)
        got = _record_json(text)
        assert got == json.loads(text)
        assert [type(v) for v in got.values()] == [type(v) for v in json.loads(text).values()]
        assert all(type(i) is int for i in got.get("prompt_ids", []) + got.get("response_ids", []))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "output" in got:
            assert type(got["output"]) is type(value)


class TestGc:
    def test_start_collector_leaves_the_applications_gc_alone(self, tmp_path):
        """start_collector runs in an application's process: its GC thresholds and frozen
        objects are the application's, before, during and after the collector's work."""
        import gc

        before = gc.get_threshold(), gc.get_freeze_count()
        c = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "gc.jsonl"), settle_s=0.05)
        try:
            workers.join_all([workers.start(workers.rollouts, c.env, 0, 1, 2, 4, 2)])
            assert c.flush(30)
            assert (gc.get_threshold(), gc.get_freeze_count()) == before
        finally:
            c.stop()
        assert (gc.get_threshold(), gc.get_freeze_count()) == before
        assert len(read_jsonl(tmp_path / "gc.jsonl")) == 16  # 2 steps x 4 prompts x 2 rollouts

    def test_tune_gc_freezes_and_raises_the_thresholds(self):
        """tune_gc (what `rtrace collect` does to its own process): what exists is frozen out
        of collections, the thresholds become COLLECTOR_GC_THRESHOLD, the old ones returned."""
        import gc

        from rtrace.pipeline.collector import COLLECTOR_GC_THRESHOLD, tune_gc

        before = gc.get_threshold()
        try:
            assert tune_gc() == before
            assert gc.get_threshold() == COLLECTOR_GC_THRESHOLD and gc.get_freeze_count() > 0
        finally:
            gc.set_threshold(*before)
            gc.unfreeze()

    def test_rtrace_collect_tunes_its_own_process(self, monkeypatch, tmp_path, capsys):
        """`rtrace collect` calls tune_gc and tune_malloc once it runs (its process is the
        collector's alone), and prints its counters when it stops."""
        import json
        import signal
        import threading

        from rtrace import cli
        from rtrace.pipeline import collector as collector_module

        calls = []
        monkeypatch.setattr(collector_module, "tune_gc", lambda: calls.append(1))
        monkeypatch.setattr(collector_module, "tune_malloc", lambda: calls.append(2))
        monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "cli.jsonl"))
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            assert cli.main(["collect", "--exporter", "jsonl", "--port", "0"]) == 0
        finally:
            timer.cancel()
            for s, h in handlers.items():
                signal.signal(s, h)
        assert calls == [1, 2]
        out = capsys.readouterr().out
        assert "rtrace collector stopped" in out
        # its counters, as one JSON line after it stopped
        stats = json.loads(out.split("# rtrace stats: ", 1)[1].splitlines()[0])
        assert stats["receiver.requests"] == 0 and stats["open_trajectories"] == 0

    @pytest.mark.integration
    def test_request_bodies_leave_the_collectors_memory(self, tmp_path):
        """`rtrace collect` (its GC tuned: full collections rare) takes 10 requests of sixteen 3 MiB
        spans (written) and 10 of one 48 MiB span (refused): once written, its memory is back near
        where it was before them, without a collection. Measured in the collector's own process.
        Before: every gRPC body stayed in a reference cycle until a full collection (+963 MiB here);
        with that fixed, glibc's heaps still kept the freed blocks (~+580 MiB; +150-250 with the
        fixed mmap threshold alone) until tune_malloc and release_memory (malloc_trim once idle)."""
        import grpc

        from rtrace.exporters.otel import encode_compact
        from rtrace.pipeline.otlp_receiver import _EXPORT_METHOD
        from rtrace.trajectory import SpanRecord, Trajectory

        if not os.path.exists("/proc/self/status"):
            pytest.skip("reads the collector's RSS from /proc")
        mib = 1 << 20

        def rss(pid):
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

        def body(first, count, size):
            trajs = [Trajectory(f"{t:032x}", "rollout", [SpanRecord(f"{t:016x}", None, "rollout", "rollout", 1, 2,
                     attributes={"rl.step": 0, "rl.sample_index": t, "rtrace.root": True}, output="x" * size)])
                     for t in range(first, first + count)]
            return encode_compact(trajs, {"service.name": "big"}, max_value_chars=size + 16).SerializeToString()

        path = tmp_path / "mem.jsonl"
        proc, env = _rtrace_collect(path)
        channel = grpc.insecure_channel(env["RTRACE_COLLECTOR_ENDPOINT"],
                                        options=[("grpc.max_send_message_length", 64 * mib)])
        send = channel.unary_unary(_EXPORT_METHOD)

        def lines():
            return sum(1 for _ in open(path, "rb")) if path.exists() else 0

        def until(predicate, timeout_s=120.0):
            deadline = time.monotonic() + timeout_s
            while not predicate() and time.monotonic() < deadline:
                time.sleep(0.25)
            return predicate()

        try:
            huge = body(1 << 40, 1, 48 * mib)  # one span over RTRACE_COLLECTOR_MAX_SPAN_BYTES: refused
            for i in range(2):  # warm up: imports, thread heaps, the sink's file
                send(body(1 + 16 * i, 16, 3 * mib), timeout=60)
                send(huge, timeout=60)
            assert until(lambda: lines() == 32)
            time.sleep(3.0)  # idle: what was held for the warm-up is let go
            before = rss(proc.pid)
            for i in range(2, 12):
                send(body(1 + 16 * i, 16, 3 * mib), timeout=60)
                send(huge, timeout=60)
            assert until(lambda: lines() == 32 + 160)
            # back near where it was (one request's worth above at most), within a bounded wait
            assert until(lambda: rss(proc.pid) < before + 48 * mib, 60.0), (rss(proc.pid) - before) // mib
        finally:
            channel.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
