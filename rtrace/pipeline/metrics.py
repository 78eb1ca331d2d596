"""Step metrics that explain a step: computed once, in the pipeline, for every sink.

For each (validate, step) the pipeline accumulates the trajectories it exports (in
collector mode: the whole job's), and when the step is done (a trajectory of a later
step of the same stream was exported, or at flush / shutdown) hands one
:class:`~rtrace.trajectory.StepMetrics` to every sink that has
``export_step_metrics`` (trackio logs them at the step, MLflow on the run).

Every rollout is counted, kept or not, once: each finished rollout leaves a
:class:`~rtrace.summary.RolloutSummary` (the ones the sample drops, and the ones sampled out
when they started, which were recorded as summaries only), and the statistics are those
of all of them, not of a sample (:meth:`StepMetricsTracker.count`). With
``RTRACE_SUMMARIES=0`` a sampled-out rollout leaves nothing, and only the trajectories kept
by the sample (``kept`` contains ``sampled``, or every one when there is no cap) are
counted: the extra ones kept for the tail (``error``, ``best``, ``worst``,
``zero_variance``) are not, so the figures are an unbiased sample's. Every statistic is a count, a sum, a sum of squares, a min or a max, or the list
of trajectory durations, so the metrics of several workers merge exactly
(count-weighted, as AReaL's stats_tracker does); :meth:`StepStats.merge` does it.

Names (after the ``rollout/`` or ``eval/`` prefix; stable, documented in docs/metrics.md):
``trajectories``; ``reward_mean`` / ``_std`` / ``_min`` / ``_max`` and ``reward_non_finite``;
the same four for every numeric annotation (``advantage_mean`` ...);
``zero_variance_groups_frac`` (groups of 2 or more whose rewards are all equal);
``turns_mean``, ``tool_calls_mean``, ``tokens_in_mean``, ``tokens_out_mean``;
``finish_reason/<reason>_frac``; ``error_rate``, ``truncated_rate`` (a generation stopped
by ``length``), ``partial_rate``; ``latency_ms_mean`` / ``_p50`` / ``_p90`` / ``_max``;
``time_generation_frac`` / ``time_tool_frac`` / ``time_other_frac``; and, not a number,
``slowest_trace_id``.

Each step also gets its **rollouts table** (``StepMetrics.rows``): one row per exported
trajectory of the step, the sample and the tail alike, ordered by group then rollout so
a GRPO group reads side by side (columns :data:`TABLE_COLUMNS`, then one per numeric
annotation), bounded by ``step_table_rows``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .. import _stats
from .._serialize import truncate
from ..summary import RolloutSummary, summarize
from ..trajectory import StepMetrics, Trajectory

__all__ = ["StepStats", "StepMetricsTracker", "TABLE_COLUMNS", "table_row", "in_sample", "STALENESS_BUCKETS",
           "staleness_bucket", "inflight_peak", "inflight_peak_sorted"]

_MAX_DURATIONS = 200_000  # per step: exact percentiles up to this many trajectories

#: The rollouts table's columns, in order; each numeric annotation (``advantage`` ...)
#: follows ``reward`` as a column of its own. ``outcome`` is the trajectory's verdict
#: (``correct``, ``wrong``, ``truncated``, ``error``, ``partial``, ``ok``); ``note`` marks
#: the step's slowest trajectory; ``prompt`` is the task (the first user message, else the
#: first message) and ``answer`` the final answer, each at most :data:`ANSWER_CHARS`
#: characters. Annotation values are rounded to :data:`TABLE_DIGITS` significant digits
#: (an advantage of -0.7071067811865476 reads -0.7071).
TABLE_COLUMNS = ("step", "group", "sample_index", "rollout_n", "reward", "outcome", "health", "prompt", "answer",
                 "turns", "tool_calls", "tokens_in", "tokens_out", "finish_reason", "latency_ms", "kept", "note",
                 "trace_id")
ANSWER_CHARS = 300
TABLE_DIGITS = 4


def table_row(traj: Trajectory) -> dict[str, Any]:
    """One trajectory as a row of its step's rollouts table (annotations as extra keys)."""
    tokens_in = tokens_out = 0
    for span in traj.spans:
        if span.kind == "generation":
            tokens_in += _int(span.attributes.get("gen_ai.usage.input_tokens"))
            tokens_out += _int(span.attributes.get("gen_ai.usage.output_tokens"))
    final = traj.final_answer()
    answer = final.get("content") if final is not None else None
    task = traj.task_messages()
    prompt = task[-1].get("content") if task and isinstance(task[-1], dict) else None
    row: dict[str, Any] = {
        "step": traj.step, "group": traj.group_id if traj.group_id is not None else traj.sample_index,
        "sample_index": traj.sample_index, "rollout_n": traj.rollout_n, "reward": traj.reward,
        "outcome": traj.verdict(),
        "health": ",".join(sorted({f["check"] for f in traj.health})) if traj.health else "",
        "turns": traj.num_turns, "tool_calls": traj.num_tool_calls,
        "tokens_in": tokens_in, "tokens_out": tokens_out, "finish_reason": traj.finish_reason,
        "latency_ms": round(traj.duration_ms, 1), "kept": ",".join(traj.kept), "note": "",
        "trace_id": traj.trace_id,
        "prompt": truncate(prompt, ANSWER_CHARS) if isinstance(prompt, str) else None,
        "answer": truncate(answer, ANSWER_CHARS) if isinstance(answer, str) else None,
    }
    for key, value in traj.annotations.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in row:
            row[key] = _short(value)
    return row


