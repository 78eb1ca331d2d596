"""A training job on a real local Ray cluster: 4 rollout actors, one collector.

The actors are configured only through ``runtime_env={"env_vars": collector.env}``, as a
veRL / SkyRL / AReaL user would; nothing in them calls ``flush`` or ``shutdown``, and
``ray.shutdown()`` ends them without ``atexit``. Read back through each backend's API:
JSONL from disk, trackio through its storage, MLflow through a real ``mlflow server``.
"""

from __future__ import annotations

import pathlib
import time
import uuid
from collections import Counter

import pytest

import rtrace

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, PROMPTS, N, VAL_PROMPTS, WORKERS = 3, 32, 4, 8, 4
CAP, VAL_CAP = 24, 4


class RolloutWorker:
    """A rollout actor: an agent loop traced with rtrace's decorators."""

    def __init__(self, worker: int) -> None:
        import rtrace as rt

        self.worker = worker

        @rt.traced_tool(tool_name="calculator")
        def calc(x: int) -> int:
            return x * 2

        @rt.traced_rollout
        def loop(i: int) -> int:
            return calc(i)

        self.loop, self.rt = loop, rt

    def step(self, step: int) -> int:
        done = 0
        for p in range(self.worker, PROMPTS, WORKERS):
            for r in range(N):
                with self.rt.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}"):
                    self.loop(p)
                    self.rt.record_reward(float((p + r) % 3))
                done += 1
        for p in range(self.worker, VAL_PROMPTS, WORKERS):
            with self.rt.rollout_context(step=step, sample_index=p, rollout_n=0, validate=True):
                self.loop(p)
        return done


def test_four_ray_actors_one_collector(tmp_path, trackio_mod, mlflow_server):
    """Every kept trajectory is in trackio, MLflow and JSONL exactly once with one root; the cap is
    exactly K per step job-wide; one trackio run and one MLflow run; nothing flushed by the actors."""
    from mlflow.tracking import MlflowClient
    from trackio.sqlite_storage import SQLiteStorage

    base_url = mlflow_server
    project = f"ray-{uuid.uuid4().hex[:8]}"
    collector = rtrace.start_collector(
        exporter="trackio,mlflow,jsonl", project=project, experiment="job-1", jsonl_path=str(tmp_path / "t.jsonl"),
        mlflow_tracking_uri=base_url, max_traces_per_step=CAP, max_val_traces_per_step=VAL_CAP,
        sample_groups=True, settle_s=0.5)
    try:
        env = dict(collector.env, PYTHONPATH=str(ROOT))
        ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
        try:
            actor = ray.remote(num_cpus=1)(RolloutWorker)
            actors = [actor.remote(w) for w in range(WORKERS)]
            for step in range(STEPS):
                assert sum(ray.get([a.step.remote(step) for a in actors])) == PROMPTS * N
            time.sleep(1.0)  # every trajectory ended at least 1 s before the shutdown
        finally:
            ray.shutdown()  # no flush, no atexit in any actor
        assert collector.flush(60)
    finally:
        collector.stop()

    from rtrace.exporters.jsonl import read_jsonl

    trajs = read_jsonl(tmp_path / "t.jsonl")
    assert Counter((t.validate, t.step) for t in trajs) == {
        **{(False, s): CAP for s in range(STEPS)}, **{(True, s): VAL_CAP for s in range(STEPS)}}
    for t in trajs:
        assert not t.partial and sum(1 for s in t.spans if s.parent_id is None) == 1
        assert [s.kind for s in t.spans] == ["rollout", "agent", "tool"]
    for step in range(STEPS):  # whole GRPO groups (CAP is a multiple of N)
        groups = Counter(t.group_id for t in trajs if t.step == step and not t.validate)
        assert set(groups.values()) == {N}
    ids = sorted(t.trace_id for t in trajs)
    assert len(set(ids)) == len(ids)

    # trackio: one run, every kept trajectory once
    runs = SQLiteStorage.get_runs(project)
    assert len(runs) == 1
    run = runs[0] if isinstance(runs[0], str) else runs[0].get("name", runs[0])
    traces = SQLiteStorage.get_traces(project, run=run)
    assert sorted(t["metadata"]["trace_id"] for t in traces) == ids

    # MLflow: one run, every kept trajectory once, one root each
    client = MlflowClient(tracking_uri=base_url)
    exp = client.get_experiment_by_name(project)
    assert len(client.search_runs([exp.experiment_id])) == 1
    found = client.search_traces(locations=[exp.experiment_id], max_results=500)
    assert sorted(t.info.trace_id.removeprefix("tr-") for t in found) == ids
    for trace in found[:10]:
        roots = [s for s in trace.data.spans if s.parent_id is None]
        assert [r.name for r in roots] == ["rollout"]
