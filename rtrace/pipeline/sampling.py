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

__all__ = ["StepSampler", "StepSelector", "PreSampler", "Tail", "priority", "prompt_key", "selector_for"]

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


def prompt_key(coords: dict[str, Any]) -> Any:
    """The prompt a trajectory answers, to follow it across steps: ``prompt_id`` of its extra
    coordinates, else ``group_id``, else ``sample_index`` (the first one set; ``None`` when
    none is). ``sample_prompts`` hashes it, and ``rtrace report`` groups by it."""
    extra = coords.get("extra") or {}
    for value in (extra.get("prompt_id"), coords.get("group_id"), coords.get("sample_index")):
        if value is not None:
            return value
    return None


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


class Tail:
    """What a finished trajectory tells the selector besides its coordinates."""

    __slots__ = ("failed", "value", "reward", "unhealthy", "mismatch")

    def __init__(self, failed: bool, value: float | None, reward: float | None, unhealthy: bool = False,
                 mismatch: float | None = None) -> None:
        #: ended in error or was truncated (a generation stopped by ``length``)
        self.failed = failed
        #: the value best / worst are chosen by (``keep_by``: the reward or an annotation)
        self.value = value
        #: the reward, for zero-variance groups
        self.reward = reward
        #: has a rollout-health finding (pipeline/health.py)
        self.unhealthy = unhealthy
        #: its train-inference logprob mismatch (k3; pipeline/tokens.py), when measured
        self.mismatch = mismatch


