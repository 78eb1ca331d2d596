"""``rtrace timeline``'s file: a :class:`~rtrace.report.timeline.Timeline` as Chrome trace-event JSON.

The JSON object format of the Trace Event Format (the one Perfetto UI, ``chrome://tracing`` and
speedscope import): ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``,
written as a stream, event after event (never one structure in memory), as VizTracer and
PyTorch's ``export_chrome_trace`` do. What each event is (docs/timeline.md):

* ``M`` metadata naming each process (``process_name``: ``fleet``, ``server <address:port>``,
  ``worker <host:pid>``), ordering them (``process_sort_index``) and naming each thread
  (``thread_name``: ``lane N``, ``steps``);
* ``X`` complete slices (``ts`` and ``dur`` in whole microseconds from the window's first
  moment, ``otherData.rtrace.origin_unix_ns``, floored: exact in the viewers' floating point):
  each rollout on a lane of its worker, its calls and waits nested under it, each generation
  again on its server's lanes, each step on the fleet's ``steps`` lanes;
* ``C`` counters: rollouts in flight (the fleet's, each worker's), generations in flight and
  output tokens per second (each server's), the policy version (the fleet's);
* ``i`` instants: weight updates (``s: "g"``, global), a note per limit the window hit.

``args`` stay small: a rollout's coordinates, reward, verdict, versions and trace id (the
rollout's page in ``rtrace serve``: ``otherData.rtrace.rollout_url``); a generation's server
and tokens; a server's call its rollout's trace id.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, BinaryIO, Iterable

from .timeline import Timeline, pack_lanes

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - the json module writes the same events, slower
    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

__all__ = ["write_trace", "FLEET_PID", "token_bucket_ns"]

#: the fleet's process (steps, weight updates, the job's counters)
FLEET_PID = 1
#: events buffered before a write
_BUFFER = 4096


class _Out:
    """The ``traceEvents`` array, written as it is made: events as JSON text, a few thousand at
    a time (the slices of a large step are formatted directly, names escaped once each)."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.buf: list[str] = []
        self.count = 0
        self.bytes = 0
        self._names: dict[str, str] = {}

    def event(self, ev: dict[str, Any]) -> None:
        self.text(_dumps(ev).decode("utf-8"))

    def text(self, data: str) -> None:
        self.buf.append(data)
        self.count += 1
        if len(self.buf) >= _BUFFER:
            self.flush()

    def lines(self, events: list[str]) -> None:
        """Many events as JSON text at once."""
        self.buf.extend(events)
        self.count += len(events)
        if len(self.buf) >= _BUFFER:
            self.flush()

    def q(self, name: str) -> str:
        """``name`` as a JSON string (cached: names repeat)."""
        quoted = self._names.get(name)
        if quoted is None:
            quoted = self._names[name] = json.dumps(name, ensure_ascii=False)
        return quoted

    def flush(self) -> None:
        if self.buf:
            data = ((",\n" if self.bytes else '{"traceEvents":[\n') + ",\n".join(self.buf)).encode("utf-8")
            self.out.write(data)
            self.bytes += len(data)
            self.buf = []

    def close(self, trailer: dict[str, Any]) -> None:
        self.flush()
        head = b"" if self.bytes else b'{"traceEvents":[\n'
        tail = head + b'\n],"displayTimeUnit":"ms","otherData":' + _dumps(trailer) + b"}\n"
        self.out.write(tail)
        self.bytes += len(tail)