def _short(value: float) -> float:
    """A float with :data:`TABLE_DIGITS` significant digits (ints and non-finite values as they are)."""
    return float(f"{value:.{TABLE_DIGITS}g}") if isinstance(value, float) and math.isfinite(value) else value


def _table(rows: list[dict[str, Any]], left_out: int, slowest: str,
           odd: tuple[int | None, dict[str, int]] = (None, {})) -> list[dict[str, Any]]:
    """The rows ordered by group then rollout, each with every column (None where a row
    has no value: trackio and MLflow tables want rectangular data); the slowest and the
    members of groups of an odd size noted."""
    extra = sorted({k for r in rows for k in r} - set(TABLE_COLUMNS))
    order = list(TABLE_COLUMNS[:5]) + extra + list(TABLE_COLUMNS[5:])
    rows = sorted(rows, key=lambda r: (_natural(r["group"]), _sortable(r["rollout_n"]), r["trace_id"]))
    usual, odd_groups = odd
    out = []
    for r in rows:
        notes = ["slowest"] if r["trace_id"] == slowest else []
        size = odd_groups.get(str(r["group"]))
        if size is not None:
            notes.append(f"group of {size} (usual {usual})")
        r["note"] = "; ".join(notes)
        out.append({k: r.get(k) for k in order})
    if left_out:
        rows_word = "row" if left_out == 1 else "rows"
        out.append({k: None for k in order} | {"note": f"{left_out} more {rows_word} left out (step_table_rows)"})
    return out


