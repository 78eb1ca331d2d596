"""Per-step sampling, decided once per trajectory when it starts.

``max_traces_per_step`` caps the trajectories kept per RL step across the whole process
(every call site, every group, every task share one counter per step); validation
trajectories have their own counters (``max_val_traces_per_step``, default the same
cap). Deciding at the start, not at the end, means a sampled-out trajectory costs no
span, no capture and no export, and the kept ones are not biased towards the rollouts
that finish first. Every sink sees the same decisions because there is only one.

With ``sample_groups`` the decision is made per GRPO group (same step and ``group_id``,
else ``sample_index``): a group is admitted while the step has kept fewer than the cap,
and then all its members are kept, so a step may go over the cap by less than one
group.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections import OrderedDict
from typing import Any

from .. import _stats

__all__ = ["StepSampler", "StepSelector", "PreSampler", "priority"]

#: Steps whose counters are kept; older ones are forgotten (bounded memory).
_STEPS_KEPT = 64


class StepSampler:
    """Admits trajectories under the per-step caps. Thread-safe; O(1) per decision."""

    def __init__(self, cap: int | None, val_cap: int | None, sample_groups: bool = False) -> None:
        self.cap = cap
        self.val_cap = val_cap
        self.sample_groups = sample_groups
        self._lock = threading.Lock()
        # (validate, step) -> [kept count, {group key: admitted}]
        self._steps: OrderedDict[tuple[bool, Any], list] = OrderedDict()

    def admit(self, coords: dict[str, Any]) -> bool:
        """True when the trajectory with these coordinates is kept."""
        validate = bool(coords.get("validate", False))
        cap = self.val_cap if validate else self.cap
        if cap is None:
            _stats.incr("trajectories_started")
            return True
        key = (validate, coords.get("step"))
        with self._lock:
            entry = self._steps.get(key)
            if entry is None:
                entry = self._steps[key] = [0, {}]
                if len(self._steps) > _STEPS_KEPT:
                    self._steps.popitem(last=False)
            group = coords.get("group_id", coords.get("sample_index")) if self.sample_groups else None
            if group is not None:
                admitted = entry[1].get(group)
                if admitted is None:
                    admitted = entry[1][group] = entry[0] < cap
            else:
                admitted = entry[0] < cap
            if admitted:
                entry[0] += 1
        _stats.incr("trajectories_started" if admitted else "trajectories_sampled_out")
        return admitted


# ----------------------------------------------------------------------------- job-wide
def priority(coords: dict[str, Any], seed: int, groups: bool) -> float:
    """A deterministic number in [0, 1) for a trajectory: the job-wide sample keeps the
    lowest ones, and worker-side pre-sampling keeps those below its rate. With
    ``groups`` it depends on the group only (``group_id``, else ``sample_index``), so a
    GRPO group is kept or dropped whole."""
    group = coords.get("group_id", coords.get("sample_index")) if groups else coords.get("sample_index")
    key = f"{seed}|{bool(coords.get('validate'))}|{coords.get('step')}|{group}"
    if not groups:
        key += f"|{coords.get('rollout_n')}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class PreSampler:
    """Collector mode, in a worker: records a trajectory when its :func:`priority` is
    below ``rate`` (1.0: every trajectory; the collector then applies the job-wide cap)."""

    def __init__(self, rate: float, seed: int, groups: bool) -> None:
        self.rate, self.seed, self.groups = rate, seed, groups

    def admit(self, coords: dict[str, Any]) -> bool:
        admitted = self.rate >= 1.0 or priority(coords, self.seed, self.groups) < self.rate
        _stats.incr("trajectories_started" if admitted else "trajectories_sampled_out")
        return admitted


class StepSelector:
    """The collector's job-wide cap: per (validate, step), the ``cap`` finished
    trajectories with the lowest :func:`priority`, whatever the order they arrive in.

    Candidates wait in a bounded heap per step (at most ``cap`` each). A step is released
    (its kept trajectories go to the sinks) once a later step has been seen and nothing
    of this step arrived for ``linger_s``, or at flush / stop. A trajectory of a step
    released already is kept while the step has kept fewer than ``cap``
    (``trajectories_late_step``). Without a cap, trajectories pass at once.
    """

    def __init__(self, cap: int | None, val_cap: int | None, groups: bool, seed: int, linger_s: float,
                 on_drop: Any = None) -> None:
        #: called with each item sampled out (the collector remembers it for annotations)
        self.on_drop = on_drop or (lambda item: None)
        self.caps = {False: cap, True: val_cap}
        self.groups, self.seed, self.linger_s = groups, seed, linger_s
        # (validate, step) -> [heap of (-priority, tiebreak, item), last arrival, kept so far]
        self._open: dict[tuple[bool, Any], list] = {}
        self._released: OrderedDict[tuple[bool, Any], int] = OrderedDict()
        self._latest: dict[bool, Any] = {}
        self._n = 0

    def offer(self, coords: dict[str, Any], item: Any, now: float) -> list[Any]:
        """Add a finished trajectory; returns what passes at once (no cap, late step)."""
        validate = bool(coords.get("validate"))
        cap = self.caps[validate]
        if cap is None:
            return [item]
        step = coords.get("step")
        key = (validate, step)
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            latest = self._latest.get(validate)
            if latest is None or step > latest:
                self._latest[validate] = step
        if key in self._released:
            _stats.incr("trajectories_late_step")
            if self._released[key] < cap:
                self._released[key] += 1
                return [item]
            _stats.incr("trajectories_sampled_out")
            self.on_drop(item)
            return []
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = [[], now]
        entry[1] = now
        heap = entry[0]
        self._n += 1
        rank = (-priority(coords, self.seed, self.groups), -_plain_num(coords.get("rollout_n")), -self._n)
        if len(heap) < cap:
            heapq.heappush(heap, (rank, item))
        elif cap and rank > heap[0][0]:
            _, evicted = heapq.heapreplace(heap, (rank, item))
            _stats.incr("trajectories_sampled_out")
            self.on_drop(evicted)
        else:
            _stats.incr("trajectories_sampled_out")
            self.on_drop(item)
        return []

    def release(self, now: float, force: bool) -> list[Any]:
        """The kept trajectories of every step that is done (all of them with ``force``)."""
        out: list[Any] = []
        for key in list(self._open):
            validate, step = key
            latest = self._latest.get(validate)
            heap, last = self._open[key]
            later_seen = latest is not None and isinstance(step, (int, float)) and step < latest
            if force or (later_seen and now - last >= self.linger_s):
                del self._open[key]
                kept = sorted(heap, reverse=True)  # lowest priority first
                out.extend(item for _, item in kept)
                self._released[key] = len(kept)
                if len(self._released) > _STEPS_KEPT * 4:
                    self._released.popitem(last=False)
        return out

    def held(self) -> int:
        return sum(len(h) for h, _ in self._open.values())


def _plain_num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
