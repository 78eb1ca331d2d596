"""The fleet in time: a step's rollouts laid out on their workers' lanes, with what they did.

One query layer for ``rtrace timeline`` (a Chrome trace-event file: :mod:`rtrace.report.trace_json`)
and ``rtrace serve``'s swimlane: :func:`load_timeline` reads a step (or a range) from a JSONL file
or a run's dataset and returns a :class:`Timeline`:

* each rollout (:class:`Rollout`) on a *lane* of its *worker* (the process it ran in:
  ``RTRACE_WORKER_NAME``, else ``host:pid``): concurrent rollouts of a worker are packed onto as
  few lanes as fit (first fit by start time), and two rollouts never share a lane at once;
* inside a recorded rollout, its spans as :class:`Slice` s (generation, tool, reward, any other
  kind), nested as they ran, and the time in which none of its calls runs (no leaf span: a
  call that made no call of its own) as ``wait`` slices. (The ``wait_ms`` metric is the time in
  neither a generation nor a tool call: a reward computed or an answer parsed inside the rollout
  counts there as waiting, and is drawn as itself here.) A lane shows properly nested slices
  only (what trace viewers draw): a call that ran beside a sibling (``asyncio.gather`` of tool
  calls) goes to a row of its own below the rollout's, and the rollout takes that many lanes; a
  span that outlives its parent (another process's clock) is cut to it. A rollout recorded as a summary only is a slice without
  children;
* each inference server's generations (``server.address[:server.port]`` on generation spans:
  the gateway's upstreams, an adapter's engine), packed onto the server's lanes;
* the run's events (weight updates, ``rtrace.mark_weight_update``) and each step's extent.

Bounded: at most ``max_rollouts`` rollouts are drawn, ``max_detailed`` of them with their
children (the rest as bare slices), ``max_lanes`` lanes per worker and per server; what is left
out is counted in :attr:`Timeline.left_out` and said in :attr:`Timeline.notes` (the file's
metadata). Counters count every rollout of the window, drawn or not. docs/timeline.md.
"""

from __future__ import annotations

import bisect
import heapq
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..events import RunEvent, is_event_line
from ..summary import idle

__all__ = ["Slice", "Rollout", "ServerCall", "Timeline", "Limits", "load_timeline", "layout_rollout",
           "pack_lanes", "category", "MIN_WAIT_NS", "build", "read_rollouts", "read_spans", "read_generations",
           "read_events", "generation_times", "server_name"]

#: Gaps shorter than this are not drawn as ``wait`` slices (the time between one call's end and
#: the next one's start in the agent's own code); the ``wait_ms`` metric counts every gap.
MIN_WAIT_NS = 100_000


@dataclass(slots=True)
class Slice:
    """One span of a rollout (or a gap), as drawn: ``row`` 0 is the rollout's own lane, ``row``
    k its k-th extra lane (a call that ran beside a sibling)."""

    name: str
    cat: str  # generation | tool | reward | wait | another span kind
    start_ns: int
    end_ns: int
    row: int = 0
    span_id: str | None = None
    server: str | None = None
    tokens: int | None = None


@dataclass(slots=True)
class Rollout:
    trace_id: str
    step: int | None
    validate: bool
    start_ns: int
    end_ns: int
    worker: str | None = None
    sample_index: int | None = None
    rollout_n: int | None = None
    group: str | None = None
    policy_version: int | None = None
    policy_version_end: int | None = None
    crossed_update: bool | None = None
    reward: float | None = None
    verdict: str = "ok"
    recorded: bool = True
    children: list[Slice] = field(default_factory=list)
    #: lanes it takes (1 + the extra rows of its children), and the first (None: not drawn)
    rows: int = 1
    lane: int | None = None

    @property
    def staleness(self) -> int | None:
        return self.step - self.policy_version if type(self.step) is int and type(self.policy_version) is int \
            else None


