"""Beyond one collector (issue 40): workers and the trainer route each rollout to the collector
that owns its key (rtrace/placement.py), and a trainer's annotate_batch for a step of 10^5
rollouts arrives whole.

Real parts: rtrace collectors started in this process on their own ports (their OTLP/gRPC
receivers, JSONL read back), worker and trainer processes configured only by the
environment, with ``RTRACE_COLLECTOR_ENDPOINT`` a comma list.
"""

from __future__ import annotations

from collections import Counter

import pytest

from rtrace.exporters.jsonl import read_jsonl
from rtrace.placement import Ring, route_key
from tests import collector_workers as workers

JOB = {"experiment": "run-7", "job_id": "job-40", "settle_s": 0.5}



def _env(first, endpoints):
    """A worker's environment: the first collector's, with the list of every collector."""
    return dict(first.env, RTRACE_COLLECTOR_ENDPOINT=",".join(endpoints))


@pytest.mark.integration
class TestRoutingAcrossCollectors:
    def test_each_rollout_and_its_annotations_land_whole_on_its_owner(self, collector, tmp_path):
        """Two collectors, one worker process and one trainer process, both given the list: every
        rollout is written by the collector that owns its key, whole and once; a GRPO group (one
        sample_index) never splits; the trainer's advantages reach the same collector and join."""
        a = collector(jsonl_path=str(tmp_path / "a.jsonl"), await_annotations="advantage",
                      annotation_timeout_s=60, **JOB)
        b = collector(jsonl_path=str(tmp_path / "b.jsonl"), await_annotations="advantage",
                      annotation_timeout_s=60, **JOB)
        env = _env(a, [a.endpoint, b.endpoint])
        steps, prompts, n, val = 2, 12, 4, 3
        workers.join_all([workers.start(workers.rollouts, env, 0, 1, steps, prompts, n, val)], 300)
        out = workers.SPAWN.Queue()
        trainer = workers.start(workers.trainer, env, steps, prompts, n, out)
        flushed, stats = out.get(timeout=120)
        workers.join_all([trainer], 300)
        assert flushed and stats["sink.collector.sent"] == steps * prompts * n == stats["annotations_sent"]
        ring = Ring([a.endpoint, b.endpoint])
        written = {}
        for c, path in ((a, "a.jsonl"), (b, "b.jsonl")):
            assert c.flush(60)
            written[c.endpoint] = read_jsonl(tmp_path / path) if (tmp_path / path).exists() else []
            assert c.stats().get("trajectories_missing_annotations", 0) == 0
            assert "annotations_unmatched" not in c.stats()
        assert all(written.values()), "both collectors own some keys"
        seen = Counter()
        for endpoint, trajs in written.items():
            for t in trajs:
                assert ring.owner(route_key("run-7", t.validate, t.step, t.sample_index)) == endpoint
                assert not t.partial and [s.kind for s in t.spans] == ["rollout", "agent", "tool"]
                if not t.validate:
                    assert t.annotations == {"advantage": float(t.step * 1000 + t.sample_index * 10 + t.rollout_n)}
                seen[(t.validate, t.step, t.sample_index, t.rollout_n)] += 1
        expected = {(False, s, p, r) for s in range(steps) for p in range(prompts) for r in range(n)}
        expected |= {(True, s, p, 0) for s in range(steps) for p in range(val)}
        assert set(seen) == expected and set(seen.values()) == {1}
        # the trainer counted per collector what it sent there, and nothing else
        assert {k: v for k, v in stats.items() if k.startswith("collector_endpoint.")} == {
            f"collector_endpoint.{e}.sent": sum(1 for t in written[e] if not t.validate) for e in written}

    def test_a_stopped_collector_costs_its_own_rollouts_counted(self, collector, tmp_path):
        """One of two collectors is down: the worker's rollouts it owns are retried, then counted as
        lost (for that collector), never sent to the other; the other gets every rollout it owns,
        whole; the program's results are unchanged."""
        a = collector(jsonl_path=str(tmp_path / "a.jsonl"), **JOB)
        b = collector(jsonl_path=str(tmp_path / "b.jsonl"), **JOB)
        down = b.endpoint
        b.stop()
        env = dict(_env(a, [a.endpoint, down]), OTEL_EXPORTER_OTLP_TIMEOUT="500")
        out = workers.SPAWN.Queue()
        proc = workers.start(workers.against_dead_collector, env, 40, out)
        results, flushed, stats = out.get(timeout=120)
        workers.join_all([proc], 300)
        assert results == [i * 3 for i in range(40)]
        assert flushed is False
        ring = Ring([a.endpoint, down])
        owned = {i for i in range(40) if ring.owner(route_key("run-7", False, 0, i)) == a.endpoint}
        assert 0 < len(owned) < 40
        assert a.flush(60)
        trajs = read_jsonl(tmp_path / "a.jsonl")
        assert sorted(t.sample_index for t in trajs) == sorted(owned)
        assert all(not t.partial and len(t.spans) == 2 for t in trajs)
        lost = stats[f"collector_endpoint.{down}.failed"]
        assert lost >= 40 - len(owned)  # a rollout is one segment, or two if it crossed a round
        assert stats["sink.collector.failed_trajectories"] == lost
        assert f"collector_endpoint.{down}.sent" not in stats and f"collector_endpoint.{a.endpoint}.failed" not in stats
        assert stats[f"collector_endpoint.{a.endpoint}.sent"] == stats["sink.collector.sent"] >= len(owned)


