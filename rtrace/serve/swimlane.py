"""``rtrace serve``'s swimlane: a step's fleet in time, in windows (docs/serve.md, "A step's timeline").

The page (``/run/<run>/timeline/t12``) draws on one ``<canvas>`` (static/swimlane.js): a band per
inference server and per worker process, each a header row (its name and how many of its lanes
are busy over time) and, once opened, its lanes; each rollout a slice on a lane of its worker
with its generations, tool calls, reward computation and waits inside it; each generation
again on a lane of its server; weight updates as vertical lines. The data is
:mod:`rtrace.report.timeline`'s (the same reading, lane packing and rollout layout as
``rtrace timeline``), kept per step in a :class:`StepLanes` and sent a window at a time
(``.json?t0=&t1=&px=&lanes=&lane_px=``), as the rollouts table sends a page of rows:

* only the lanes asked for (at most :data:`MAX_LANES`), and only their slices that overlap
  [t0, t1];
* slices narrower than ``min_px`` pixels at the window's scale are merged with their narrow
  neighbours on the same row into one slice that says how many it holds (``n``; drawn grey
  when they differ in kind): a lane holds at most about ``2 * px / min_px`` slices per row,
  whatever the number of rollouts;
* a rollout's calls are sent only when its lane is tall enough to show them (``lane_px`` >=
  :data:`DETAIL_LANE_PX`) and the rollout is at least :data:`DETAIL_MIN_PX` pixels wide;
* past :data:`MAX_SLICES` slices, ``min_px`` doubles until they fit (said in ``min_px``);
* each band's header gets its mean lanes in use per bin of the window (``profiles``), from
  sorted start and end times (two binary searches per bin edge).

What it keeps per step, built once per step's files (the last :data:`CACHED_STEPS` steps
looked at): the step's rollouts, packed onto their workers' lanes (one lane each: calls that
ran beside a sibling are drawn on a sub-row inside the rollout's lane, where ``rtrace timeline``
gives them lanes of their own), the starts and ends of each server's generations; laid out
when first shown: a server's lanes (its generations read and packed), a rollout's calls (its
spans read, with those of the other rollouts of the window, and laid out; the last
:data:`CACHED_LAYOUTS` kept).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections import OrderedDict
from itertools import accumulate, groupby
from typing import Any, Sequence

from ..report import timeline as T
from ..report.views import step_key

from ..report.trace_json import _dumps  # one compact JSON encoder (orjson when installed)

__all__ = ["StepLanes", "SwimlaneCache", "window_json", "encoded", "MAX_LANES", "MAX_SLICES", "MAX_PX",
           "DETAIL_LANE_PX", "DETAIL_MIN_PX", "CATS"]

#: lanes per window; pixels across; slices per window (then merged coarser); bins per profile
MAX_LANES, MAX_PX, MAX_SLICES, MAX_BINS = 400, 4096, 40_000, 1024
#: calls drawn inside rollouts whose lane is this tall and which are this wide (pixels)
DETAIL_LANE_PX, DETAIL_MIN_PX = 8, 4
#: lanes drawn open on first view when the step has at most this many in all
OPEN_LANES = 64
#: a window's times are whole ticks from its start, this many per pixel of it (``tick_ms``)
TICKS = 16
#: steps kept laid out; rollouts whose calls are kept laid out
CACHED_STEPS, CACHED_LAYOUTS = 2, 6_000
#: the slices' kinds (``cat``: an index here; other span kinds are added after these)
CATS = ("rollout", "generation", "tool", "reward", "wait", "mixed")
MS = 1_000_000


def _natural(name: str) -> list[Any]:
    """``node-2`` before ``node-10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class Band:
    """A server's or a worker's rows: ``lanes`` lanes, the starts and ends (ns from the step's
    origin, sorted) of what runs on them, and per lane its items in order of start (a server's
    built when first shown)."""

    __slots__ = ("kind", "name", "count", "lanes", "starts", "ends", "cs", "ce", "lane_index")

    def __init__(self, kind: str, name: str, starts: list[int], ends: list[int], lanes: int) -> None:
        self.kind, self.name, self.count, self.lanes = kind, name, len(starts), lanes
        self.starts, self.ends = starts, ends
        self.cs = [0, *accumulate(starts)]
        self.ce = [0, *accumulate(ends)]
        #: per lane: (starts, ends, items), items rollout indexes (workers) or (rollout index, output
        #: tokens) of each generation (servers)
        self.lane_index: list[tuple[list[int], list[int], list[Any]]] | None = None

    def busy_time(self, t: int) -> int:
        """The integral of the lanes in use from the beginning to ``t`` (ns x lanes)."""
        i = bisect.bisect_right(self.starts, t)
        j = bisect.bisect_right(self.ends, t)
        return t * (i - j) - (self.cs[i] - self.ce[j])

    def profile(self, t0: int, t1: int, bins: int) -> list[float]:
        """Mean lanes in use in each of ``bins`` equal parts of [t0, t1]."""
        if not self.count:
            return [0.0] * bins
        width = (t1 - t0) / bins
        edges = [self.busy_time(int(t0 + width * k)) for k in range(bins + 1)]
        return [round((b - a) / width, 1) if width > 0 else 0.0 for a, b in zip(edges, edges[1:])]