@dataclass(slots=True)
class ServerCall:
    """A generation on its inference server's track."""

    start_ns: int
    end_ns: int
    trace_id: str
    name: str
    tokens: int | None
    lane: int | None = None


@dataclass
class Limits:
    #: rollouts drawn (the others only counted); rollouts drawn with their children; lanes
    #: per worker and per server (a rollout or call that finds none is left out, counted)
    max_rollouts: int = 200_000
    max_detailed: int = 20_000
    max_lanes: int = 512


@dataclass
class Timeline:
    source: str
    run: str | None
    validate: bool
    steps: tuple[int, int]
    rollouts: list[Rollout]
    #: worker -> lanes used; server -> its generations (lane-packed) and lanes used
    workers: dict[str, int]
    servers: dict[str, list[ServerCall]]
    server_lanes: dict[str, int]
    events: list[RunEvent]
    #: (step, first start, last end) of each step of the window
    step_spans: list[tuple[int, int, int]]
    #: every rollout's (start, end), drawn or not (the counters)
    intervals: list[tuple[int, int, str | None]] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)

    @property
    def origin_ns(self) -> int:
        """The earliest time drawn (the file's ``ts`` 0)."""
        times = [s for s, _, _ in self.intervals] + [e.time_ns for e in self.events]
        return min(times, default=0)


# ----------------------------------------------------------------------------- layout
def category(kind: str, name: str) -> str:
    """What a span is on the timeline: ``generation``, ``tool``, ``reward`` (kind ``reward``, or
    a name that says reward or score: ``compute_score``), else its kind."""
    if kind in ("generation", "tool", "reward"):
        return kind
    low = name.lower()
    if "reward" in low or "score" in low:
        return "reward"
    return kind


def _label(cat: str, name: str, tool: str | None) -> str:
    if cat == "generation":
        return "generation"
    if cat == "tool":
        return f"tool {tool or name}"
    if cat == "reward":
        return "reward"
    return name


#: one span as read: (span_id, parent_id, name, kind, start_ns, end_ns, server, output tokens, tool name)
SpanRow = tuple


def layout_rollout(rollout: Rollout, spans: Sequence[SpanRow], ordered: bool = False) -> None:
    """Fill ``rollout.children`` and ``rollout.rows`` from its spans (the root among them,
    or not): nesting, rows for calls that ran beside a sibling, and the waits (the time in
    which no leaf span runs: no call that made no call of its own).

    One pass over the spans by start (the longer first): row 0 is a stack of the slices open
    at that moment, as a trace viewer nests them. A span that fits in the innermost one nests
    there; one that outlives its parent is cut to it; one that overlaps a sibling (a call run
    beside another) goes to the first row below where it nests, and its calls follow it.
    ``ordered``: the spans come by start, the longer first, already (the dataset's query)."""
    start, end = rollout.start_ns, rollout.end_ns
    root_id = next((s[0] for s in spans if s[1] is None), None)
    if root_id is None:
        ids = {s[0] for s in spans}
        root_id = next((s[0] for s in spans if s[1] not in ids), None)
    parents = {s[1] for s in spans}
    children = rollout.children
    stack = [(end, root_id)]  # row 0: the open slices, innermost last
    rows: list[list[tuple[int, Any]]] = [stack]
    row_of: dict[Any, int] = {}  # the spans on a row below the rollout's own
    busy: list[tuple[int, int]] = []
    edges: list[int] = []
    for s in spans if ordered else sorted(spans, key=_by_start):
        sid = s[0]
        if sid == root_id:
            continue
        a, b = s[4], s[5]
        a = start if a < start else (end if a > end else a)
        b = a if b < a else (end if b > end else b)
        r = row_of.get(s[1], 0) if row_of else 0
        row = rows[r]
        while row and row[-1][0] <= a and len(row) > (r == 0):
            row.pop()
        if row and row[-1][0] < b:
            if row[-1][1] == s[1]:  # it outlives its parent (another process's clock): cut to it
                b = row[-1][0]
            else:  # beside a sibling: the first row below where it nests
                r = _free_row(rows, a, b)
                row = rows[r]
                row_of[sid] = r
        elif r:
            row_of[sid] = r
        row.append((b, sid))
        cat, label = _kind_of(s[3], s[2], s[8])
        if sid in parents:
            edges.append(a)
            edges.append(b)
        else:
            busy.append((a, b))
        if cat == "generation":
            children.append(Slice(label, cat, a, b, r, sid, s[6], s[7]))
        else:
            children.append(Slice(label, cat, a, b, r, sid))
    if edges:
        edges.sort()
    for lo, hi in idle(busy, start, end):
        if hi - lo < MIN_WAIT_NS:
            continue
        # cut where a span with calls of its own begins or ends: each piece then nests on row 0
        inner = edges[bisect.bisect_right(edges, lo):bisect.bisect_left(edges, hi)] if edges else ()
        a = lo
        for b in (*inner, hi):
            if b - a >= MIN_WAIT_NS:
                children.append(Slice("wait", "wait", a, b))
            a = b
    rollout.rows = len(rows)