@pytest.mark.integration
class TestTheTrainersBurst:
    def test_one_annotate_batch_of_100000_rows_arrives_whole(self, collector, tmp_path):
        """Issue 40: the trainer's annotate_batch for 25,600 rollouts overflowed its sink queue
        (2,304 dropped). One call of 100,000 rows in a trainer process now arrives whole at the
        collector, and rollouts made afterwards pick up their values there (before: 34,464 rows
        dropped in the annotation queue, 48,896 in the sink queue, 16,640 arrived)."""
        rows, joined = 100_000, [0, 54_321, 99_999]
        c = collector(**JOB)
        out = workers.SPAWN.Queue()
        proc = workers.start(workers.big_annotate_batch, c.env, rows, joined, out)
        flushed, stats = out.get(timeout=600)
        workers.join_all([proc], 300)
        lost = {k: v for k, v in stats.items() if "dropped" in k or "failed" in k or "abandoned" in k}
        assert flushed and lost == {}, lost
        assert stats["annotations_sent"] == rows and stats["sink.collector.sent"] == rows + len(joined)
        assert c.flush(120)
        assert c.stats()["collector_spans_received"] == rows + 2 * len(joined)
        trajs = sorted(read_jsonl(tmp_path / "traces.jsonl"), key=lambda t: t.sample_index)
        assert [(t.sample_index, t.annotations) for t in trajs] == [(i, {"advantage": i / 2}) for i in joined]
        assert c.pipeline.annotations.pending() == rows - len(joined)  # the others wait for their rollouts


class TestTheAnnotationQueue:
    def test_it_is_bounded_in_bytes_not_rows(self, tmp_path):
        """annotation_queue_bytes bounds the queue by estimated size (448 bytes for a row of two
        values): a call of 10,000 rows into a 1 MiB queue keeps the 2,340 rows that fit and counts
        the rest; a call within the bound is taken whole however many rows it has (before: 65,536
        rows at most, whatever their size)."""
        import rtrace
        from rtrace import _stats

        rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=3600,
                         annotation_queue_bytes=1 << 20)
        rows = list(range(10_000))
        rtrace.annotate_batch(step=1, sample_index=rows, rollout_n=[0] * len(rows), advantage=rows, reward=rows)
        assert _stats.snapshot()["annotations_dropped_queue"] == 10_000 - (1 << 20) // 448
        rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=3600)
        rows = list(range(100_000))  # ~45 MB estimated: within the default 256 MiB
        rtrace.annotate_batch(step=1, sample_index=rows, rollout_n=[0] * len(rows), advantage=rows, reward=rows)
        assert _stats.snapshot()["annotations_dropped_queue"] == 10_000 - (1 << 20) // 448  # nothing more
