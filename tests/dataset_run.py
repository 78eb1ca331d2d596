"""A small run traced through the real pipeline into the parquet sink (and JSONL and memory
beside it, for the truth), shared by the dataset tests."""

from __future__ import annotations

import os

import rtrace
from rtrace.testing import MemorySink

STEPS, PROMPTS, ROLLOUTS = 3, 4, 4
SEARCH = "needle"


def make_run(tmp_path, exporter: str = "parquet,jsonl", experiment: str = "run-7", health: bool = True, **settings):
    """Trace STEPS x PROMPTS x ROLLOUTS rollouts (plus one validation rollout per prompt of
    step 0): a generation, a tool call, a reward, an annotation, extra coordinates; one prompt
    group of every step has equal rewards (zero variance), one rollout says ``needle``.
    Returns (run path, the memory sink's trajectories, jsonl path)."""
    mem = MemorySink()
    jsonl = os.path.join(tmp_path, "traces.jsonl")
    rtrace.configure(exporter=exporter, parquet_path=os.path.join(tmp_path, "ds"), jsonl_path=jsonl,
                     experiment=experiment, sinks=[mem], export_interval_s=0.02,
                     health_checks="all" if health else "none", **settings)

    @rtrace.traced_generation
    def generate(messages, prompt_ids):
        text = messages[-1]["content"]
        return {"text": f"answer to {text}", "finish_reason": "length" if "long" in text else "stop",
                "response_ids": list(range(7))}

    @rtrace.traced_tool
    def calculator(expression):
        return str(eval(expression))  # noqa: S307 - a constant of this test

    for step in range(STEPS):
        for p in range(PROMPTS):
            for r in range(ROLLOUTS):
                word = SEARCH if (step, p, r) == (1, 2, 3) else ("long" if r == 1 and p == 1 else "plain")
                with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}",
                                            dataset="gsm8k", difficulty=p):
                    generate(messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": f"q{p} {word}"}], prompt_ids=list(range(11)))
                    calculator(f"{p}+{r}")
                    reward = 1.0 if p == 0 else float((r + step) % 2)  # prompt 0: zero variance
                    rtrace.record_reward(reward, correct=reward > 0.5)
                rtrace.annotate(step=step, sample_index=p, rollout_n=r, advantage=reward - 0.5, tag=f"t{r}")
        if step == 0:
            for p in range(PROMPTS):
                with rtrace.rollout_context(step=0, sample_index=p, rollout_n=0, validate=True):
                    generate(messages=[{"role": "user", "content": f"v{p}"}], prompt_ids=[1, 2])
                    rtrace.record_reward(0.5)
        assert rtrace.flush(60)
    rtrace.shutdown()
    return os.path.join(tmp_path, "ds", experiment), mem.trajectories, jsonl


def duckdb_time_unit_ns() -> int:
    import duckdb

    return 1 if int(duckdb.__version__.split(".")[0]) >= 2 else 1000


def as_read_back(trajs):
    """Copies of ``trajs`` with their times as DuckDB reads them back from the dataset: to the
    nanosecond from DuckDB 2.0, to the microsecond before it (the last for Python 3.10 reads
    time-zoned nanosecond timestamps as microseconds; docs/dataset.md)."""
    import copy

    trajs = copy.deepcopy(list(trajs))
    unit = duckdb_time_unit_ns()
    if unit > 1:
        for t in trajs:
            for s in t.spans:
                s.start_ns -= s.start_ns % unit
                s.end_ns -= s.end_ns % unit
                for e in s.events:
                    if isinstance(e.get("time_ns"), int):
                        e["time_ns"] -= e["time_ns"] % unit
    return trajs


def records_as_read_back(records):
    """Report records (``r.traj``) whose trajectories are :func:`as_read_back`'s."""
    import copy

    records = [copy.copy(r) for r in records]
    for r, t in zip(records, as_read_back(r.traj for r in records)):
        r.traj = t
    return records