def _by_start(s: SpanRow) -> tuple[int, int]:
    return (s[4], -s[5])


def _free_row(rows: list[list[tuple[int, Any]]], a: int, b: int) -> int:
    """The first row below the rollout's own where [a, b] nests (a new one when none)."""
    for r in range(1, len(rows)):
        row = rows[r]
        while row and row[-1][0] <= a:
            row.pop()
        if not row or row[-1][0] >= b:
            return r
    rows.append([])
    return len(rows) - 1


_KINDS: dict[tuple[str, str, str | None], tuple[str, str]] = {}


def _kind_of(kind: str, name: str, tool: str | None) -> tuple[str, str]:
    """``(category, label)`` of a span (cached: a step repeats a few names)."""
    key = (kind, name, tool)
    got = _KINDS.get(key)
    if got is None:
        cat = category(kind, name)
        got = (cat, _label(cat, name, tool))
        if len(_KINDS) < 10_000:
            _KINDS[key] = got
    return got


def _fits(open_ends: list[int], start: int, end: int) -> bool:
    """Does [start, end] nest on a row whose open slices end at ``open_ends`` (a stack)? Slices
    that ended by ``start`` are closed first (items come in order of start)."""
    while open_ends and open_ends[-1] <= start:
        open_ends.pop()
    return not open_ends or open_ends[-1] >= end


def pack_lanes(items: list[Any], max_lanes: int) -> tuple[int, int]:
    """Put each item (``start_ns``, ``end_ns``, ``lane``, optionally ``rows``) on the lowest lanes
    free for its whole time (``rows`` consecutive ones), in order of start: lanes never overlap, and
    concurrent items take as few lanes as first fit allows (exactly the most that overlap, for
    one lane each). Items that find no room within ``max_lanes`` keep ``lane`` None.

    Returns:
        (lanes used, items left out).
    """
    ends: list[int] = []  # each lane's busy-until
    free: list[int] = []  # lanes free now (a heap), for one-lane items
    busy: list[tuple[int, int]] = []  # (end, lane) of busy lanes (a heap)
    left = 0
    for item in sorted(items, key=lambda i: (i.start_ns, i.end_ns)):
        t = item.start_ns
        while busy and busy[0][0] <= t:
            heapq.heappush(free, heapq.heappop(busy)[1])
        need = getattr(item, "rows", 1)
        lane = None
        if need == 1:
            if free:
                lane = heapq.heappop(free)
            elif len(ends) < max_lanes:
                lane = len(ends)
                ends.append(0)
        else:  # a block of consecutive lanes: the first that is free for the whole block
            n = len(ends)
            for first in range(0, max_lanes - need + 1):
                if all(first + k >= n or ends[first + k] <= t for k in range(need)):
                    lane = first
                    break
            if lane is not None:
                taken = set(range(lane, lane + need))
                while len(ends) < lane + need:
                    ends.append(0)
                free = [f for f in free if f not in taken]
                heapq.heapify(free)
        if lane is None:
            left += 1
            continue
        item.lane = lane
        for k in range(need):
            ends[lane + k] = item.end_ns
            heapq.heappush(busy, (item.end_ns, lane + k))
    return len(ends), left


