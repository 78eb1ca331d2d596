"""The same trajectory in every mode: what one process writes, a collector writes too.

Each producer runs twice: in one process (JSONL sink), and as a rollout worker streaming
to an rtrace collector in this process (``RTRACE_EXPORTER=collector``, the collector
writing JSONL). The written records are compared field by field, ids and times aside.
"""

from __future__ import annotations

import json
import re

import pytest

import rtrace
from rtrace.exporters.jsonl import read_jsonl
from rtrace.instrumentation.turns import Turn, sample_state, submit
from rtrace.pipeline.sampling import priority

pytest.importorskip("grpc")

_IDS_AND_TIMES = ("trace_id", "span_id", "parent_id", "start_ns", "end_ns", "duration_ms")


def _normal(traj) -> dict:
    """A written trajectory without its ids and times (those differ between runs)."""
    data = traj.to_dict()
    for key in _IDS_AND_TIMES:
        data.pop(key, None)
    data.pop("worker", None)  # the process that ran it (host:pid): another one through a Ray worker
    if data.get("spans"):
        data["spans"][0]["attributes"].pop("rtrace.job_id", None)  # the collector's job, on its roots only
    for span in data.get("spans", []):
        for key in _IDS_AND_TIMES:
            span.pop(key, None)
    # a tool call's id made from its span's id (call_<8 hex>) is an id too
    text = re.sub(r'"call_[0-9a-f]{8}"', '"call_*"', json.dumps(data, sort_keys=True, default=str))
    return json.loads(text)


def _both_ways(produce, tmp_path, **settings) -> tuple[list[dict], list[dict]]:
    """``produce()`` in one process, then as a worker of a collector: both outputs."""
    one = tmp_path / "one.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(one), **settings)
    produce()
    assert rtrace.flush(30)
    rtrace.shutdown()
    through = tmp_path / "collector.jsonl"
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(through), settle_s=0.2, **settings)
    try:
        rtrace.configure(exporter="collector", collector_endpoint=collector.endpoint)
        produce()
        assert rtrace.flush(30)
        rtrace.shutdown()
        assert collector.flush(30)
    finally:
        collector.stop()

    def key(t):
        return (t["validate"], t["step"], t["sample_index"] if t["sample_index"] is not None else -1,
                t["rollout_n"] if t["rollout_n"] is not None else -1)

    return (sorted((_normal(t) for t in read_jsonl(one)), key=key),
            sorted((_normal(t) for t in read_jsonl(through)), key=key))


