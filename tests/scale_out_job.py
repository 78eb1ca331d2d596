"""A GRPO job over N `rtrace collect` processes (issue 40), for the scale-out tests and by hand.

``run_job(root, collectors=N, ...)`` starts N ``rtrace collect --exporter parquet`` processes
that write one run's dataset (the same ``RTRACE_PARQUET_PATH``, ``RTRACE_EXPERIMENT``,
``RTRACE_JOB_ID`` and sampling settings), 4 worker processes and a trainer process given the
list of collectors, waits for the job, stops the collectors (SIGTERM: they write what they
hold) and returns a :class:`Job`: the dataset's path, the collectors' CPU seconds, the
workers' and the trainer's counters.

The rollouts are deterministic functions of their coordinates (:func:`reward`, errors,
truncations, tokens), so every count and sum a step metric reads is the same whatever the
number of collectors; rewards and advantages are multiples of 1/32, so their sums and sums of
squares are exact in any order. The trainer joins advantages (``reward - group mean``) with one
``annotate_batch`` per step, after the workers finished it (a synchronous GRPO trainer).

By hand (prints the figures; the full size of the issue)::

    PYTHONPATH=. python -m tests.scale_out_job /tmp/job 50 64 8
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tests.servers import start_rtrace_collect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPAWN = mp.get_context("spawn")
EXPERIMENT = "grpo-40"
JOB_ID = "job-40"
CAP = 32
WORKERS = 4
SEED = 40

#: the worker metrics whose values depend on wall time (each run's own): compared for presence only
TIMED = ("latency_ms_", "time_generation_frac", "time_tool_frac", "time_other_frac", "generation_ms_", "tool_ms_",
         "wait_ms_", "inflight_peak", "slowest_server_share")


# ----------------------------------------------------------------------------- the rollouts
def reward(step: int, p: int, r: int) -> float:
    """Known rewards: 1.0 for every member of a group ``p % 8 == 0`` (zero variance), else a
    multiple of 1/4."""
    return 1.0 if p % 8 == 0 else ((step + p + 2 * r) % 5) / 4


def advantage(step: int, p: int, r: int, n: int) -> float:
    """GRPO's advantage: the reward minus its group's mean (a multiple of 1/32 for n = 8)."""
    return reward(step, p, r) - sum(reward(step, p, k) for k in range(n)) / n


def fails(step: int, p: int, r: int) -> bool:
    return (step + 3 * p + r) % 37 == 0


def truncated(step: int, p: int, r: int) -> bool:
    return (step + p + 5 * r) % 23 == 0


def turns(step: int, p: int, r: int) -> int:
    return 1 + (p + r) % 3


def sample(steps: int, groups: int, n: int, cap: int = CAP, rate: float = 1.0) -> set[tuple]:
    """The one-collector sample, from the sampler's definition: per step the ``cap // n`` groups of
    lowest priority among those a worker records in full (priority below ``rate``)."""
    from rtrace.pipeline.sampling import priority

    out = set()
    for step in range(steps):
        ranks = sorted((priority({"validate": False, "step": step, "group_id": f"p{p}"}, SEED, True), p)
                       for p in range(groups))
        chosen = [p for rank, p in ranks if rank < rate][: cap // n]
        out |= {(False, step, p, r) for p in chosen for r in range(n)}
    return out


def _apply(env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def worker(env: dict[str, str], w: int, workers: int, steps: int, groups: int, n: int, barrier: Any,
           out: Any, paced: bool = False) -> None:
    """Groups ``w, w + workers, ...`` of every step, ``n`` rollouts each (a generation and a tool
    call per turn; some end in error, some truncated), then waits at ``barrier`` for the others
    and the trainer (and, ``paced``, once more: for the test's go). Reports (flushed, counters,
    CPU seconds)."""
    _apply(env)
    import rtrace

    @rtrace.traced_generation(model="toy")
    def generate(prompt_ids: list[int], stop: str) -> dict:
        return {"response_ids": list(range(len(prompt_ids) % 7 + 3)), "finish_reason": stop}

    @rtrace.traced_tool(tool_name="calculator")
    def calc(x: int) -> int:
        if x < 0:
            raise ValueError("the calculator failed")
        return x * 2

    for step in range(steps):
        for p in range(w, groups, workers):
            for r in range(n):
                try:
                    with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}"):
                        rtrace.record_reward(reward(step, p, r))
                        k = turns(step, p, r)
                        ids = list(range(10 + p))  # each turn's prompt continues the last one (healthy)
                        for t in range(k):
                            last = t == k - 1
                            answer = generate(ids, "length" if last and truncated(step, p, r) else "stop")
                            ids = ids + answer["response_ids"] + [calc(-1 if last and fails(step, p, r) else p)]
                except ValueError:
                    pass
        barrier.wait()  # the step is done everywhere; the trainer annotates it
        if paced:
            barrier.wait()
    ok = rtrace.flush(120)
    out.put(("worker", w, ok, rtrace.stats(), time.process_time()))
    out.close()
    out.join_thread()
    os._exit(0)


def trainer(env: dict[str, str], steps: int, groups: int, n: int, barrier: Any, out: Any,
            paced: bool = False) -> None:
    """One ``annotate_batch`` per step with every rollout's advantage, once the workers finished
    the step. Reports (flushed, counters, CPU seconds)."""
    _apply(env)
    import rtrace

    for step in range(steps):
        barrier.wait()
        rows = [(p, r) for p in range(groups) for r in range(n)]
        rtrace.annotate_batch(step=step, sample_index=[p for p, _ in rows], rollout_n=[r for _, r in rows],
                              advantage=[advantage(step, p, r, n) for p, r in rows])
        if paced:
            barrier.wait()
    ok = rtrace.flush(120)
    out.put(("trainer", 0, ok, rtrace.stats(), time.process_time()))
    out.close()
    out.join_thread()
    os._exit(0)


# ----------------------------------------------------------------------------- the job
@dataclass
class Job:
    path: str  # the run's dataset
    endpoints: list[str]
    collector_cpu_s: list[float]
    collector_stats: list[dict]
    workers: list[tuple[bool, dict, float]] = field(default_factory=list)
    trainer: tuple[bool, dict, float] | None = None
    wall_s: float = 0.0


def base_env(root: str, **extra: str) -> dict[str, str]:
    """The collectors' environment: one dataset, one run, one job, one sampling."""
    env = dict(os.environ, RTRACE_PARQUET_PATH=root, RTRACE_EXPERIMENT=EXPERIMENT, RTRACE_JOB_ID=JOB_ID,
               RTRACE_SAMPLE_SEED=str(SEED), RTRACE_MAX_TRACES_PER_STEP=str(CAP), RTRACE_SAMPLE_GROUPS="1",
               RTRACE_AWAIT_ANNOTATIONS="advantage",
               RTRACE_ANNOTATION_TIMEOUT_S="120", RTRACE_STEP_LINGER_S="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("RTRACE_EXPORTER", "RTRACE_COLLECTOR_ENDPOINT", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    env.update(extra)
    return env


def cpu_seconds(pid: int) -> float:
    """A live process's user + system CPU seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_collectors(procs: list) -> tuple[list[float], list[dict]]:
    """SIGTERM each collector (it writes what it holds), wait; their CPU seconds just before, and
    the counters each printed when it stopped."""
    cpu, stats = [], []
    for proc in procs:
        cpu.append(cpu_seconds(proc.pid) if proc.poll() is None else float("nan"))
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rtrace collect exited with {proc.returncode}"
        stats.append(json.loads(out.split("# rtrace stats: ", 1)[1].splitlines()[0]))
    return cpu, stats


def run_job(root: str, collectors: int, steps: int, groups: int, n: int, pre_sample_rate: float = 1.0,
            workers: int = WORKERS, cap: int = CAP, between: Any = None, timeout_s: float = 900,
            **env_extra: str) -> Job:
    """The job of the module docstring; returns when the collectors have stopped. ``between(step,
    procs, endpoints, env)``, when given, runs in this process once every worker finished
    ``step``, while the trainer annotates it; the workers start the next step when it returns. It
    may kill and restart collectors (replacing ``procs[i]``; ``env`` is theirs)."""
    env = base_env(root, RTRACE_MAX_TRACES_PER_STEP=str(cap), **env_extra)
    if pre_sample_rate < 1.0:
        env["RTRACE_PRE_SAMPLE_RATE"] = repr(pre_sample_rate)
    started = time.monotonic()
    procs, endpoints, worker_env = [], [], {}
    try:
        for _ in range(collectors):
            proc, printed = start_rtrace_collect(env, "parquet")
            procs.append(proc)
            endpoints.append(printed["RTRACE_COLLECTOR_ENDPOINT"])
            worker_env = printed
        worker_env = dict(worker_env, RTRACE_COLLECTOR_ENDPOINT=",".join(endpoints), PYTHONPATH=env["PYTHONPATH"],
                          **{k: v for k, v in env_extra.items() if k.startswith("OTEL_")})
        paced = between is not None
        barrier, out = SPAWN.Barrier(workers + 1 + paced), SPAWN.Queue()
        children = [SPAWN.Process(target=worker, args=(worker_env, w, workers, steps, groups, n, barrier, out, paced))
                    for w in range(workers)]
        children.append(SPAWN.Process(target=trainer, args=(worker_env, steps, groups, n, barrier, out, paced)))
        for child in children:
            child.start()
        if between is not None:
            for step in range(steps):
                barrier.wait(timeout_s)  # the step is done
                between(step, procs, endpoints, env)
                barrier.wait(timeout_s)  # go on
        reports = [out.get(timeout=timeout_s) for _ in children]
        for child in children:
            child.join(60)
            assert child.exitcode == 0, f"a job process exited with {child.exitcode}"
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    job = Job(os.path.join(root, EXPERIMENT), endpoints, *stop_collectors(procs))
    job.wall_s = time.monotonic() - started
    for kind, _, ok, stats, cpu in sorted(reports, key=lambda r: (r[0], r[1])):
        if kind == "worker":
            job.workers.append((ok, stats, cpu))
        else:
            job.trainer = (ok, stats, cpu)
    return job


def publish(path: str, project: str, trackio_dir: str, mlflow_uri: str, exporter: str = "trackio,mlflow",
            cwd: str | None = None) -> str:
    """``rtrace publish PATH --exporter EXPORTER --once`` as a process in ``cwd`` (MLflow's
    artifacts land there), the collectors' sampling settings in its environment; its output."""
    import subprocess

    env = base_env(os.path.dirname(path), TRACKIO_DIR=trackio_dir, MLFLOW_TRACKING_URI=mlflow_uri,
                   RTRACE_PROJECT=project)
    done = subprocess.run([sys.executable, "-m", "rtrace", "publish", path, "--exporter", exporter, "--once"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ----------------------------------------------------------------------------- reading back
def dataset_view(path: str) -> dict[str, Any]:
    """What ``open_run`` shows: every rollout's row (coordinates -> recorded, kept, partial,
    advantage), the kept coordinates, the spans' trace ids."""
    import rtrace

    run = rtrace.open_run(path)
    rows = run.sql("SELECT validate, step, sample_index, rollout_n, trace_id, recorded, in_sample, kept, partial, "
                   "annotations_double['advantage'] FROM trajectories").fetchall()
    spans = run.sql("SELECT DISTINCT trace_id FROM spans").fetchall()
    view = {"rows": {(v, s, i, r): {"trace_id": t, "recorded": rec, "in_sample": ins, "kept": tuple(k or ()),
                                     "partial": part, "advantage": adv}
                     for v, s, i, r, t, rec, ins, k, part, adv in rows},
            "n_rows": len(rows), "span_traces": {t for (t,) in spans}, "skipped": list(run.skipped)}
    view["kept"] = {c for c, row in view["rows"].items() if row["kept"]}
    run.close()
    return view


def numeric_metrics(values: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def trackio_view(project: str) -> dict[str, Any]:
    """The project's runs, each run's step metrics (numbers, by step) and traces' coordinates
    and advantages, through trackio's own storage."""
    from trackio.sqlite_storage import SQLiteStorage

    runs = SQLiteStorage.get_runs(project)
    out: dict[str, Any] = {"runs": runs}
    if len(runs) != 1:
        return out
    name = runs[0] if isinstance(runs[0], str) else runs[0]["name"]
    metrics = {}
    for row in SQLiteStorage.get_logs(project, name):
        nums = {k: v for k, v in numeric_metrics(row).items() if k.startswith(("rollout/", "eval/"))}
        if nums:
            metrics.setdefault(row["step"], {}).update(nums)
    traces = {}
    for t in SQLiteStorage.get_traces(project, run=name):
        m = t["metadata"]
        traces[(bool(m.get("validate", False)), m["step"], m["sample_index"], m["rollout_n"])] = m.get("advantage")
    out.update(metrics=metrics, traces=traces)
    return out


def mlflow_view(uri: str, experiment: str) -> dict[str, Any]:
    """The experiment's runs, the run's step metrics (every key's history, by step) and its
    traces' coordinates and advantages, through MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    out: dict[str, Any] = {"runs": [r.info.run_id for r in runs]}
    if len(runs) != 1:
        return out
    run = runs[0]
    metrics: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            metrics.setdefault(m.step, {})[key] = m.value
    traces = {}
    token = None
    while True:
        page = client.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, max_results=500,
                                    page_token=token)
        for t in page:
            tags = t.info.tags
            adv = tags.get("advantage")
            traces[(tags["validate"] == "True", int(tags["step"]), int(tags["sample_index"]),
                    int(tags["rollout_n"]))] = float(adv) if adv is not None else None
        token = page.token
        if not token:
            break
    out.update(metrics=metrics, traces=traces)
    return out


def timeless(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The metrics that do not depend on wall time (every one but :data:`TIMED`)."""
    return {step: {k: v for k, v in values.items() if not any(t in k for t in TIMED)}
            for step, values in metrics.items()}


if __name__ == "__main__":
    import shutil

    base = sys.argv[1]
    steps, groups, n = (int(a) for a in sys.argv[2:5])
    sizes = [int(a) for a in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1, 2, 4]
    rate = float(sys.argv[6]) if len(sys.argv) > 6 else 1.0
    for size in sizes:
        root = os.path.join(base, f"n{size}" + ("" if rate == 1.0 else f"-pre{rate}"))
        shutil.rmtree(root, ignore_errors=True)
        job = run_job(root, size, steps, groups, n, pre_sample_rate=rate)
        t0 = time.monotonic()
        view = dataset_view(job.path)
        print(json.dumps({"collectors": size, "pre_sample_rate": rate, "wall_s": round(job.wall_s, 1),
                          "collector_cpu_s": [round(c, 2) for c in job.collector_cpu_s],
                          "worker_cpu_s": [round(w[2], 2) for w in job.workers],
                          "trainer_cpu_s": round(job.trainer[2], 2), "rows": view["n_rows"],
                          "kept": len(view["kept"]), "read_s": round(time.monotonic() - t0, 2),
                          "flushed": [w[0] for w in job.workers] + [job.trainer[0]]}), flush=True)