# ----------------------------------------------------------------------------- reading
def load_timeline(path: Any, steps: tuple[int, int], validate: bool = False,
                  limits: Limits | None = None) -> Timeline:
    """The timeline of steps ``steps[0]`` to ``steps[1]`` (inclusive) of a run: ``path`` a run's
    dataset (a folder or URL, or an open :class:`rtrace.dataset.Run`: ``rtrace serve``'s, left
    open) or JSONL files. Raises ValueError when nothing of them is found."""
    from .dataset import is_dataset

    limits = limits or Limits()
    if hasattr(path, "sql") and hasattr(path, "store"):  # an open Run
        rollouts, spans_of, events, run = _from_dataset(path, steps, validate, limits)
        return build(rollouts, spans_of, events, str(path.path), run, validate, steps, limits, True)
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    ordered = len(paths) == 1 and is_dataset(str(paths[0]))
    if ordered:  # the dataset's query gives each rollout's spans by start
        rollouts, spans_of, events, run = _from_dataset(str(paths[0]), steps, validate, limits)
    else:
        rollouts, spans_of, events, run = _from_jsonl([str(p) for p in paths], steps, validate)
    if not rollouts:
        raise ValueError(f"no rollout of {'validation ' if validate else ''}step"
                         f"{'s' if steps[0] != steps[1] else ''} {_steps_text(steps)} in {', '.join(map(str, paths))}")
    return build(rollouts, spans_of, events, ", ".join(map(str, paths)), run, validate, steps, limits, ordered)


def _steps_text(steps: tuple[int, int]) -> str:
    return str(steps[0]) if steps[0] == steps[1] else f"{steps[0]}:{steps[1]}"


def build(rollouts: list[Rollout], spans_of: dict[str, list[SpanRow]], events: list[RunEvent], source: str,
          run: str | None, validate: bool, steps: tuple[int, int], limits: Limits, ordered: bool = False) -> Timeline:
    """Lay out rollouts read from a source (see the module docstring)."""
    left: dict[str, int] = {}
    notes: list[str] = []
    intervals = [(r.start_ns, r.end_ns, r.worker) for r in rollouts]
    step_spans: dict[int, list[int]] = {}
    for r in rollouts:
        if type(r.step) is int:
            span = step_spans.setdefault(r.step, [r.start_ns, r.end_ns])
            span[0], span[1] = min(span[0], r.start_ns), max(span[1], r.end_ns)
    drawn = rollouts
    if len(rollouts) > limits.max_rollouts:
        drawn = _sample(rollouts, limits.max_rollouts)
        left["rollouts_not_drawn"] = len(rollouts) - len(drawn)
        notes.append(f"{len(rollouts)} rollouts in the window: {len(drawn)} drawn (the lowest trace ids: a uniform "
                     f"sample), the others counted in the counters only (max_rollouts={limits.max_rollouts})")
    detailed = [r for r in drawn if r.trace_id in spans_of]
    if len(detailed) > limits.max_detailed:
        keep = {r.trace_id for r in _sample(detailed, limits.max_detailed)}
        left["rollouts_without_children"] = len(detailed) - len(keep)
        notes.append(f"{len(detailed)} recorded rollouts: {len(keep)} drawn with their calls (the lowest trace ids), "
                     f"the others as bare slices (max_detailed={limits.max_detailed})")
        detailed = [r for r in detailed if r.trace_id in keep]
    servers: dict[str, list[ServerCall]] = {}
    for r in detailed:
        layout_rollout(r, spans_of[r.trace_id], ordered)
        for c in r.children:
            if c.server is not None:
                servers.setdefault(c.server, []).append(ServerCall(c.start_ns, c.end_ns, r.trace_id, c.name,
                                                                   c.tokens))
    by_worker: dict[str, list[Rollout]] = {}
    for r in drawn:
        by_worker.setdefault(r.worker or "unknown", []).append(r)
    workers, lane_left = _pack_each(by_worker, limits.max_lanes)
    if lane_left:
        left["rollouts_past_max_lanes"] = lane_left
        notes.append(f"{lane_left} rollouts found no lane within max_lanes={limits.max_lanes} of their worker: not "
                     "drawn, counted in the counters")
    server_lanes, call_left = _pack_each(servers, limits.max_lanes)
    if call_left:
        left["server_calls_past_max_lanes"] = call_left
        notes.append(f"{call_left} generations found no lane within max_lanes={limits.max_lanes} of their server: "
                     "not drawn on it, counted in its counters")
    drawn = sorted((r for r in drawn if r.lane is not None), key=lambda r: (r.worker or "", r.lane, r.start_ns))
    return Timeline(source, run, validate, steps, drawn, workers, servers, server_lanes,
                    sorted(events, key=lambda e: e.time_ns),
                    sorted((s, a, b) for s, (a, b) in step_spans.items()), intervals, left, notes, limits)


