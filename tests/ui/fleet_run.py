"""A generated step of a fleet, in the dataset's schema, for ``rtrace serve``'s swimlane at scale.

One training step (:data:`STEP`) of ``n`` rollouts x 20 spans (the root; nine turns of a
generation then a tool call, with the agent's own pauses between them; a reward computation),
run by :data:`WORKERS` worker processes of :data:`SLOTS` concurrent rollouts each on
:data:`SERVERS` inference servers, one of them a straggler (its generations take
:data:`STRAGGLER` times as long). Two weight updates during the step: the rollouts carry the
version they started on (staleness 0 to 2), the one they ended on and whether they crossed one.
Some tool names are hostile text (``<img src=x onerror=...>``): the page must show them as text.

Written through the dataset's own writer (:class:`rtrace.dataset.writer.DatasetWriter`) from
:class:`~rtrace.trajectory.Trajectory` objects, so the files are what the parquet sink writes;
built once and cached (``ensure()``: ``$RTRACE_UI_CACHE`` or ``~/.cache/rtrace``; a marker
file says it is whole). ``python tests/ui/fleet_run.py [--n 10000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from pathlib import Path

VERSION = 1  # bump when the generated data changes: the cache is keyed by it
STEP = 40
WORKERS, SLOTS, SERVERS = 16, 64, 4
STRAGGLER = 2.5
TURNS = 9
T0 = 1_760_000_000_000_000_000  # the step's first moment (ns since the epoch)
MS = 1_000_000
HOSTILE_TOOL = '<img src=x onerror=alert("tool")>'
TOOLS = ("python", "search", "calculator", HOSTILE_TOOL)


def cache_root() -> Path:
    try:
        from tests.ui.big_run import cache_root as root
    except ImportError:  # run as a script: big_run is beside it
        from big_run import cache_root as root  # type: ignore[no-redef]
    return root()


def ensure(n: int = 10_000) -> Path:
    """The run's folder (a dataset run named ``fleet``), generated the first time."""
    root = cache_root() / f"fleet-v{VERSION}-{n}"
    run = root / "fleet"
    if not (root / "complete").exists():
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        info = write_run(run, n)
        (root / "complete").write_text(json.dumps(info))
    return run


def info(n: int = 10_000) -> dict:
    return json.loads((ensure(n).parent / "complete").read_text())


def trajectories(n: int, seed: int = 41, workers: int = WORKERS, slots: int = SLOTS, servers: int = SERVERS
                 ) -> tuple[list, list]:
    """The step's trajectories and the run's weight updates (RunEvent): ``n`` rollouts on ``workers``
    workers of ``slots`` concurrent rollouts each, on ``servers`` inference servers."""
    from rtrace.events import WEIGHT_UPDATE, RunEvent
    from rtrace.trajectory import SpanRecord, Trajectory

    rng = random.Random(seed)
    free = [[(0, lane) for lane in range(slots)] for _ in range(workers)]
    for heap in free:
        heapq.heapify(heap)
    plans = []
    for i in range(n):
        w = i % workers
        free_at, lane = heapq.heappop(free[w])
        start = free_at + rng.randint(1, 40) * MS
        t = start + rng.randint(1, 30) * MS  # the root's own setup before its first call
        calls = []
        for turn in range(TURNS):
            server = rng.randrange(servers)
            gen = rng.randint(120, 700) * MS * (STRAGGLER if server == servers - 1 else 1)
            calls.append(("generation", t, t + int(gen), server))
            t += int(gen)
            t += rng.choice((0, 1, 5, 20, 80, 400)) * MS if rng.random() < 0.5 else 0  # the agent's pause
            tool = rng.randint(20, 600) * MS
            calls.append(("tool", t, t + tool, TOOLS[rng.randrange(len(TOOLS))] if rng.random() < 0.97
                          else HOSTILE_TOOL))
            t += tool + rng.randint(0, 3) * MS
        calls.append(("reward", t, t + rng.randint(20, 150) * MS, None))
        end = calls[-1][2] + rng.randint(0, 5) * MS
        heapq.heappush(free[w], (end, lane))
        plans.append((i, w, start, end, calls))
    last = max(p[3] for p in plans)
    updates = [T0 + int(last * 0.3), T0 + int(last * 0.65)]
    events = [RunEvent(WEIGHT_UPDATE, t, STEP - 1 + k, STEP, "trainer:1", {"duration_ms": 850.0},
                       f"{k + 1:016x}") for k, t in enumerate(updates)]
    out = []
    for i, w, start, end, calls in plans:
        a, b = T0 + start, T0 + end
        version = STEP - 2 + sum(1 for u in updates if u <= a)
        version_end = STEP - 2 + sum(1 for u in updates if u <= b)
        root_id = f"{i + 1:08x}00000000"
        spans = [SpanRecord(root_id, None, "rollout", "rollout", a, b)]
        for k, (kind, s, e, what) in enumerate(calls):
            sid = f"{i + 1:08x}{k + 1:08x}"
            if kind == "generation":
                attrs = {"server.address": f"10.0.0.{what + 1}", "server.port": 8000,
                         "gen_ai.usage.output_tokens": (e - s) // MS // 4, "gen_ai.usage.input_tokens": 300}
                spans.append(SpanRecord(sid, root_id, "chat qwen", "generation", T0 + s, T0 + e, attributes=attrs))
            elif kind == "tool":
                spans.append(SpanRecord(sid, root_id, what, "tool", T0 + s, T0 + e,
                                        attributes={"gen_ai.tool.name": what}))
            else:
                spans.append(SpanRecord(sid, root_id, "compute_score", "chain", T0 + s, T0 + e))
        reward = 1.0 if rng.random() < 0.55 else 0.0
        traj = Trajectory(f"{i + 1:032x}", "rollout", spans, step=STEP, sample_index=i // 8, rollout_n=i % 8,
                          group_id=f"p{i // 8}", policy_version=version, reward=reward,
                          outcome={"correct": reward > 0},
                          messages=[{"role": "user", "content": f"Question {i // 8}"}],
                          worker=f"node-{w // 4}:{1000 + w}", policy_version_end=version_end,
                          crossed_update=version != version_end)
        out.append(traj)
    return out, events


def rename_hostile(trajs: list, worker: str, server: str) -> list:
    """``trajs`` with the second worker (``node-0:1001``) renamed ``worker`` and the second server
    (10.0.0.2) addressed as ``server``: markup where names are shown."""
    for t in trajs:
        if t.worker.endswith(":1001"):
            t.worker = worker
        for s in t.spans:
            if s.attributes.get("server.address") == "10.0.0.2":
                s.attributes["server.address"] = server
    return trajs


def write_run(folder: Path, n: int) -> dict:
    from rtrace.dataset.layout import open_store
    from rtrace.dataset.writer import DatasetWriter

    t0 = time.perf_counter()
    trajs, events = trajectories(n)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    writer = DatasetWriter(open_store(str(folder)), folder.name, steps_per_file=0)
    for i in range(0, len(trajs), 2000):
        writer.write(trajs[i: i + 2000])
    writer.write_events(events)
    writer.close()
    return {"rollouts": n, "spans": sum(len(t.spans) for t in trajs), "step": STEP,
            "updates": [e.time_ns for e in events], "first_ns": min(t.start_ns for t in trajs),
            "last_ns": max(t.end_ns for t in trajs), "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--out", help="write here instead of the cache")
    args = ap.parse_args()
    if args.out:
        print(write_run(Path(args.out) / "fleet", args.n))
    else:
        print(ensure(args.n))