def _natural(value: Any) -> tuple:
    """A group id's sort key: numbers by value, and the digit runs of a text too
    (``prompt-2`` before ``prompt-10``), as the report page orders them."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ((0, value, ""),)
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", str(value)) if part)


def _sortable(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def in_sample(traj: Trajectory) -> bool:
    """Counted by the step metrics: kept by the step's sample (``kept`` contains
    ``sampled``), or kept with no cap (``kept`` empty); not kept for the tail only."""
    return not traj.kept or "sampled" in traj.kept


@dataclass
class _Moments:
    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self.squares += x * x
        self.low = min(self.low, x)
        self.high = max(self.high, x)

    def merge(self, o: "_Moments") -> None:
        self.n += o.n
        self.total += o.total
        self.squares += o.squares
        self.low = min(self.low, o.low)
        self.high = max(self.high, o.high)

    def into(self, out: dict[str, float], name: str) -> None:
        if not self.n:
            return
        mean = self.total / self.n
        out[f"{name}_mean"] = mean
        out[f"{name}_std"] = math.sqrt(max(0.0, self.squares / self.n - mean * mean))
        out[f"{name}_min"] = self.low
        out[f"{name}_max"] = self.high


@dataclass
class StepStats:
    """The mergeable statistics of one (validate, step)."""

    n: int = 0
    reward: _Moments = field(default_factory=_Moments)
    reward_non_finite: int = 0
    keys: dict[str, _Moments] = field(default_factory=dict)
    groups: dict[Any, list[float]] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    finish: Counter = field(default_factory=Counter)
    errors: int = 0
    truncated: int = 0
    partial: int = 0
    durations: list[float] = field(default_factory=list)
    #: the per-rollout train-inference mismatch values (pipeline/tokens.py), for their p90
    mismatch: dict[str, list[float]] = field(default_factory=dict)
    time_generation: float = 0.0
    time_tool: float = 0.0
    slowest: tuple[float, str] = (-1.0, "")
    #: rollout health: trajectories checked, and per check those with a finding
    checked: int = 0
    health: Counter = field(default_factory=Counter)
    #: trajectories per group, and those of each group already flagged ``coordinates``
    group_sizes: Counter = field(default_factory=Counter)
    group_flagged: Counter = field(default_factory=Counter)
    #: the fleet in time (docs/timeline.md): step - policy_version, rollouts and passes per
    #: staleness bucket, rollouts that crossed a weight update (of those that know), time in
    #: neither generation nor tool, (start, end) of each rollout, generation time per server
    staleness: _Moments = field(default_factory=_Moments)
    stale_rollouts: Counter = field(default_factory=Counter)
    stale_judged: Counter = field(default_factory=Counter)
    stale_passed: Counter = field(default_factory=Counter)
    crossed: int = 0
    crossed_known: int = 0
    time_wait: float = 0.0
    spans: list[tuple[int, int]] = field(default_factory=list)
    server_ms: Counter = field(default_factory=Counter)

    def add(self, item: RolloutSummary | Trajectory) -> None:
        """Count one rollout: its summary (a trajectory is summarized first)."""
        s = item if type(item) is RolloutSummary else summarize(item)
        self.n += 1
        r = s.reward
        group = s.group_id if s.group_id is not None else s.sample_index
        if isinstance(r, (int, float)) and not isinstance(r, bool):
            if math.isfinite(r):
                self.reward.add(float(r))
                if group is not None:
                    self.groups.setdefault(str(group), []).append(float(r))
            else:
                self.reward_non_finite += 1
        for key, value in s.annotations.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.keys.setdefault(key, _Moments()).add(float(value))
                if key.startswith("logprob_mismatch_"):
                    values = self.mismatch.setdefault(key, [])
                    if len(values) < _MAX_DURATIONS:
                        values.append(float(value))
        self.turns += s.turns
        self.tool_calls += s.tool_calls
        self.tokens_in += s.tokens_in
        self.tokens_out += s.tokens_out
        self.time_generation += s.generation_ms
        self.time_tool += s.tool_ms
        if s.finish_reasons:
            self.finish.update(s.finish_reasons)
        self.errors += s.status == "error"
        self.truncated += s.truncated
        if group is not None:
            self.group_sizes[str(group)] += 1
        if s.health is not None:
            self.checked += 1
            failed = {f["check"] for f in s.health}
            self.health.update(failed)
            if group is not None and "coordinates" in failed:
                self.group_flagged[str(group)] += 1
        self.partial += s.partial
        self._fleet(s)
        duration = s.duration_ms
        if len(self.durations) < _MAX_DURATIONS:
            self.durations.append(duration)
        if duration > self.slowest[0]:
            self.slowest = (duration, s.trace_id)

    def _fleet(self, s: RolloutSummary) -> None:
        step, version = s.step, s.policy_version
        if type(step) is int and type(version) is int:
            stale = step - version
            self.staleness.add(float(stale))
            bucket = staleness_bucket(stale)
            self.stale_rollouts[bucket] += 1
            passed = _passed(s)
            if passed is not None:
                self.stale_judged[bucket] += 1
                self.stale_passed[bucket] += passed
        if s.crossed_update is not None:
            self.crossed_known += 1
            self.crossed += bool(s.crossed_update)
        self.time_wait += s.wait_ms
        if len(self.spans) < _MAX_DURATIONS:
            self.spans.append((s.start_ns, s.end_ns))
        if s.server_ms:
            self.server_ms.update(s.server_ms)

    def merge(self, o: "StepStats") -> None:
        """Add another worker's statistics of the same step (exact)."""
        self.n += o.n
        self.reward.merge(o.reward)
        self.reward_non_finite += o.reward_non_finite
        for key, m in o.keys.items():
            self.keys.setdefault(key, _Moments()).merge(m)
        for g, rewards in o.groups.items():
            self.groups.setdefault(g, []).extend(rewards)
        for key, values in o.mismatch.items():
            mine = self.mismatch.setdefault(key, [])
            mine.extend(values[: max(0, _MAX_DURATIONS - len(mine))])
        for name in ("turns", "tool_calls", "tokens_in", "tokens_out", "errors", "truncated", "partial"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        self.finish.update(o.finish)
        self.durations.extend(o.durations[: max(0, _MAX_DURATIONS - len(self.durations))])
        self.time_generation += o.time_generation
        self.time_tool += o.time_tool
        self.slowest = max(self.slowest, o.slowest)
        self.checked += o.checked
        self.health.update(o.health)
        self.group_sizes.update(o.group_sizes)
        self.group_flagged.update(o.group_flagged)
        self.staleness.merge(o.staleness)
        for mine, theirs in ((self.stale_rollouts, o.stale_rollouts), (self.stale_judged, o.stale_judged),
                             (self.stale_passed, o.stale_passed), (self.server_ms, o.server_ms)):
            mine.update(theirs)
        self.crossed += o.crossed
        self.crossed_known += o.crossed_known
        self.time_wait += o.time_wait
        self.spans.extend(o.spans[: max(0, _MAX_DURATIONS - len(self.spans))])

    def odd_groups(self) -> tuple[int | None, dict[str, int]]:
        """The step's usual group size (the most common; the larger on a tie) and the groups
        of another size; (None, {}) with fewer than 3 groups (no usual size to speak of)."""
        if len(self.group_sizes) < 3:
            return None, {}
        counts = Counter(self.group_sizes.values())
        usual = max(counts, key=lambda size: (counts[size], size))
        return usual, {g: n for g, n in self.group_sizes.items() if n != usual}

    def values(self, prefix: str, checks: tuple[str, ...] = (), whole_groups: bool = False) -> dict[str, float]:
        """The metrics, named ``<prefix>/<name>``; ``health/<check>_rate`` for each of
        ``checks`` (share of the checked trajectories with a finding of it), where
        ``coordinates`` also counts the members of groups of an odd size when
        ``whole_groups`` says every group is complete (no cap, or whole groups sampled)."""
        n = self.n
        out: dict[str, float] = {"trajectories": n}
        self.reward.into(out, "reward")
        if self.reward_non_finite:
            out["reward_non_finite"] = self.reward_non_finite
        for key in sorted(self.keys):
            self.keys[key].into(out, key)
            if key in self.mismatch:
                out[f"{key}_p90"] = _percentile(sorted(self.mismatch[key]), 0.9)
        multi = [rs for rs in self.groups.values() if len(rs) >= 2]
        if multi:
            out["zero_variance_groups_frac"] = sum(1 for rs in multi if max(rs) == min(rs)) / len(multi)
        if n:
            out["turns_mean"] = self.turns / n
            out["tool_calls_mean"] = self.tool_calls / n
            out["tokens_in_mean"] = self.tokens_in / n
            out["tokens_out_mean"] = self.tokens_out / n
            out["error_rate"] = self.errors / n
            out["truncated_rate"] = self.truncated / n
            out["partial_rate"] = self.partial / n
        finished = sum(self.finish.values())
        for reason, count in sorted(self.finish.items()):
            out[f"finish_reason/{reason}_frac"] = count / finished
        if self.durations:
            d = sorted(self.durations)
            out["latency_ms_mean"] = sum(d) / len(d)
            out["latency_ms_p50"] = _percentile(d, 0.5)
            out["latency_ms_p90"] = _percentile(d, 0.9)
            out["latency_ms_max"] = d[-1]
            total = sum(d)
            if total > 0:
                gen, tool = min(self.time_generation, total), min(self.time_tool, total)
                out["time_generation_frac"] = gen / total
                out["time_tool_frac"] = min(tool, total - gen) / total
                out["time_other_frac"] = max(0.0, total - gen - tool) / total
        self._fleet_values(out)
        if self.checked:
            for check in checks:
                count = self.health[check]
                if check == "coordinates" and whole_groups:
                    _, odd = self.odd_groups()
                    count += sum(size - self.group_flagged[g] for g, size in odd.items())
                out[f"health/{check}_rate"] = count / self.checked
        return {f"{prefix}/{k}": float(v) for k, v in out.items()}


    def _fleet_values(self, out: dict[str, float]) -> None:
        """The fleet-in-time metrics (docs/metrics.md, "Staleness, waiting and the fleet")."""
        n = self.n
        if self.staleness.n:
            m = self.staleness
            out["staleness_mean"] = m.total / m.n
            out["staleness_max"] = m.high
            for bucket in STALENESS_BUCKETS:
                out[f"staleness/{bucket}_frac"] = self.stale_rollouts[bucket] / m.n
                if self.stale_judged[bucket]:
                    out[f"staleness/{bucket}_pass_rate"] = self.stale_passed[bucket] / self.stale_judged[bucket]
        if self.crossed_known:
            out["crossed_update_rate"] = self.crossed / self.crossed_known
        if n:
            out["generation_ms_mean"] = self.time_generation / n
            out["tool_ms_mean"] = self.time_tool / n
            out["wait_ms_mean"] = self.time_wait / n
        if self.spans:
            out["inflight_peak"] = inflight_peak(self.spans)
        total = sum(self.server_ms.values())
        if total > 0:
            out["servers"] = len(self.server_ms)
            out["slowest_server_share"] = max(self.server_ms.values()) / total


#: The staleness histogram's buckets (``staleness/<bucket>_frac``): step - policy_version of
#: 0 (or less: a version ahead of the step), 1, 2, 3, and 4 or more.
STALENESS_BUCKETS = ("0", "1", "2", "3", "4plus")


def staleness_bucket(stale: int) -> str:
    """The :data:`STALENESS_BUCKETS` name of a rollout's ``step - policy_version``."""
    return STALENESS_BUCKETS[min(4, max(0, stale))]


def _passed(s: RolloutSummary) -> bool | None:
    """Did the rollout pass: its outcome's ``correct`` when it says, else a finite reward > 0;
    None when neither is known."""
    correct = s.outcome.get("correct")
    if isinstance(correct, bool):
        return correct
    r = s.reward
    if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r):
        return r > 0
    return None