def _pack_each(rows: dict[str, list[Any]], max_lanes: int) -> tuple[dict[str, int], int]:
    """Each row's items packed onto its lanes (:func:`pack_lanes`): the lanes by row, and how
    many items found none."""
    lanes: dict[str, int] = {}
    left = 0
    for name, items in sorted(rows.items()):
        lanes[name], out = pack_lanes(items, max_lanes)
        left += out
    return lanes, left


def _sample(rollouts: list[Rollout], n: int) -> list[Rollout]:
    """``n`` of the rollouts: those of the lowest trace ids (random ids: a uniform sample,
    the same one every time)."""
    return sorted(rollouts, key=lambda r: r.trace_id)[:n]


def _from_jsonl(paths: list[str], steps: tuple[int, int], validate: bool
                ) -> tuple[list[Rollout], dict[str, list[SpanRow]], list[RunEvent], str | None]:
    from ..trajectory import Trajectory
    from .load import _loads

    rollouts: list[Rollout] = []
    spans_of: dict[str, list[SpanRow]] = {}
    events: list[RunEvent] = []
    lo, hi = steps
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                raw = _loads(line)
            except ValueError:
                continue  # a line still being written
            if is_event_line(raw):
                try:
                    events.append(RunEvent.from_wire(raw))
                except ValueError:
                    pass
                continue
            step = raw.get("step") if isinstance(raw, dict) else None
            if type(step) is not int or not lo <= step <= hi or bool(raw.get("validate")) != validate:
                continue
            traj = Trajectory.from_dict(raw)
            if not traj.spans:
                continue
            rollouts.append(Rollout(
                traj.trace_id, traj.step, traj.validate, traj.start_ns, traj.end_ns, traj.worker, traj.sample_index,
                traj.rollout_n, None if traj.group_id is None and traj.sample_index is None else str(
                    traj.group_id if traj.group_id is not None else traj.sample_index),
                traj.policy_version, traj.policy_version_end, traj.crossed_update, traj.reward, traj.verdict(), True))
            spans_of[traj.trace_id] = [_span_row(s) for s in traj.spans]
    return rollouts, spans_of, events, None


def _span_row(s: Any) -> SpanRow:
    attrs = s.attributes
    address, port = attrs.get("server.address"), attrs.get("server.port")
    server = None if address is None else (f"{address}:{port}" if type(port) is int else str(address))
    tokens = attrs.get("gen_ai.usage.output_tokens")
    tool = attrs.get("gen_ai.tool.name")
    return (s.span_id, s.parent_id, s.name, s.kind, s.start_ns, s.end_ns, server,
            tokens if type(tokens) is int else None, tool if isinstance(tool, str) else None)