def token_bucket_ns(window_ns: int) -> int:
    """The width of the tokens-per-second counter's buckets: 10 ms, or wider so that a window
    has at most 500 of them."""
    return max(10_000_000, -(-window_ns // 500))


def write_trace(tl: Timeline, out: BinaryIO) -> dict[str, Any]:
    """Write ``tl`` to ``out`` (a binary file). Returns the file's ``otherData.rtrace``
    (with ``events``: the number of trace events, and ``bytes``)."""
    origin = tl.origin_ns
    w = _Out(out)

    def us(ns: int) -> int:
        # whole microseconds, floored: exact in every viewer's floating point, so a slice that
        # ends where the next begins ends there to them too (speedscope adds ts and dur as
        # doubles), and the floor keeps every order and nesting of the spans' nanoseconds
        return (ns - origin) // 1000

    def name_process(pid: int, name: str, order: int) -> None:
        w.event({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        w.event({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": order}})

    def name_thread(pid: int, tid: int, name: str) -> None:
        w.event({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
        w.event({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})

    servers = sorted(tl.servers)
    workers = sorted(tl.workers)
    server_pid = {s: 2 + i for i, s in enumerate(servers)}
    worker_pid = {wk: 2 + len(servers) + i for i, wk in enumerate(workers)}

    # ---------------------------------------------------------------- the fleet
    name_process(FLEET_PID, "fleet", 0)
    steps = [_Span(a, b, s) for s, a, b in tl.step_spans]
    step_lanes, _ = pack_lanes(steps, len(steps) + 1)
    for k in range(step_lanes):
        name_thread(FLEET_PID, 1 + k, "steps")
    for st in steps:
        w.event({"ph": "X", "pid": FLEET_PID, "tid": 1 + st.lane, "ts": us(st.start_ns),
                 "dur": us(st.end_ns) - us(st.start_ns), "name": f"step {st.key}", "cat": "step",
                 "args": {"step": st.key, "validate": tl.validate}})
    _counter(w, FLEET_PID, "rollouts in flight", ((s, e) for s, e, _ in tl.intervals), us)
    for e in tl.events:
        args = {"version": e.version, "step": e.step, "worker": e.worker, **e.attributes}
        w.event({"ph": "i", "s": "g", "pid": FLEET_PID, "tid": 0, "ts": us(e.time_ns),
                 "name": f"weight update v{e.version}", "cat": "weight_update", "args": args})
        w.event({"ph": "C", "pid": FLEET_PID, "ts": us(e.time_ns), "name": "policy version",
                 "args": {"version": e.version}})
    for note in tl.notes:
        w.event({"ph": "i", "s": "g", "pid": FLEET_PID, "tid": 0, "ts": 0, "name": "note: " + note, "cat": "note"})

    # ---------------------------------------------------------------- the servers
    window = max((e for _, e, _ in tl.intervals), default=origin) - origin
    bucket = token_bucket_ns(window)
    for order, server in enumerate(servers, 1):
        pid = server_pid[server]
        name_process(pid, f"server {server}", order)
        calls = tl.servers[server]
        for k in range(tl.server_lanes.get(server, 0)):
            name_thread(pid, 1 + k, f"lane {1 + k}")
        for c in calls:
            if c.lane is None:
                continue
            tokens = f',"tokens":{c.tokens}' if c.tokens is not None else ""
            ts = (c.start_ns - origin) // 1000
            w.text(f'{{"ph":"X","pid":{pid},"tid":{1 + c.lane},"ts":{ts},'
                   f'"dur":{(c.end_ns - origin) // 1000 - ts},"name":{w.q(c.name)},"cat":"generation",'
                   f'"args":{{"trace_id":"{c.trace_id}"{tokens}}}}}')
        _counter(w, pid, "generations in flight", ((c.start_ns, c.end_ns) for c in calls), us)
        for t, rate in token_rates(calls, origin, bucket):
            w.event({"ph": "C", "pid": pid, "ts": us(t), "name": "output tokens/s", "args": {"tokens/s": rate}})

    # ---------------------------------------------------------------- the workers
    tails: dict[tuple[str, str], str] = {}
    by_worker: dict[str, list[Any]] = {}
    for r in tl.rollouts:
        by_worker.setdefault(r.worker or "unknown", []).append(r)
    for order, worker in enumerate(workers, 1 + len(servers)):
        pid = worker_pid[worker]
        name_process(pid, f"worker {worker}", order)
        for k in range(tl.workers[worker]):
            name_thread(pid, 1 + k, f"lane {1 + k}")
        buf = w.buf
        head = f'{{"ph":"X","pid":{pid},"tid":'
        for r in by_worker.get(worker, ()):
            tid = 1 + r.lane
            args = {"trace_id": r.trace_id, "step": r.step, "sample_index": r.sample_index, "rollout_n": r.rollout_n,
                    "group": r.group, "reward": _number(r.reward), "verdict": r.verdict,
                    "policy_version": r.policy_version, "policy_version_end": r.policy_version_end,
                    "staleness": r.staleness, "crossed_update": r.crossed_update, "recorded": r.recorded}
            w.event({"ph": "X", "pid": pid, "tid": tid, "ts": us(r.start_ns), "dur": us(r.end_ns) - us(r.start_ns),
                     "name": f"rollout {r.verdict}", "cat": "rollout",
                     "args": {k: v for k, v in args.items() if v is not None}})
            for c in r.children:  # (the bulk of a large step's file: formatted here, names quoted once)
                tail = tails.get((c.name, c.cat))
                if tail is None:
                    tail = tails[(c.name, c.cat)] = f'"name":{w.q(c.name)},"cat":{w.q(c.cat)}'
                if c.server is not None or c.tokens is not None:
                    tail += ',"args":{' + ",".join([f'"server":{w.q(c.server)}'] * (c.server is not None) + [
                        f'"tokens":{c.tokens}'] * (c.tokens is not None)) + "}"
                ts = (c.start_ns - origin) // 1000  # as us(): whole microseconds, floored
                buf.append(f'{head}{tid + c.row},"ts":{ts},"dur":{(c.end_ns - origin) // 1000 - ts},{tail}}}')
            w.count += len(r.children)
            if len(buf) >= _BUFFER:
                w.flush()
                buf = w.buf
        _counter(w, pid, "rollouts in flight", ((s, e) for s, e, wk in tl.intervals if (wk or "unknown") == worker),
                 us)

    info = {"source": tl.source, "run": tl.run, "validate": tl.validate, "steps": list(tl.steps),
            "origin_unix_ns": origin, "ts_unit": "us",
            "rollouts": len(tl.intervals), "rollouts_drawn": len(tl.rollouts),
            "rollouts_with_children": sum(1 for r in tl.rollouts if r.children),
            "workers": {wk: {"pid": worker_pid[wk], "lanes": tl.workers[wk]} for wk in workers},
            "servers": {s: {"pid": server_pid[s], "lanes": tl.server_lanes.get(s, 0)} for s in servers},
            "weight_updates": len(tl.events), "tokens_per_s_bucket_ms": bucket / 1e6,
            "limits": {"max_rollouts": tl.limits.max_rollouts, "max_detailed": tl.limits.max_detailed,
                       "max_lanes": tl.limits.max_lanes},
            "left_out": tl.left_out, "notes": tl.notes,
            "rollout_url": (f"/run/{tl.run}/rollout/{{trace_id}}" if tl.run else "/run/<run>/rollout/{trace_id}"),
            "doc": "docs/timeline.md"}
    w.close({"rtrace": info})
    info["events"] = w.count
    info["bytes"] = w.bytes
    return info


class _Span:
    __slots__ = ("start_ns", "end_ns", "key", "lane")

    def __init__(self, start: int, end: int, key: Any) -> None:
        self.start_ns, self.end_ns, self.key, self.lane = start, end, key, None


def _number(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


def _counter(w: _Out, pid: int, name: str, spans: Iterable[tuple[int, int]], us: Any) -> None:
    """A ``C`` event at each moment the number of open intervals changes (its value after
    every change at that moment): an interval counts from its start to before its end."""
    spans = list(spans)
    if not spans:
        return
    starts, ends = zip(*spans)
    # on the file's clock (whole microseconds): one value per moment, the count after every
    # change at it, as a count of the drawn slices gives it
    points = Counter(map(us, starts))
    points.subtract(Counter(map(us, ends)))
    value = 0
    quoted = w.q(name)
    head = f'{{"ph":"C","pid":{pid},"ts":'
    tail = f',"name":{quoted},"args":{{{quoted}:'
    lines = []
    for t in sorted(points):
        if points[t] == 0:  # as many began as ended: the count did not change
            continue
        value += points[t]
        lines.append(f"{head}{t}{tail}{value}}}}}")
    w.lines(lines)


def token_rates(calls: Iterable[Any], origin: int, bucket: int) -> list[tuple[int, float]]:
    """Output tokens per second of a server, by bucket of ``bucket`` ns from ``origin``: each
    generation's tokens spread evenly over its time (a call of no duration: in its bucket).
    ``(bucket start, rate)`` from the first bucket with tokens to one past the last, so that
    the rates times the bucket's seconds sum to the calls' tokens."""
    acc: dict[int, float] = {}
    for c in calls:
        tokens = c.tokens
        if not tokens:
            continue
        s, e = c.start_ns - origin, c.end_ns - origin
        if e <= s:
            k = s // bucket
            acc[k] = acc.get(k, 0.0) + tokens
            continue
        first, last = s // bucket, (e - 1) // bucket
        if first == last:
            acc[first] = acc.get(first, 0.0) + tokens
            continue
        per_ns = tokens / (e - s)
        for k in range(first, last + 1):
            lo, hi = max(s, k * bucket), min(e, (k + 1) * bucket)
            acc[k] = acc.get(k, 0.0) + per_ns * (hi - lo)
    if not acc:
        return []
    seconds = bucket / 1e9
    first, last = min(acc), max(acc)
    return [(origin + k * bucket, acc.get(k, 0.0) / seconds) for k in range(first, last + 1)] + [
        (origin + (last + 1) * bucket, 0.0)]
