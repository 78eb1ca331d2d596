"""docs/dataset.md's one-liners, each engine on the same dataset: they agree with the
trajectories the sinks received on the per-step reward mean, the GRPO group counts and a
text search (one rollout's task says ``needle``)."""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

import rtrace  # noqa: E402
from tests.dataset_run import SEARCH, make_run  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The run, with two steps per file of steps/: steps 0-1 in trajectories/train/steps/, step 2
    and the validation step in their step=N folders, as a long run's files are."""
    from rtrace.dataset.writer import DatasetWriter
    from rtrace.testing import reset

    tmp = tmp_path_factory.mktemp("engines")
    reset()
    DatasetWriter.STEPS_PER_FILE = 2
    try:
        path, trajs, _ = make_run(str(tmp), exporter="parquet")
    finally:
        DatasetWriter.STEPS_PER_FILE = 32
        reset()
    assert [n for n in os.listdir(os.path.join(path, "trajectories", "train", "steps")) if ".s0-1." in n]
    assert os.listdir(os.path.join(path, "trajectories", "train", "step=2"))
    return path, trajs


def _truth(trajs):
    """(per-step reward mean of training rollouts, rollouts per (step, group), trace ids whose task has SEARCH)."""
    rewards = defaultdict(list)
    groups: Counter = Counter()
    found = set()
    for t in trajs:
        if not t.validate:
            rewards[t.step].append(t.reward)
            groups[(t.step, t.group_id)] += 1
        if any(SEARCH in (m.get("content") or "") for m in t.messages if m.get("role") == "user"):
            found.add(t.trace_id)
    return {s: sum(v) / len(v) for s, v in rewards.items()}, dict(groups), found


def _check(trajs, means, groups, found):
    want_means, want_groups, want_found = _truth(trajs)
    assert sorted(means) == sorted(want_means)
    for step, mean in means.items():
        assert math.isclose(mean, want_means[step]), step
    assert {(int(s), g): int(n) for (s, g), n in groups.items()} == want_groups
    assert set(found) == want_found and len(want_found) == 1


def test_duckdb_through_open_run(dataset):
    """rtrace.open_run(path).sql(...): DuckDB over the run's views."""
    path, trajs = dataset
    run = rtrace.open_run(path)
    means = dict(run.sql("SELECT step, avg(reward) FROM trajectories WHERE NOT validate GROUP BY step").fetchall())
    groups = {(s, g): n for s, g, n in run.sql(
        "SELECT step, group_key, count(*) FROM trajectories WHERE NOT validate GROUP BY ALL").fetchall()}
    found = [r[0] for r in run.sql("SELECT trace_id FROM trajectories WHERE task LIKE $q", {"q": f"%{SEARCH}%"}
                                   ).fetchall()]
    _check(trajs, means, groups, found)


def test_duckdb_alone(dataset):
    """Plain DuckDB on the files (no rtrace): read_parquet over the glob."""
    import duckdb

    path, trajs = dataset
    src = f"read_parquet('{path}/trajectories/**/*.parquet')"
    means = dict(duckdb.sql(f"SELECT step, avg(reward) FROM {src} WHERE NOT validate GROUP BY step").fetchall())
    groups = {(s, g): n for s, g, n in duckdb.sql(
        f"SELECT step, group_key, count(*) FROM {src} WHERE NOT validate GROUP BY ALL").fetchall()}
    found = [r[0] for r in duckdb.sql(
        f"SELECT trace_id FROM {src} WHERE len(list_filter(messages, lambda m: m.content LIKE '%{SEARCH}%')) > 0"
    ).fetchall()]
    _check(trajs, means, groups, found)


def test_pandas(dataset):
    """pandas.read_parquet(path + "/trajectories", partitioning=None) (the step is in the files)."""
    pd = pytest.importorskip("pandas")
    path, trajs = dataset
    df = pd.read_parquet(os.path.join(path, "trajectories"), partitioning=None)
    train = df[~df["validate"]]
    means = train.groupby("step")["reward"].mean().to_dict()
    groups = train.groupby(["step", "group_key"]).size().to_dict()
    found = df[df["task"].str.contains(SEARCH)]["trace_id"].tolist()
    _check(trajs, means, groups, found)


def test_polars(dataset):
    """polars.scan_parquet(path + "/trajectories/**/*.parquet")."""
    pl = pytest.importorskip("polars")
    path, trajs = dataset
    lf = pl.scan_parquet(os.path.join(path, "trajectories", "**", "*.parquet")).filter(~pl.col("validate"))
    means = dict(lf.group_by("step").agg(pl.col("reward").mean()).collect().iter_rows())
    groups = {(s, g): n for s, g, n in lf.group_by("step", "group_key").len().collect().iter_rows()}
    found = (pl.scan_parquet(os.path.join(path, "trajectories", "**", "*.parquet"))
             .filter(pl.col("messages").list.eval(pl.element().struct.field("content").str.contains(SEARCH)).list.any())
             .select("trace_id").collect().to_series().to_list())
    _check(trajs, means, groups, found)


def test_hugging_face_datasets(dataset, tmp_path):
    """datasets.load_dataset("parquet", data_files=..., **rtrace.dataset.hf_load_kwargs())."""
    datasets = pytest.importorskip("datasets")
    from rtrace.dataset import hf_load_kwargs

    path, trajs = dataset
    ds = datasets.load_dataset("parquet", data_files=os.path.join(path, "trajectories", "**", "*.parquet"),
                               split="train", cache_dir=str(tmp_path), **hf_load_kwargs())
    train = ds.filter(lambda r: not r["validate"])
    sums, counts, groups = defaultdict(float), Counter(), Counter()
    for row in train:
        sums[row["step"]] += row["reward"]
        counts[row["step"]] += 1
        groups[(row["step"], row["group_key"])] += 1
    found = [r["trace_id"] for r in ds.filter(lambda r: any(SEARCH in (m["content"] or "") for m in r["messages"]))]
    _check(trajs, {s: sums[s] / counts[s] for s in sums}, groups, found)


def test_clickhouse_chdb(dataset):
    """chdb (ClickHouse in-process): file('<path>/trajectories/**/*.parquet', Parquet), with hive
    partitioning off (the step is in the files; the files of steps/ have no step=N folder)."""
    chdb = pytest.importorskip("chdb")
    path, trajs = dataset
    src = f"file('{path}/trajectories/**/*.parquet', Parquet)"

    def rows(sql):
        text = str(chdb.query(sql + " SETTINGS use_hive_partitioning = 0", "TabSeparated")).strip()
        return [line.split("\t") for line in text.splitlines() if line]

    means = {int(s): float(m) for s, m in rows(f"SELECT step, avg(reward) FROM {src} WHERE NOT validate GROUP BY step")}
    groups = {(int(s), g): int(n) for s, g, n in rows(
        f"SELECT step, group_key, count() FROM {src} WHERE NOT validate GROUP BY step, group_key")}
    found = [r[0] for r in rows(
        f"SELECT trace_id FROM {src} WHERE arrayExists(m -> m.content LIKE '%{SEARCH}%', messages)")]
    _check(trajs, means, groups, found)
    # the typed maps, without a cast
    n = rows(f"SELECT count() FROM {src} WHERE outcome_bool['correct'] AND annotations_double['advantage'] > 0")
    assert int(n[0][0]) == sum(1 for t in trajs if t.outcome.get("correct") and t.annotations.get("advantage", 0) > 0)