class StepSelector:
    """End-of-trajectory selection: the job-wide sample, plus the tail.

    Per (validate, step):

    * **sampled**: the ``cap`` finished trajectories with the lowest :func:`priority`,
      whatever the order they arrive in (a bounded heap; exact and deterministic for a
      seed). ``groups`` keeps GRPO groups whole (exact when ``cap`` is a multiple of the
      group size); ``prompts`` drops the step from the hash, so the same prompts are kept
      at every step where they recur.
    * **error**: up to ``keep_errors`` trajectories that ended in error or were truncated,
      past the cap: chosen among those the sample did not keep (a failed trajectory the
      sample kept is ``sampled`` only);
    * **unhealthy**: up to ``keep_unhealthy`` trajectories with a rollout-health finding,
      past the cap in the same way;
    * **mismatch**: the ``keep_mismatch`` trajectories with the largest train-inference
      logprob mismatch (k3), past the cap in the same way;
    * **best** / **worst**: the ``keep_extremes`` highest and lowest by ``keep_by``;
    * **zero_variance**: up to ``keep_zero_variance`` groups whose rewards are all equal,
      the lowest-ranked such among the ``2 * keep_zero_variance`` groups of lowest rank
      (:meth:`group_priority`; whatever their rewards: the choice does not depend on the order
      rollouts arrive in, and several collectors' choices cut to one collector's).

    Each has its own counter (``trajectories_kept_<reason>``); a trajectory records every
    reason it was kept for. A step is released once a later step of the same stream has
    been seen and nothing of it arrived for ``linger_s``, or at flush / stop; a
    trajectory of a released step is kept while the step's sample has room
    (``trajectories_late_step``). Memory is bounded by what the structures hold.
    """

    def __init__(self, cap: int | None, val_cap: int | None, groups: bool, seed: int, linger_s: float,
                 on_drop: Any = None, keep_errors: int = 0, keep_extremes: int = 0,
                 keep_zero_variance: int = 0, prompts: bool = False, keep_unhealthy: int = 0,
                 keep_mismatch: int = 0, counted: bool = True) -> None:
        #: called with each item sampled out (the collector remembers it for annotations)
        self.on_drop = on_drop or (lambda item: None)
        self.caps = {False: cap, True: val_cap}
        self.groups, self.seed, self.linger_s, self.prompts = groups, seed, linger_s, prompts
        self.keep_errors, self.keep_extremes, self.keep_zero_variance = keep_errors, keep_extremes, keep_zero_variance
        self.keep_unhealthy = keep_unhealthy
        self.keep_mismatch = keep_mismatch
        self._open: dict[tuple[bool, Any], _Step] = {}
        self._released: OrderedDict[tuple[bool, Any], int] = OrderedDict()
        self._latest: dict[bool, Any] = {}
        self._n = 0
        #: count what it keeps and drops in rtrace.stats() (a dataset reader's cut does not)
        self._incr = _stats.incr if counted else _no_count

    def priority(self, coords: dict[str, Any]) -> float:
        if self.prompts:
            prompt = prompt_key(coords)
            coords = {"validate": coords.get("validate"), "step": None, "sample_index": prompt,
                      "group_id": prompt, "rollout_n": coords.get("rollout_n")}
        return priority(coords, self.seed, self.groups or self.prompts)

    def offer(self, coords: dict[str, Any], item: Any, now: float, tail: Tail | None = None,
              prio: float | None = None, sample: bool = True) -> list[Any]:
        """Add a finished trajectory; returns what passes at once (no cap, late step).
        ``prio``: its :meth:`priority` when known (a dataset row's). ``sample`` False: a
        candidate for the tail only (a rollout a worker's pre-sampling left out and sent in
        full after all, or a row a collector did not sample: none is in the step's sample)."""
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
            self._incr("trajectories_late_step")
            if sample and self._released[key] < cap:
                self._released[key] += 1
                return [item]
            self._incr("trajectories_sampled_out")
            self.on_drop(item)
            return []
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = _Step()
        entry.last = now
        self._n += 1
        if prio is None:
            prio = self.priority(coords)
        rank = (-prio, -_plain_num(coords.get("rollout_n")), -self._n)
        uid = self._n
        entry.items[uid] = [item, 0]
        if sample and cap and (len(entry.sample) < cap or rank > entry.sample[0][0]):
            self._push(entry, entry.sample, cap, (rank, uid))
        if tail is not None:
            # The error and unhealthy tails are kept past the cap: up to ``cap`` of their
            # candidates may end in the sample, so each holds ``cap`` more than it keeps.
            if self.keep_errors and tail.failed:
                self._push(entry, entry.errors, self.keep_errors + cap, (rank, uid))
            if self.keep_unhealthy and tail.unhealthy:
                self._push(entry, entry.unhealthy, self.keep_unhealthy + cap, (rank, uid))
            if self.keep_mismatch and tail.mismatch is not None:
                self._push(entry, entry.mismatch, self.keep_mismatch + cap, ((tail.mismatch, rank), uid))
            if self.keep_extremes and tail.value is not None:
                self._push(entry, entry.best, self.keep_extremes, ((tail.value, rank), uid))
                self._push(entry, entry.worst, self.keep_extremes, ((-tail.value, rank), uid))
            if self.keep_zero_variance:
                self._group(entry, coords, tail, prio, uid)
        if entry.items[uid][1] == 0:
            self._drop(entry, uid)
        return []

    # ------------------------------------------------------------------ holding
    def _push(self, entry: "_Step", heap: list, size: int, node: tuple) -> None:
        """Keep the ``size`` largest nodes in ``heap``; holds count references to items."""
        uid = node[1]
        if len(heap) < size:
            heapq.heappush(heap, node)
            entry.items[uid][1] += 1
        elif node[0] > heap[0][0]:
            _, out = heapq.heapreplace(heap, node)
            entry.items[uid][1] += 1
            self._release_ref(entry, out)

    def _release_ref(self, entry: "_Step", uid: int) -> None:
        held = entry.items.get(uid)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            self._drop(entry, uid)

    def _drop(self, entry: "_Step", uid: int) -> None:
        item, _ = entry.items.pop(uid)
        self._incr("trajectories_sampled_out")
        self.on_drop(item)

    def group_priority(self, coords: dict[str, Any]) -> float:
        """A rollout's group's rank (its priority when the sample is by group)."""
        return self.priority(coords) if self.groups or self.prompts else priority(coords, self.seed, True)

    def _group(self, entry: "_Step", coords: dict[str, Any], tail: Tail, prio: float, uid: int) -> None:
        """Zero-variance candidates: the ``2 * keep_zero_variance`` groups of lowest rank seen,
        whatever their rewards (so the set does not depend on the order rollouts arrive in: a
        group pushed out by a lower-ranked one never comes back, and one that breaks keeps its
        place); the members of those whose rewards are all equal so far are held."""
        group = coords.get("group_id", coords.get("sample_index"))
        if group is None or tail.reward is None:
            return
        g = entry.groups.get(group)
        if g is None:
            gprio = prio if self.groups or self.prompts else self.group_priority(coords)
            if len(entry.groups) >= 2 * self.keep_zero_variance:
                worst = max(entry.groups, key=lambda k: entry.groups[k][0])
                if entry.groups[worst][0] <= gprio:
                    return
                self._forget_group(entry, worst)
            g = entry.groups[group] = [gprio, tail.reward, [], False]
        if g[3]:
            return
        if g[1] != tail.reward:  # not zero variance: its members are no longer held for it
            for held in g[2]:
                self._release_ref(entry, held)
            g[2], g[3] = [], True
            return
        g[2].append(uid)
        entry.items[uid][1] += 1

    def _forget_group(self, entry: "_Step", group: Any) -> None:
        g = entry.groups.pop(group, None)
        if g is not None:
            for uid in g[2]:
                self._release_ref(entry, uid)

    # ------------------------------------------------------------------ release
    def release(self, now: float, force: bool) -> list[Any]:
        """The kept trajectories of every step that is done (all of them with ``force``),
        each with ``item.kept`` set to its reasons when it has that attribute."""
        out: list[Any] = []
        for key in list(self._open):
            validate, step = key
            latest = self._latest.get(validate)
            entry = self._open[key]
            later_seen = latest is not None and isinstance(step, (int, float)) and step < latest
            if not (force or (later_seen and now - entry.last >= self.linger_s)):
                continue
            del self._open[key]
            reasons: dict[int, list[str]] = {uid: ["sampled"] for _, uid in entry.sample}
            for name, heap, size in (("error", entry.errors, self.keep_errors),
                                     ("unhealthy", entry.unhealthy, self.keep_unhealthy),
                                     ("mismatch", entry.mismatch, self.keep_mismatch)):
                past = [uid for _, uid in sorted(heap, reverse=True) if "sampled" not in reasons.get(uid, ())]
                for uid in past[:size]:
                    reasons.setdefault(uid, []).append(name)
            for name, heap in (("best", entry.best), ("worst", entry.worst)):
                for _, uid in sorted(heap, reverse=True):
                    reasons.setdefault(uid, []).append(name)
            zero = sorted((g for g in entry.groups.values() if not g[3] and len(g[2]) >= 2), key=lambda g: g[0])
            for g in zero[: self.keep_zero_variance]:
                for uid in g[2]:
                    reasons.setdefault(uid, []).append("zero_variance")
            for uid, (item, _) in entry.items.items():
                why = reasons.get(uid)
                if why is None:
                    self._incr("trajectories_sampled_out")
                    self.on_drop(item)
                    continue
                for reason in why:
                    self._incr(f"trajectories_kept_{reason}")
                if hasattr(item, "kept"):
                    item.kept = why
                out.append(item)
            self._released[key] = len(entry.sample)
            if len(self._released) > _STEPS_KEPT * 4:
                self._released.popitem(last=False)
        return out

    def held(self) -> int:
        return sum(len(e.items) for e in self._open.values())


