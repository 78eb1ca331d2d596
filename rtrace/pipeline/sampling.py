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

import threading
from collections import OrderedDict
from typing import Any

from .. import _stats

__all__ = ["StepSampler"]

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