#: the trajectories columns the timeline reads (NULL for those a file before 1.2 lacks)
_COLUMNS = ("trace_id", "step", "validate", "epoch_ns(start_time)", "epoch_ns(end_time)", "worker", "sample_index",
            "rollout_n", "group_key", "policy_version", "policy_version_end", "crossed_update", "reward", "verdict",
            "recorded")
#: a generation's inference server, from its span's attributes (as :func:`_span_row` reads it)
_SERVER_SQL = ("CASE WHEN kind = 'generation' THEN attributes_str['server.address'] END AS address, "
               "CASE WHEN kind = 'generation' THEN attributes_int['server.port'] END AS port")
_WHERE = "validate = ? AND step BETWEEN ? AND ?"


def _from_dataset(path: Any, steps: tuple[int, int], validate: bool, limits: Limits
                  ) -> tuple[list[Rollout], dict[str, list[SpanRow]], list[RunEvent], str | None]:
    from ..dataset.reader import open_run
    from .queries import RelationDb

    mine = isinstance(path, str)
    run = open_run(path) if mine else path
    path = run.path
    try:
        db = RelationDb(run)
        rollouts = read_rollouts(db, steps, validate)
        spans_of = read_spans(db, steps, validate) if any(r.recorded for r in rollouts) else {}
        return rollouts, spans_of, read_events(db), os.path.basename(os.path.normpath(str(path).split("?")[0]))
    finally:
        if mine:
            run.close()


def read_rollouts(db: Any, steps: tuple[int, int], validate: bool) -> list[Rollout]:
    """The rollouts of steps ``steps[0]`` to ``steps[1]`` from a dataset's ``trajectories``
    (``db``: a :class:`rtrace.report.queries.Db`), without their children."""
    have = set(db.rows("SELECT * FROM trajectories LIMIT 0")[0])
    cols = ", ".join(c if c.startswith("epoch_ns") or c in have else f"NULL AS {c}" for c in _COLUMNS)
    _, rows = db.rows(f"SELECT {cols} FROM trajectories WHERE {_WHERE}", [validate, steps[0], steps[1]])
    return [Rollout(r[0], r[1], bool(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12],
                    r[13] or "ok", r[14] is not False) for r in rows]


def read_spans(db: Any, steps: tuple[int, int], validate: bool, trace_ids: Sequence[str] | None = None
               ) -> dict[str, list[SpanRow]]:
    """trace id -> its spans (:data:`SpanRow`) of those steps, by start, the longer first (as
    :func:`layout_rollout` takes them ``ordered``); ``trace_ids``: of those rollouts only."""
    params: list[Any] = [validate, steps[0], steps[1]]
    where = _WHERE
    if trace_ids is not None:
        where += " AND trace_id IN (SELECT unnest(?::VARCHAR[]))"
        params.append(list(trace_ids))
    table = db.arrow(
        "SELECT trace_id, span_id, parent_span_id, name, kind, epoch_ns(start_time) AS s, epoch_ns(end_time) "
        f"AS e, {_SERVER_SQL}, output_tokens, tool_name FROM spans WHERE {where} ORDER BY trace_id, s, e DESC",
        params)
    out: dict[str, list[SpanRow]] = {}
    _spans_by_trace(table, out)
    return out


def read_generations(db: Any, steps: tuple[int, int], validate: bool) -> dict[str, list[ServerCall]]:
    """server -> its generations (the server tracks), in order of start: the generation spans that
    name their server, with their times as recorded."""
    _, rows = db.rows(
        f"SELECT * FROM (SELECT epoch_ns(start_time) AS s, epoch_ns(end_time) AS e, trace_id, name, output_tokens, "
        f"{_SERVER_SQL} FROM spans WHERE {_WHERE} AND kind = 'generation') WHERE address IS NOT NULL ORDER BY s",
        [validate, steps[0], steps[1]])
    out: dict[str, list[ServerCall]] = {}
    for s, e, trace, name, tokens, address, port in rows:
        out.setdefault(server_name(address, port), []).append(ServerCall(s, max(s, e), trace, "generation", tokens))
    return out