class _Step:
    """What the selector holds for one (validate, step)."""

    __slots__ = ("sample", "errors", "unhealthy", "mismatch", "best", "worst", "groups", "items", "last")

    def __init__(self) -> None:
        self.sample: list = []
        self.errors: list = []
        self.unhealthy: list = []
        self.mismatch: list = []
        self.best: list = []
        self.worst: list = []
        #: zero-variance candidates: group -> [priority, reward, [uids]]
        self.groups: dict[Any, list] = {}
        #: uid -> [item, references held]
        self.items: dict[int, list] = {}
        self.last = 0.0


def _no_count(name: str, n: int = 1) -> None:
    pass


def selector_for(settings: Any, linger_s: float, on_drop: Any = None) -> StepSelector:
    """The :class:`StepSelector` the settings ask for."""
    return StepSelector(settings.max_traces_per_step, settings.val_cap, settings.sample_groups, settings.sample_seed,
                        linger_s, on_drop=on_drop, keep_errors=settings.keep_errors,
                        keep_extremes=settings.keep_extremes, keep_zero_variance=settings.keep_zero_variance_groups,
                        prompts=settings.sample_prompts,
                        keep_unhealthy=settings.keep_unhealthy if settings.health_checks else 0,
                        keep_mismatch=settings.keep_mismatch if "logprob_mismatch" in settings.health_checks else 0)


def _plain_num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
