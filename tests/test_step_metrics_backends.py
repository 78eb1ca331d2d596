"""Every step's metrics reach trackio and MLflow, at that step, equal to those computed from
the JSONL: in one process and through the collector, with steps released while the job
runs (no flush between steps), read back through each backend's own API."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import time
import uuid

import pytest

import rtrace
from rtrace.exporters.jsonl import read_jsonl
from rtrace.pipeline.health import DEFAULT_CHECKS
from rtrace.pipeline.metrics import StepStats
from tests import collector_workers as workers

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(autouse=True)
def clean_mlflow(monkeypatch):
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()


def expected_from_jsonl(path) -> dict[tuple[bool, int], dict[str, float]]:
    """The step metrics computed over the JSONL's trajectories, all at once (health rates of
    the default checks included; every group is whole: no cap)."""
    stats: dict = {}
    for t in read_jsonl(path):
        if t.kept and "sampled" not in t.kept:
            continue
        stats.setdefault((t.validate, t.step), StepStats()).add(t)
    return {key: st.values("eval" if key[0] else "rollout", DEFAULT_CHECKS, whole_groups=True)
            for key, st in stats.items()}


def trackio_rows(project: str, run: str) -> dict[tuple[bool, int], dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict = {}
    for row in SQLiteStorage.get_logs(project, run):
        for prefix, validate in (("rollout/", False), ("eval/", True)):
            values = {k: v for k, v in row.items() if k.startswith(prefix) and isinstance(v, (int, float))}
            if values:
                out.setdefault((validate, row["step"]), {}).update(values)
    return out


def mlflow_rows(uri: str, run_id: str, keys) -> dict[tuple[bool, int], dict[str, float]]:
    client = MlflowClient(tracking_uri=uri)
    out: dict = {}
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            out.setdefault((key.startswith("eval/"), m.step), {})[key] = m.value
    return out


def expected_tables(path) -> dict[tuple[bool, int], list[tuple]]:
    """Each step's rollouts table as the JSONL says it must be: every exported trajectory,
    ordered by group (its group_id, else its sample_index) then rollout; the slowest marked."""
    steps: dict = {}
    for t in read_jsonl(path):
        steps.setdefault((t.validate, t.step), []).append(t)
    out = {}
    for key, trajs in steps.items():
        slowest = max(trajs, key=lambda t: t.duration_ms).trace_id
        group = {t.trace_id: t.group_id if t.group_id is not None else t.sample_index for t in trajs}
        trajs.sort(key=lambda t: (str(group[t.trace_id]), t.rollout_n, t.trace_id))
        out[key] = [(t.trace_id, group[t.trace_id], t.sample_index, t.rollout_n, t.reward, t.verdict(),
                     "slowest" if t.trace_id == slowest else "") for t in trajs]
    return out


def _cells(rows) -> list[tuple]:
    return [(r["trace_id"], r["group"], r["sample_index"], r["rollout_n"], r["reward"], r["outcome"], r["note"])
            for r in rows]


def trackio_tables(project: str, run: str) -> dict[tuple[bool, int], list[tuple]]:
    from trackio.sqlite_storage import SQLiteStorage

    out = {}
    for row in SQLiteStorage.get_logs(project, run):
        for key, validate in (("rollout/rollouts", False), ("eval/rollouts", True)):
            if key in row:
                out[(validate, row["step"])] = _cells(row[key]["_value"])
    return out


def mlflow_tables(uri: str, run_id: str, steps) -> dict[tuple[bool, int], list[tuple]]:
    import tempfile

    out = {}
    for validate, step in steps:
        name = f"rtrace/{'eval' if validate else 'rollout'}_rollouts/step_{step:06d}.json"
        with tempfile.TemporaryDirectory() as tmp:  # without dst_path MLflow leaves a directory in /tmp
            local = MlflowClient(tracking_uri=uri).download_artifacts(run_id, name, dst_path=tmp)
            with open(local) as f:
                table = json.load(f)  # MLflow's table format: {"columns": [...], "data": [[...], ...]}
        out[(validate, step)] = _cells([dict(zip(table["columns"], row)) for row in table["data"]])
    return out


def same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, values in expected.items():
        assert set(got[key]) == set(values), key
        for name, value in values.items():
            assert math.isclose(got[key][name], value, rel_tol=1e-9, abs_tol=1e-9), (key, name)


def test_every_step_in_one_process(trackio_mod, tmp_path):
    """One process, 4 training steps (and validation at two of them) with no flush between
    steps: trackio and the MLflow run hold every step's metrics, equal to the JSONL's."""
    project, uri = f"rt-{uuid.uuid4().hex[:10]}", f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        rtrace.configure(exporter="jsonl,trackio,mlflow", jsonl_path=str(tmp_path / "t.jsonl"), project=project,
                         experiment="every-step", step_linger_s=0.05, export_interval_s=0.02)
        for step in range(1, 5):
            for i in range(3):
                for r in range(2):
                    with rtrace.rollout_context(step=step, sample_index=i, rollout_n=r, group_id=f"p{i}"):
                        rtrace.record_reward(float((i + r + step) % 3))
            if step % 2 == 0:
                with rtrace.rollout_context(step=step, sample_index=0, rollout_n=0, validate=True):
                    rtrace.record_reward(0.5 * step)
            time.sleep(0.4)  # the worker exports the step; the next one releases it
        assert rtrace.flush(60)
        rtrace.shutdown()
    expected = expected_from_jsonl(tmp_path / "t.jsonl")
    assert set(expected) == {(False, s) for s in range(1, 5)} | {(True, 2), (True, 4)}
    same(trackio_rows(project, "every-step"), expected)
    keys = {k for values in expected.values() for k in values}
    same(mlflow_rows(uri, run.info.run_id, keys), expected)
    # each step's rollouts table: one row per trajectory, by group, the slowest marked
    tables = expected_tables(tmp_path / "t.jsonl")
    assert trackio_tables(project, "every-step") == tables
    assert mlflow_tables(uri, run.info.run_id, tables) == tables


@pytest.mark.integration
def test_every_step_through_the_collector(trackio_mod, tmp_path):
    """Two worker processes stream 3 steps to one collector, pausing between steps, so the
    collector releases each step while the job runs: trackio and MLflow hold every step's metrics, equal to the JSONL's."""
    project, uri = f"rt-{uuid.uuid4().hex[:10]}", f"sqlite:///{tmp_path}/mlflow.db"
    c = rtrace.start_collector(exporter="jsonl,trackio,mlflow", jsonl_path=str(tmp_path / "t.jsonl"),
                               project=project, experiment="job", mlflow_tracking_uri=uri, settle_s=0.2,
                               step_linger_s=0.3)
    try:
        spawn = mp.get_context("spawn")
        procs = [spawn.Process(target=workers.rollouts, args=(c.env, w, 2, 3, 4, 2, 2, 1.0, 1.5)) for w in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert c.flush(60)
        run_id = c.mlflow_run_id
    finally:
        c.stop()
    expected = expected_from_jsonl(tmp_path / "t.jsonl")
    assert set(expected) == {(v, s) for v in (False, True) for s in range(3)}
    same(trackio_rows(project, "job"), expected)
    keys = {k for values in expected.values() for k in values}
    same(mlflow_rows(uri, run_id, keys), expected)
    tables = expected_tables(tmp_path / "t.jsonl")
    assert trackio_tables(project, "job") == tables
    assert mlflow_tables(uri, run_id, tables) == tables