def generation_times(db: Any, steps: tuple[int, int], validate: bool, origin_ns: int = 0
                     ) -> dict[str, tuple[list[int], list[int], int]]:
    """server -> the starts and the ends of its generations (ns from ``origin_ns``), each sorted,
    and the most in flight at once (the lanes :func:`pack_lanes` gives them): what is in flight
    when, without one object per call (``rtrace serve``'s server tracks before their lanes are shown)."""
    calls = (f"SELECT epoch_ns(start_time) - ? AS s, greatest(epoch_ns(end_time), epoch_ns(start_time)) - ? AS e, "
             f"{_SERVER_SQL} FROM spans WHERE {_WHERE} AND kind = 'generation'")
    # the most open at once: +1 at each start, -1 at each end, an end before a start at the same time
    _, rows = db.rows(
        f"WITH c AS (SELECT * FROM ({calls}) WHERE address IS NOT NULL), "
        "p AS (SELECT address, port, max(n) AS peak FROM (SELECT address, port, sum(d) OVER (PARTITION BY address, "
        "port ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS n FROM (SELECT address, port, s AS t, 1 AS d FROM c "
        "UNION ALL SELECT address, port, e, -1 FROM c)) GROUP BY ALL) "
        "SELECT address, port, list(s ORDER BY s), list(e ORDER BY e), any_value(peak) FROM c "
        "JOIN p USING (address, port) GROUP BY ALL",
        [origin_ns, origin_ns, validate, steps[0], steps[1]])
    return {server_name(address, port): (starts, ends, peak) for address, port, starts, ends, peak in rows}


def server_name(address: str, port: int | None) -> str:
    """A server track's name: ``address:port`` (the address alone without a port)."""
    return f"{address}:{port}" if port is not None else address


def _spans_by_trace(table: Any, out: dict[str, list[SpanRow]]) -> None:
    """Rows sorted by trace id into ``out`` (one Python pass over Arrow's columns)."""
    col = {name: table.column(name).to_pylist() for name in table.column_names}
    servers = col["address"]
    for i, (a, p) in enumerate(zip(servers, col["port"])):
        if a is not None and p is not None:
            servers[i] = server_name(a, p)
    rows = list(zip(col["span_id"], col["parent_span_id"], col["name"], col["kind"], col["s"], col["e"], servers,
                    col["output_tokens"], col["tool_name"]))
    traces = col["trace_id"]
    n = len(traces)
    if not n:
        return
    # each trace's rows are consecutive (ordered by trace id): cut the list where the id changes
    import pyarrow.compute as pc

    ids = table.column("trace_id").combine_chunks()
    changed = pc.not_equal(ids.slice(1), ids.slice(0, n - 1))
    cuts = [0] + [i + 1 for i in pc.indices_nonzero(changed).to_pylist()] + [n]
    for lo, hi in zip(cuts, cuts[1:]):
        out[traces[lo]] = rows[lo:hi]


def read_events(db: Any) -> list[RunEvent]:
    """The run's events (its ``events`` table; none for a run written before 1.2)."""
    try:
        _, rows = db.rows("SELECT kind, epoch_ns(time), version, step, worker, event_id, attributes_bool, "
                          "attributes_int, attributes_double, attributes_str FROM events")
    except Exception:  # a run written before 1.2: no events table
        return []
    out = []
    for kind, t, version, step, worker, event_id, *maps in rows:
        attrs: dict[str, Any] = {}
        for m in maps:
            attrs.update(dict(m or {}))
        out.append(RunEvent(kind, t, version, step, worker, attrs, event_id))
    return out


def rollouts_in(timeline: Timeline, worker: str) -> Iterable[Rollout]:
    """The drawn rollouts of one worker, by lane then start."""
    return (r for r in timeline.rollouts if (r.worker or "unknown") == worker)