def _batch_with_messages():
    rtrace.log_rollout_batch(
        step=1, input_ids=[[1, 2, 3, 10, 11], [1, 2, 3, 12, 13]], prompt_lengths=[3, 3], rewards=[1.0, 0.0],
        messages=[[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                  [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]])


def _prebuilt_like_the_adapters():
    # TRL: the chat messages it was given and the advantage of its private state; SkyRL:
    # system / user / observation messages; an outcome per reward function
    states = []
    for n, (reward, advantage) in enumerate([(1.0, 0.5), (0.0, -0.5)]):
        st = sample_state({"step": 2, "sample_index": 0, "rollout_n": n, "validate": False, "group_id": "p0",
                           "policy_version": 1}, [1, 2], [Turn("assistant", [5, 6, 7], finish_reason="stop"),
                                                          Turn("tool", [8, 9], name="sql"),
                                                          Turn("assistant", [4], finish_reason="stop")],
                          reward, outcome={"reward/accuracy": reward})
        st.annotations["advantage"] = advantage
        st.messages = [{"role": "system", "content": "You answer in SQL."},
                       {"role": "user", "content": "How many rows?"},
                       {"role": "assistant", "content": "SELECT count(*) FROM t"},
                       {"role": "user", "content": "<observation>3</observation>"},
                       {"role": "assistant", "content": "3" if reward else "4"}]
        states.append(st)
    submit(states)


class TestPrebuiltTrajectories:
    def test_log_rollout_batch_with_messages_is_identical(self, tmp_path):
        """log_rollout_batch(messages=...): the given conversation arrives through a collector,
        not one rebuilt from token ids."""
        one, through = _both_ways(_batch_with_messages, tmp_path)
        assert len(one) == 2 and one[0]["messages"][1]["content"] == "4"
        assert through == one

    def test_adapter_messages_and_annotations_are_identical(self, tmp_path):
        """A prebuilt trajectory's chat messages and annotations (TRL's advantage, SkyRL's
        observation turns) arrive through a collector as they were."""
        one, through = _both_ways(_prebuilt_like_the_adapters, tmp_path)
        assert [t["annotations"] for t in one] == [{"advantage": 0.5}, {"advantage": -0.5}]
        assert one[0]["messages"][0] == {"role": "system", "content": "You answer in SQL."}
        assert through == one

    def test_the_carried_fields_do_not_show_as_span_attributes(self, tmp_path):
        """What the worker carries on the root for the collector is not left on the span."""
        _, through = _both_ways(_prebuilt_like_the_adapters, tmp_path)
        for traj in through:
            assert not [k for s in traj["spans"] for k in s["attributes"] if k.startswith("rtrace.carried.")]


# ----------------------------------------------------------------------------- sampling
@rtrace.traced_generation
def _gen(prompt_ids, reply):
    return {"response_ids": list(reply), "finish_reason": "stop"}


@rtrace.traced_tool(tool_name="calculator")
def _calc(expression):
    return "4"


def _rollouts(n: int, unhealthy=lambda i: False, step: int = 1) -> None:
    """``n`` rollouts of one step, 6 spans each; those ``unhealthy(i)`` says have an empty reply."""
    for i in range(n):
        with rtrace.rollout_context(step=step, sample_index=i, rollout_n=0):
            _gen([1, 2, 3], [4, 5])
            _calc("2+2")
            _gen([1, 2, 3, 4, 5, 6], [7])
            _calc("3+3")
            _gen([1, 2, 3, 4, 5, 6, 7, 8], [] if unhealthy(i) else [9])
            rtrace.record_reward(float(i % 2))


def _lowest(indices, k, seed=0):
    return set(sorted(indices, key=lambda i: priority({"step": 1, "sample_index": i, "rollout_n": 0,
                                                        "validate": False}, seed, False))[:k])


class TestWholeStepSampling:
    def test_flush_samples_from_the_whole_backlog(self):
        """3,000 queued rollouts of one step, cap 8 with tail keeping, then flush(): the kept
        sample is the 8 of lowest priority among all 3,000 (the worker takes its backlog in
        parts: releasing after the first part sampled from its first ~64), none late."""
        with rtrace.testing.capture(max_traces_per_step=8, keep_unhealthy=8, export_interval_s=60) as got:
            _rollouts(3000)
            trajs, stats = got.trajectories, got.stats()
        assert {t.sample_index for t in trajs if "sampled" in t.kept} == _lowest(range(3000), 8)
        assert len(trajs) == 8
        assert stats.get("trajectories_late_step", 0) == 0

    def test_keep_unhealthy_keeps_n_past_the_cap(self):
        """200 rollouts, every other one unhealthy, cap 8, keep_unhealthy 8: the 8 sampled, and
        8 unhealthy ones more that the sample did not keep (the 8 of lowest priority among
        them), each tagged `unhealthy` only; a sampled unhealthy rollout is `sampled` only."""
        with rtrace.testing.capture(max_traces_per_step=8, keep_unhealthy=8, export_interval_s=60) as got:
            _rollouts(200, unhealthy=lambda i: i % 2 == 0)
            trajs, stats = got.trajectories, got.stats()
        sampled = {t.sample_index for t in trajs if t.kept == ["sampled"]}
        tail = {t.sample_index for t in trajs if t.kept == ["unhealthy"]}
        assert sampled == _lowest(range(200), 8)
        assert tail == _lowest([i for i in range(0, 200, 2) if i not in sampled], 8)
        assert len(trajs) == 16 and all(t.health for t in trajs if t.sample_index in tail)
        assert stats["trajectories_kept_unhealthy"] == 8