def inflight_peak(spans: Iterable[tuple[int, int]]) -> int:
    """The most of ``(start, end)`` intervals open at once (an interval is open from its start
    to before its end: one that ends as another starts does not overlap it)."""
    spans = list(spans)
    return inflight_peak_sorted(sorted(s for s, _ in spans), sorted(e for _, e in spans))


def inflight_peak_sorted(starts: Sequence[int], ends: Sequence[int]) -> int:
    """:func:`inflight_peak` of intervals given as their starts and their ends, each sorted."""
    peak = closed = 0
    n = len(ends)
    for opened, s in enumerate(starts, 1):
        while closed < n and ends[closed] <= s:
            closed += 1
        peak = max(peak, opened - closed)
    return peak


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def step_metrics(validate: bool, step: int, stats: StepStats, rows: list[dict[str, Any]] | None = None,
                 left_out: int = 0, checks: tuple[str, ...] = (), whole_groups: bool = False) -> StepMetrics:
    prefix = "eval" if validate else "rollout"
    slowest = stats.slowest[1] or None
    odd = stats.odd_groups() if whole_groups and "coordinates" in checks else (None, {})
    return StepMetrics(step=step, validate=validate, values=stats.values(prefix, checks, whole_groups),
                       slowest_trace_id=slowest, rows=_table(rows or [], left_out, slowest or "", odd))


