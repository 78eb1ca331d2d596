"""Step metrics that explain a step: computed once, in the pipeline, for every sink.

For each (validate, step) the pipeline accumulates the trajectories it exports (in
collector mode: the whole job's), and when the step is done (a trajectory of a later
step of the same stream was exported, or at flush / shutdown) hands one
:class:`~rtrace.trajectory.StepMetrics` to every sink that has
``export_step_metrics`` (trackio logs them at the step, MLflow on the run).

Only trajectories kept by the sample (``kept`` contains ``sampled``, or every one when
there is no cap) are counted, so the figures are those of an unbiased sample: the
extra ones kept for the tail (``error``, ``best``, ``worst``, ``zero_variance``) are
not. Every statistic is a count, a sum, a sum of squares, a min or a max, or the list
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
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from .. import _stats
from ..trajectory import StepMetrics, Trajectory

__all__ = ["StepStats", "StepMetricsTracker", "in_sample"]

_MAX_DURATIONS = 200_000  # per step: exact percentiles up to this many trajectories


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
    time_generation: float = 0.0
    time_tool: float = 0.0
    slowest: tuple[float, str] = (-1.0, "")

    def add(self, traj: Trajectory) -> None:
        self.n += 1
        r = traj.reward
        if isinstance(r, (int, float)) and not isinstance(r, bool):
            if math.isfinite(r):
                self.reward.add(float(r))
                group = traj.group_id if traj.group_id is not None else traj.sample_index
                if group is not None:
                    self.groups.setdefault(str(group), []).append(float(r))
            else:
                self.reward_non_finite += 1
        for key, value in traj.annotations.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.keys.setdefault(key, _Moments()).add(float(value))
        truncated = False
        for span in traj.spans:
            attrs = span.attributes
            if span.kind == "generation":
                self.turns += 1
                self.time_generation += span.duration_ms
                self.tokens_in += _int(attrs.get("gen_ai.usage.input_tokens"))
                self.tokens_out += _int(attrs.get("gen_ai.usage.output_tokens"))
                for reason in attrs.get("gen_ai.response.finish_reasons") or ():
                    self.finish[str(reason)] += 1
                    truncated = truncated or reason == "length"
            elif span.kind == "tool":
                self.tool_calls += 1
                self.time_tool += span.duration_ms
        self.errors += traj.status == "error"
        self.truncated += truncated
        self.partial += traj.partial
        duration = traj.duration_ms
        if len(self.durations) < _MAX_DURATIONS:
            self.durations.append(duration)
        if duration > self.slowest[0]:
            self.slowest = (duration, traj.trace_id)

    def merge(self, o: "StepStats") -> None:
        """Add another worker's statistics of the same step (exact)."""
        self.n += o.n
        self.reward.merge(o.reward)
        self.reward_non_finite += o.reward_non_finite
        for key, m in o.keys.items():
            self.keys.setdefault(key, _Moments()).merge(m)
        for g, rewards in o.groups.items():
            self.groups.setdefault(g, []).extend(rewards)
        for name in ("turns", "tool_calls", "tokens_in", "tokens_out", "errors", "truncated", "partial"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        self.finish.update(o.finish)
        self.durations.extend(o.durations[: max(0, _MAX_DURATIONS - len(self.durations))])
        self.time_generation += o.time_generation
        self.time_tool += o.time_tool
        self.slowest = max(self.slowest, o.slowest)

    def values(self, prefix: str) -> dict[str, float]:
        """The metrics, named ``<prefix>/<name>``."""
        n = self.n
        out: dict[str, float] = {"trajectories": n}
        self.reward.into(out, "reward")
        if self.reward_non_finite:
            out["reward_non_finite"] = self.reward_non_finite
        for key in sorted(self.keys):
            self.keys[key].into(out, key)
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
        return {f"{prefix}/{k}": float(v) for k, v in out.items()}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def step_metrics(validate: bool, step: int, stats: StepStats) -> StepMetrics:
    prefix = "eval" if validate else "rollout"
    return StepMetrics(step=step, validate=validate, values=stats.values(prefix),
                       slowest_trace_id=stats.slowest[1] or None)


class StepMetricsTracker:
    """Accumulates exported trajectories per (validate, step); releases finished steps.

    A step is done once a later step of the same stream (training or validation) has been
    seen and nothing of it arrived for ``linger_s`` (workers run steps out of phase), or
    at flush / shutdown (:meth:`release`).
    """

    def __init__(self, linger_s: float = 0.0) -> None:
        self.linger_s = linger_s
        self._open: dict[tuple[bool, int], StepStats] = {}
        self._seen: dict[tuple[bool, int], float] = {}
        self._last: dict[bool, int] = {}
        self._newest: dict[bool, int] = {}

    def observe(self, trajectories: Iterable[Trajectory], now: float = 0.0) -> list[StepMetrics]:
        """Add exported trajectories; returns the metrics of steps now done."""
        for traj in trajectories:
            step = traj.step
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                continue
            if not in_sample(traj):
                continue  # kept for the tail only: not part of the sample's statistics
            key = (traj.validate, step)
            if step <= self._last.get(traj.validate, -1) and key not in self._open:
                _stats.incr("step_metrics_late_trajectories")
                continue
            self._open.setdefault(key, StepStats()).add(traj)
            self._seen[key] = now
            self._newest[traj.validate] = max(step, self._newest.get(traj.validate, -1))
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
            out.append(step_metrics(validate, step, self._open.pop(key)))
            self._last[validate] = max(step, self._last.get(validate, -1))
        return out