class StepLanes:
    """One step of a run laid out for the swimlane (see the module docstring)."""

    def __init__(self, db: Any, run: str, validate: bool, step: int, limits: T.Limits | None = None) -> None:
        self.run, self.validate, self.step = run, validate, step
        self.steps = (step, step)
        self.limits = limits or T.Limits()
        rollouts = T.read_rollouts(db, self.steps, validate)
        if not rollouts:
            raise ValueError(f"no rollout at {step_key(validate, step)}")
        self.origin = min(r.start_ns for r in rollouts)
        # the servers' generations are read (DuckDB, without the GIL) while the rollouts are packed
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            servers_later = pool.submit(T.generation_times, db, self.steps, validate, self.origin)
            events = T.read_events(db)
            #: the rollouts packed onto their workers' lanes (no calls yet: each takes one lane)
            self.timeline = T.build(rollouts, {}, events, run, run, validate, self.steps, self.limits)
            servers = servers_later.result()
        tl = self.timeline
        self.total = len(rollouts)
        self.end = max(r.end_ns for r in rollouts) - self.origin
        margin = max(self.end // 20, MS)
        self.events = [e for e in tl.events if -margin <= e.time_ns - self.origin <= self.end + margin]
        before = [e.version for e in tl.events if e.time_ns < self.origin and type(e.version) is int]
        self.version_at_start = before[-1] if before else None
        self.index = {r.trace_id: i for i, r in enumerate(tl.rollouts)}
        o = self.origin
        self.bands: list[Band] = []
        from ..pipeline.metrics import inflight_peak_sorted

        for name in sorted(servers, key=_natural):
            starts, ends, peak = servers[name]
            self.bands.append(Band("server", name, starts, ends, min(peak, self.limits.max_lanes)))
        by_worker: dict[str, list[int]] = {}
        for i, r in enumerate(tl.rollouts):
            by_worker.setdefault(r.worker or "unknown", []).append(i)
        every: dict[str, list[tuple[int, int]]] = {}
        for s, e, w in tl.intervals:  # the profile counts every rollout, drawn or not
            every.setdefault(w or "unknown", []).append((s - o, e - o))
        for name in sorted(tl.workers, key=_natural):
            spans = every.get(name, [])
            band = Band("worker", name, sorted(s for s, _ in spans), sorted(e for _, e in spans), tl.workers[name])
            band.count = len(spans)
            lanes: list[tuple[list[int], list[int], list[Any]]] = [([], [], []) for _ in range(band.lanes)]
            for i in by_worker.get(name, ()):  # in order of lane, then start
                r = tl.rollouts[i]
                starts_, ends_, items = lanes[r.lane]
                starts_.append(r.start_ns - o)
                ends_.append(r.end_ns - o)
                items.append(i)
            band.lane_index = lanes
            self.bands.append(band)
        self.inflight_peak = inflight_peak_sorted(sorted(s for s, _, _ in tl.intervals),
                                                  sorted(e for _, e, _ in tl.intervals))
        busy = [b.ce[-1] - b.cs[-1] for b in self.bands if b.kind == "server"]
        self.slowest_server_share = max(busy) / sum(busy) if busy and sum(busy) > 0 else None
        self.notes = list(tl.notes)
        self.left_out = dict(tl.left_out)
        #: rollout index -> its calls, laid out: (start, end, sub-row, depth, cat, name, server, tokens)
        self._calls: OrderedDict[int, list[tuple]] = OrderedDict()
        self._subrows: dict[int, int] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- laid out when first shown
    def _pack_servers(self, db: Any) -> None:
        if all(b.lane_index is not None for b in self.bands if b.kind == "server"):
            return
        calls = T.read_generations(db, self.steps, self.validate)
        o = self.origin
        for band in self.bands:
            if band.kind != "server":
                continue
            mine = calls.get(band.name, [])
            used, left = T.pack_lanes(mine, self.limits.max_lanes)
            if left:
                self.left_out["server_calls_past_max_lanes"] = self.left_out.get("server_calls_past_max_lanes", 0) + left
            band.lanes = used
            lanes: list[tuple[list[int], list[int], list[Any]]] = [([], [], []) for _ in range(used)]
            index = self.index
            for c in sorted((c for c in mine if c.lane is not None), key=lambda c: (c.lane, c.start_ns)):
                starts, ends, items = lanes[c.lane]
                starts.append(c.start_ns - o)
                ends.append(c.end_ns - o)
                items.append((index.get(c.trace_id, -1), c.tokens))  # not the call objects: 4x the memory
            band.lane_index = lanes

    def _lay_out(self, db: Any, wanted: list[int]) -> None:
        """Lay out the calls of the rollouts ``wanted`` not laid out yet (their spans read at once)."""
        missing = [i for i in wanted if i not in self._calls]
        for i in wanted:
            if i in self._calls:
                self._calls.move_to_end(i)
        if not missing:
            return
        tl, o = self.timeline, self.origin
        spans = T.read_spans(db, self.steps, self.validate, [tl.rollouts[i].trace_id for i in missing])
        for i in missing:
            r = tl.rollouts[i]
            r.children = []
            rows = spans.get(r.trace_id)
            if rows:
                T.layout_rollout(r, rows, ordered=True)
            out, stacks = [], {}
            # in order of start, the longer first (a wait after a span of the same extent: inside it),
            # each sub-row a stack of the open slices: a slice's depth is how many hold it
            for c in sorted(r.children, key=lambda c: (c.start_ns, -c.end_ns, c.cat == "wait")):
                stack = stacks.setdefault(c.row, [])
                while stack and stack[-1] <= c.start_ns:
                    stack.pop()
                out.append((c.start_ns - o, c.end_ns - o, c.row, len(stack) + 1, c.cat, c.name, c.server, c.tokens))
                stack.append(c.end_ns)
            out.sort(key=lambda c: (c[2], c[3], c[0]))
            self._calls[i] = out
            self._subrows[i] = max(1, r.rows)
            r.children = []  # kept compact above
        while len(self._calls) > CACHED_LAYOUTS:
            self._calls.popitem(last=False)

    # ----------------------------------------------------------------- a window
    def default_lanes(self) -> list[tuple[int, int]]:
        """The lanes open on first view: every lane when there are at most :data:`OPEN_LANES`."""
        if sum(b.lanes for b in self.bands) > OPEN_LANES:
            return []
        return [(b, lane) for b, band in enumerate(self.bands) for lane in range(band.lanes)]

    def window(self, db: Any, t0_ms: float | None = None, t1_ms: float | None = None, px: int = 1400,
               lanes: Sequence[tuple[int, int]] | None = None, lane_px: int = 16, min_px: float = 2.0,
               links_base: str = "") -> dict[str, Any]:
        """The data of one window (see the module docstring): times in ms from the step's first
        rollout's start."""
        end_ms = self.end / MS
        t0_ms = -0.02 * end_ms if t0_ms is None or not math.isfinite(t0_ms) else t0_ms
        t1_ms = 1.02 * end_ms if t1_ms is None or not math.isfinite(t1_ms) else t1_ms
        if t1_ms <= t0_ms:
            t1_ms = t0_ms + max(end_ms, 1.0)
        px = max(50, min(MAX_PX, int(px)))
        wanted = self.default_lanes() if lanes is None else [
            (b, lane) for b, lane in lanes if 0 <= b < len(self.bands) and 0 <= lane < self.bands[b].lanes]
        clipped = len(wanted) > MAX_LANES
        wanted = wanted[:MAX_LANES]
        t0, t1 = int(t0_ms * MS), int(t1_ms * MS)
        with self._lock:
            if any(self.bands[b].kind == "server" for b, _ in wanted):
                self._pack_servers(db)
            while True:
                out = _Window(self, t0, t1, (t1 - t0) / px, min_px)
                out.lanes(db, wanted, lane_px >= DETAIL_LANE_PX)
                if len(out.t0) <= MAX_SLICES or min_px >= 64:
                    break
                min_px = max(0.5, min_px * 2)
        bins = max(1, min(MAX_BINS, px // 3))
        return {
            "run": self.run, "key": step_key(self.validate, self.step), "step": self.step, "validate": self.validate,
            "origin_ns": self.origin, "end_ms": round(end_ms, 3), "rollouts_total": self.total,
            "version_at_start": self.version_at_start,
            "bands": [{"kind": b.kind, "name": b.name, "lanes": b.lanes, "count": b.count} for b in self.bands],
            "events": [{"kind": e.kind, "t": round((e.time_ns - self.origin) / MS, 3), "version": e.version,
                        "step": e.step, "worker": e.worker} for e in self.events],
            "notes": self.notes, "left_out": self.left_out, "rollout_base": links_base,
            "window": {"t0": t0_ms, "t1": t1_ms, "px": px, "min_px": min_px, "lane_px": lane_px,
                       "lanes": [list(x) for x in wanted], "lanes_clipped": clipped,
                       "detail": lane_px >= DETAIL_LANE_PX},
            "profiles": {"bins": bins, "values": [b.profile(t0, t1, bins) for b in self.bands]},
            "cats": out.cats, "names": out.names,
            "tick_ms": out.tick_ns / MS,
            "slices": {"lane": out.lane, "sub": out.sub, "depth": out.depth, "t0": out.ticks(out.t0),
                       "t1": out.ticks(out.t1), "cat": out.cat, "name": out.name, "ro": out.ro, "n": out.n,
                       "gen": out.gen},
            "rollouts": out.rollout_table(),
        }


class _Window:
    """The slices of one window, merged where narrow, as columns."""

    def __init__(self, lanes: StepLanes, t0: int, t1: int, ns_px: float, min_px: float) -> None:
        self.s, self.t0_ns, self.t1_ns = lanes, t0, t1
        self.ns_px = ns_px
        self.min_ns = ns_px * min_px
        self.lane: list[int] = []
        self.sub: list[int] = []
        self.depth: list[int] = []
        self.t0: list[float] = []
        self.t1: list[float] = []
        self.cat: list[int] = []
        self.name: list[int] = []
        self.ro: list[int] = []
        self.n: list[int] = []
        #: (slice, output tokens, server) of the generations: [i, tokens, server name, ...]
        self.gen: list[Any] = []
        self.tick_ns = max(ns_px / TICKS, 1.0)
        self.cats = list(CATS)
        self._cat_ids = {c: i for i, c in enumerate(self.cats)}
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self._ro_ids: dict[int, int] = {}
        self._ros: list[int] = []

    def _id(self, table: list[str], ids: dict[str, int], value: str) -> int:
        i = ids.get(value)
        if i is None:
            i = ids[value] = len(table)
            table.append(value)
        return i

    def _ro(self, index: int) -> int:
        if index < 0:
            return -1
        i = self._ro_ids.get(index)
        if i is None:
            i = self._ro_ids[index] = len(self._ros)
            self._ros.append(index)
        return i

    def _emit(self, row: int, sub: int, depth: int, s: int, e: int, cat: str, name: str | None, ro: int, n: int,
              tok: int | None = None, srv: str | None = None) -> None:
        if tok is not None or srv is not None:
            self.gen += [len(self.t0), tok, -1 if srv is None else self._id(self.names, self._name_ids, srv)]
        self.lane.append(row)
        self.sub.append(sub)
        self.depth.append(depth)
        self.t0.append(s)
        self.t1.append(e)
        self.cat.append(self._id(self.cats, self._cat_ids, cat))
        self.name.append(-1 if name is None else self._id(self.names, self._name_ids, name))
        self.ro.append(self._ro(ro))
        self.n.append(n)

    def ticks(self, times: list[int]) -> list[int]:
        """Times as whole ticks (:data:`TICKS` per pixel of the window) from its start."""
        t0, tick = self.t0_ns, self.tick_ns
        return [round((t - t0) / tick) for t in times]

    def series(self, row: int, sub: int, depth: int, items: Any) -> None:
        """Emit ``items`` (start, end, cat, name, rollout index, tokens, server), in order of start
        and not overlapping: narrow neighbours (less than ``min_ns`` wide and apart) merged."""
        min_ns = self.min_ns
        run: list[Any] | None = None  # [start, end, n, cat, ro, first item]
        for item in items:
            s, e = item[0], item[1]
            if e - s >= min_ns:
                if run is not None:
                    self._flush(row, sub, depth, run)
                    run = None
                self._emit(row, sub, depth, s, e, item[2], item[3], item[4], 1, item[5], item[6])
            elif run is not None and s - run[1] < min_ns:
                run[1] = max(run[1], e)
                run[2] += 1
                if run[3] != item[2]:
                    run[3] = "mixed"
                if run[4] != item[4]:
                    run[4] = -1
            else:
                if run is not None:
                    self._flush(row, sub, depth, run)
                run = [s, e, 1, item[2], item[4], item]
        if run is not None:
            self._flush(row, sub, depth, run)

    def _flush(self, row: int, sub: int, depth: int, run: list[Any]) -> None:
        if run[2] == 1:
            item = run[5]
            self._emit(row, sub, depth, item[0], item[1], item[2], item[3], item[4], 1, item[5], item[6])
        else:
            self._emit(row, sub, depth, run[0], run[1], run[3], None, run[4], run[2])

    def lanes(self, db: Any, wanted: Sequence[tuple[int, int]], detail: bool) -> None:
        s, t0, t1 = self.s, self.t0_ns, self.t1_ns
        rollouts = s.timeline.rollouts
        shown: list[tuple[int, list[int]]] = []
        for row, (b, lane) in enumerate(wanted):
            starts, ends, items = s.bands[b].lane_index[lane]  # type: ignore[index]
            lo, hi = bisect.bisect_right(ends, t0), bisect.bisect_left(starts, t1)
            shown.append((row, list(range(lo, hi))))
        detailed = []
        if detail:
            need = DETAIL_MIN_PX * self.ns_px
            for row, ks in shown:
                starts, ends, items = s.bands[wanted[row][0]].lane_index[wanted[row][1]]  # type: ignore[index]
                if s.bands[wanted[row][0]].kind == "worker":
                    detailed += [items[k] for k in ks if ends[k] - starts[k] >= need]
            s._lay_out(db, detailed)
        laid = set(detailed)
        for row, ks in shown:
            band = s.bands[wanted[row][0]]
            starts, ends, items = band.lane_index[wanted[row][1]]  # type: ignore[index]
            if band.kind == "server":
                self.series(row, 0, 0, ((starts[k], ends[k], "generation", None, items[k][0], items[k][1], band.name)
                                        for k in ks))
                continue
            self.series(row, 0, 0, ((starts[k], ends[k], "rollout", None, items[k], None, None) for k in ks))
            for k in ks:
                i = items[k]
                if i not in laid:
                    continue
                calls = [c for c in s._calls[i] if c[1] > t0 and c[0] < t1]
                for (sub, depth), group in groupby(calls, key=lambda c: (c[2], c[3])):
                    self.series(row, sub, depth, ((c[0], c[1], c[4], c[5], i, c[7], c[6]) for c in group))

    def rollout_table(self) -> dict[str, list[Any]]:
        """The rollouts the slices refer to (``ro``), as columns."""
        s = self.s
        rs = [s.timeline.rollouts[i] for i in self._ros]
        reward = [r.reward if isinstance(r.reward, (int, float)) and math.isfinite(r.reward) else None for r in rs]
        return {"trace_id": [r.trace_id for r in rs], "worker": [r.worker for r in rs], "lane": [r.lane for r in rs],
                "sample_index": [r.sample_index for r in rs], "rollout_n": [r.rollout_n for r in rs],
                "group": [r.group for r in rs], "reward": reward, "verdict": [r.verdict for r in rs],
                "policy_version": [r.policy_version for r in rs],
                "policy_version_end": [r.policy_version_end for r in rs],
                "crossed_update": [r.crossed_update for r in rs], "staleness": [r.staleness for r in rs],
                "t0": [round((r.start_ns - s.origin) / MS, 3) for r in rs],
                "t1": [round((r.end_ns - s.origin) / MS, 3) for r in rs],
                "subrows": [s._subrows.get(i, 1) for i in self._ros]}


def parse_lanes(text: str | None, counts: Sequence[int]) -> list[tuple[int, int]] | None:
    """``lanes=0:0-63,3:5,4:*``: band:first-last lanes (``*``: all of the band's), of bands that
    have ``counts`` lanes each; lanes that do not exist are left out, and past :data:`MAX_LANES`
    one more (the window says it was clipped). None when not given."""
    if text is None:
        return None
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        band, _, rng = part.strip().partition(":")
        if not band.isdigit() or int(band) >= len(counts):
            continue
        b, n = int(band), counts[int(band)]
        lo, _, hi = rng.partition("-")
        if rng == "*":
            first, last = 0, n - 1
        elif lo.isdigit() and (hi.isdigit() or not hi):
            first, last = int(lo), min(int(hi or lo), n - 1)
        else:
            continue
        out += [(b, k) for k in range(first, min(last, first + MAX_LANES) + 1)]
        if len(out) > MAX_LANES:
            break
    return out


def window_json(lanes: StepLanes, db: Any, params: Any, base: str) -> bytes:
    """The JSON of the window the request's parameters ask for (:meth:`StepLanes.window`)."""
    def num(name: str) -> float | None:
        try:
            value = float(params.get(name))
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    wanted = parse_lanes(params.get("lanes"), [b.lanes for b in lanes.bands])
    data = lanes.window(db, num("t0"), num("t1"), int(num("px") or 1400), wanted, int(num("lane_px") or 16),
                        max(0.0, min(64.0, 2.0 if num("min_px") is None else num("min_px"))), base + "/rollout/")
    return _dumps(data)


def encoded(body: bytes, accept_encoding: str) -> tuple[bytes, dict[str, str]]:
    """A window's JSON gzipped when the client takes it (its columns of small numbers shrink
    about fivefold) and it is worth it."""
    if len(body) < 4096 or "gzip" not in accept_encoding.lower():
        return body, {"vary": "accept-encoding"}
    import gzip

    return gzip.compress(body, 4), {"content-encoding": "gzip", "vary": "accept-encoding"}


class SwimlaneCache:
    """The :class:`StepLanes` of the last steps looked at, by (run, validate, step, files): a step's
    new files lay it out again; two requests for one step build it once."""

    def __init__(self, size: int = CACHED_STEPS) -> None:
        self.size = size
        self._items: OrderedDict[Any, StepLanes] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Any, threading.Lock] = {}

    def get(self, key: Any, build: Any) -> StepLanes:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            lock = self._building.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            value = build()
            with self._lock:
                self._items[key] = value
                self._building.pop(key, None)
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
            return value