class StepMetricsTracker:
    """Accumulates exported trajectories per (validate, step); releases finished steps.

    A step is done once a later step of the same stream (training or validation) has been
    seen and nothing of it arrived for ``linger_s`` (workers run steps out of phase), or
    at flush / shutdown (:meth:`release`).
    """

    def __init__(self, linger_s: float = 0.0, table_rows: int = 0, checks: tuple[str, ...] = (),
                 whole_groups: bool = False, every_rollout: bool = False) -> None:
        self.linger_s = linger_s
        #: rows kept per step's rollouts table (0: none)
        self.table_rows = table_rows
        #: the enabled health checks (a rate each), and whether every group is exported
        #: whole (no cap, or whole groups sampled): only then are odd group sizes reported
        self.checks = checks
        self.whole_groups = whole_groups
        #: the statistics count every rollout, from its summary (:meth:`count`); the
        #: trajectories :meth:`observe` gets then fill the rollouts table only. Else they
        #: count the sample's exported trajectories (``RTRACE_SUMMARIES=0``)
        self.every_rollout = every_rollout
        self._open: dict[tuple[bool, int], StepStats] = {}
        #: (validate, step) -> [rows, rows left out]
        self._rows: dict[tuple[bool, int], list] = {}
        self._seen: dict[tuple[bool, int], float] = {}
        self._last: dict[bool, int] = {}
        self._newest: dict[bool, int] = {}

    def _key(self, validate: bool, step: Any) -> tuple[bool, int] | None:
        """The open step a rollout of (validate, step) is counted in; None for no step, or
        a step already released (counted late)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return None
        key = (validate, step)
        if step <= self._last.get(validate, -1) and key not in self._open:
            _stats.incr("step_metrics_late_trajectories")
            return None
        return key

    def _add(self, key: tuple[bool, int], item: Any, now: float) -> None:
        stats = self._open.get(key)
        if stats is None:
            stats = self._open[key] = StepStats()
        stats.add(item)
        self._seen[key] = now
        self._newest[key[0]] = max(key[1], self._newest.get(key[0], -1))

    def observe(self, trajectories: Iterable[Trajectory], now: float = 0.0) -> list[StepMetrics]:
        """Add exported trajectories (their rows; their statistics too unless
        ``every_rollout``); returns the metrics of steps now done."""
        for traj in trajectories:
            key = self._key(traj.validate, traj.step)
            if key is None:
                continue
            self._open.setdefault(key, StepStats())
            if self.table_rows:  # the table shows every exported trajectory, tail included
                rows = self._rows.setdefault(key, [[], 0])
                if len(rows[0]) < self.table_rows:
                    rows[0].append(table_row(traj))
                else:
                    rows[1] += 1
            if self.every_rollout:
                self._seen[key] = now
                continue
            if not in_sample(traj):
                continue  # kept for the tail only: not part of the sample's statistics
            self._add(key, traj, now)
        return self.due(now)

    def count(self, summaries: Iterable[RolloutSummary], now: float = 0.0) -> list[StepMetrics]:
        """Count rollouts by their summaries (``every_rollout``: each rollout once, kept or
        not); returns the metrics of steps now done."""
        for summary in summaries:
            key = self._key(summary.validate, summary.step)
            if key is not None:
                self._add(key, summary, now)
        return self.due(now)

    def due(self, now: float) -> list[StepMetrics]:
        """The metrics of steps that are done by now (see the class docstring)."""
        return self.release(lambda v, s: s < self._newest.get(v, -1)
                            and now - self._seen.get((v, s), now) >= self.linger_s)

    def release(self, done: Any = None) -> list[StepMetrics]:
        """Metrics of the steps ``done(validate, step)`` says are finished (all by default)."""
        out = []
        for key in sorted(k for k in self._open if done is None or done(*k)):
            validate, step = key
            self._seen.pop(key, None)
            rows, left_out = self._rows.pop(key, ([], 0))
            out.append(step_metrics(validate, step, self._open.pop(key), rows, left_out, self.checks,
                                    self.whole_groups))
            self._last[validate] = max(step, self._last.get(validate, -1))
        return out
