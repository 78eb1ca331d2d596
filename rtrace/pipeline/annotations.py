"""Annotations: values the trainer attaches to trajectories after (or while) they run.

``rtrace.annotate(step, sample_index, rollout_n, advantage=0.4)`` and
``rtrace.annotate_batch(...)`` produce :class:`Annotation` records keyed by a
trajectory's coordinates ``(validate, step, sample_index, rollout_n)`` (or its trace id).
The worker thread joins them: to a trajectory still held (in the registry's waiting
table, when ``RTRACE_AWAIT_ANNOTATIONS`` names keys it has not got yet), or, when the trajectory has
not finished yet, to a bounded table of pending annotations that the trajectory picks
up when its root arrives. An annotation for a trajectory that was already exported is
counted as ``annotations_late``; one for a sampled-out trajectory as
``annotations_sampled_out`` (both cheap: a bounded table of recent outcomes is kept);
one that matches nothing before ``annotation_timeout_s`` as ``annotations_unmatched``.
A late ``old_logprob`` row is also a trajectory whose ``logprob_mismatch`` check measured
nothing: counted as ``logprob_mismatch_unchecked`` and said once, with what makes
trajectories wait for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

from .. import _stats
from .records import TrajectoryState
from .tokens import TRAINER, TokenRow, merge

__all__ = ["Annotation", "AnnotationTable", "coord_key", "estimated_bytes"]

#: The collector running in this process, if any: rtrace.annotate* hand it their records.
local_target: Callable[[list["Annotation"]], None] | None = None

#: Recent outcomes remembered (exported / sampled out), and pending annotations kept.
#: A trajectory is remembered under its trace id (an int) and its coordinates (a tuple):
#: two entries, ~150 bytes each, so the outcome table holds at most ~30 MB.
_RECENT = 200_000
_PENDING = 200_000


def coord_key(coords: dict[str, Any]) -> Hashable | None:
    """The key annotations are matched by; None without a step and sample index."""
    step, index = coords.get("step"), coords.get("sample_index")
    if step is None or index is None:
        return None
    n = coords.get("rollout_n")
    if type(step) is int and type(index) is int and (type(n) is int or n is None):  # _plain's result, at once
        return (bool(coords.get("validate") or False), step, index, n)
    return (bool(coords.get("validate") or False), _plain(step), _plain(index), _plain(n))


def _plain(value: Any) -> Any:
    cls = type(value)
    if cls is int or cls is str or value is None:
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _plain(item())
        except Exception:
            return repr(value)
    return value if isinstance(value, (float, type(None))) else str(value)


class Annotation:
    """Values for one trajectory, by coordinates or trace id."""

    __slots__ = ("key", "trace_id", "values", "at")

    def __init__(self, key: Hashable | None, trace_id: int | None, values: dict[str, Any]) -> None:
        self.key = key
        self.trace_id = trace_id
        self.values = values
        self.at = time.monotonic()


#: What a queued annotation holds besides its values (the record, its key tuple, its dict),
#: and each value (a float and its dict slot): 448 bytes for two values, measured 432 with
#: tracemalloc (10^5 rows of annotate_batch(advantage=..., reward=...)).
_ROW_BYTES, _VALUE_BYTES = 256, 96


def estimated_bytes(annotations: Sequence[Annotation]) -> int:
    """What ``annotations`` (one ``annotate`` / ``annotate_batch`` call) hold in memory,
    estimated from the first row (a call's rows share their columns) and, for per-token
    columns, the arrays' bytes once (the rows reference one :class:`TokenBatch`). O(1)
    for a call without per-token columns: the trainer's thread pays nothing per row."""
    if not annotations:
        return 0
    first = annotations[0].values
    size = len(annotations) * (_ROW_BYTES + _VALUE_BYTES * len(first))
    batches = {id(v.batch): v.batch for v in first.values() if type(v) is TokenRow}
    for batch in batches.values():
        for column in batch.columns.values():
            nbytes = getattr(column, "nbytes", None)
            size += int(nbytes) if isinstance(nbytes, int) else 8 * sum(len(row) for row in column)
    return size


class AnnotationTable:
    """The worker's side of annotations (worker thread only)."""

    def __init__(self, await_keys: tuple[str, ...], timeout_s: float, await_eval_keys: tuple[str, ...] = (),
                 learn: bool = False) -> None:
        #: keys training trajectories wait for, and validation ones (``validate=True``)
        self.await_keys = await_keys
        #: ``RTRACE_AWAIT_ANNOTATIONS`` unset (and the logprob_mismatch check on): once the
        #: trainer's ``old_logprob`` rows come after their trajectories were written, later
        #: training trajectories wait for them (:meth:`_unchecked`)
        self.learn = learn
        self.await_eval_keys = await_eval_keys
        self.timeout_s = timeout_s
        self._pending: OrderedDict[Hashable, Annotation] = OrderedDict()
        self._recent: OrderedDict[Hashable, str] = OrderedDict()
        #: trajectories whose root arrived, waiting for awaited keys, by key and trace id
        self._waiting: dict[Hashable, TrajectoryState] = {}
        #: waiting trajectories an annotation joined since :meth:`take_touched` (the worker
        #: checks those, not every waiting one)
        self._touched: list[TrajectoryState] = []

    # ------------------------------------------------------------------ outcomes
    def remember(self, key: Hashable | None, trace_id: int, outcome: str) -> None:
        """Remember that a trajectory was ``exported`` or ``sampled_out`` (not kept: the
        selection dropped it, or it was recorded as a summary only; its summary was counted)."""
        for k in (key, trace_id):
            if k is None:
                continue
            self._recent[k] = outcome
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ arrivals
    def add(self, ann: Annotation) -> None:
        """Join an annotation to its trajectory (waiting or later), or count it."""
        k = ann.trace_id if ann.trace_id is not None else ann.key
        state = self._waiting.get(k)
        if state is not None:
            merge(state.annotations, ann.values)
            self._touched.append(state)
            return
        outcome = self._recent.get(k)
        if outcome is not None:
            _stats.incr("annotations_late" if outcome == "exported" else "annotations_sampled_out")
            if outcome == "exported" and TRAINER in ann.values:
                self._unchecked(ann)
            return
        prev = self._pending.get(k)
        if prev is not None:
            merge(prev.values, ann.values)
            return
        self._pending[k] = ann
        if len(self._pending) > _PENDING:
            self._pending.popitem(last=False)
            _stats.incr("annotations_unmatched")

    def _unchecked(self, ann: Annotation) -> None:
        """The trainer's logprobs came after their trajectory was written: its mismatch was
        never measured. Counted, and said once (the check is otherwise off without a word)."""
        _stats.incr("logprob_mismatch_unchecked")
        validate = bool(ann.key[0]) if isinstance(ann.key, tuple) else False
        if self.learn and not validate and TRAINER not in self.await_keys:
            # the run sends old_logprob rows after its trajectories: wait for them from now on
            self.await_keys = self.await_keys + (TRAINER,)
            _stats.incr("logprob_mismatch_await_learned")
            _stats.warn_once("mismatch-learned", "rtrace: the trainer's old_logprob rows came after their trajectories "
                             "were written (the logprob_mismatch check measured nothing); from now on training "
                             "trajectories wait for them, at most RTRACE_ANNOTATION_TIMEOUT_S=%gs (set "
                             "RTRACE_AWAIT_ANNOTATIONS to choose: none never waits)", self.timeout_s)
            return
        keys, var = (self.await_eval_keys, "RTRACE_AWAIT_EVAL_ANNOTATIONS") if validate else (
            self.await_keys, "RTRACE_AWAIT_ANNOTATIONS")
        fix = (f"they came after {self.timeout_s:g} s of waiting (raise RTRACE_ANNOTATION_TIMEOUT_S)" if TRAINER in keys
               else f"make trajectories wait for them: {var}=old_logprob, bounded by RTRACE_ANNOTATION_TIMEOUT_S "
                    "(start_collector(await_annotations=...) for a collector)")
        _stats.warn_once("mismatch-unchecked", "rtrace: the trainer's old_logprob rows arrive after their "
                         "trajectories are written, so the logprob_mismatch check does not measure those trajectories "
                         "(counted in logprob_mismatch_unchecked): %s", fix)

    def arrived(self, state: TrajectoryState) -> None:
        """A trajectory's root arrived: give it its pending annotations."""
        if not self._pending:
            return
        for k in (state.trace_id, coord_key(state.coords)):
            if k is None:
                continue
            ann = self._pending.pop(k, None)
            if ann is not None:
                merge(state.annotations, ann.values)

    def ready(self, state: TrajectoryState, now: float, stopping: bool = False) -> bool:
        """True when ``state`` has every awaited key, or waited long enough, or the pipeline
        is ``stopping`` (it is written now); written without a key, it is counted."""
        keys = self.await_eval_keys if state.coords.get("validate") else self.await_keys
        if not keys:
            return True
        self.arrived(state)  # annotations that came while it was settling
        key = coord_key(state.coords)
        if all(k in state.annotations for k in keys):
            self._forget(state, key)
            return True
        if stopping or (state.root_at is not None and now - state.root_at >= self.timeout_s):
            _stats.incr("trajectories_missing_annotations")
            self._forget(state, key)
            return True
        if key is not None:
            self._waiting[key] = state
        self._waiting[state.trace_id] = state
        return False

    def take_touched(self) -> list[TrajectoryState]:
        """The waiting trajectories annotations joined since the last call (worker thread)."""
        touched, self._touched = self._touched, []
        return touched

    def forget(self, state: TrajectoryState) -> None:
        """``state`` is written before it got every awaited key (the waiting table was
        full): an annotation that comes later no longer joins it."""
        self._forget(state, coord_key(state.coords))

    def _forget(self, state: TrajectoryState, key: Hashable | None) -> None:
        self._waiting.pop(state.trace_id, None)
        if key is not None and self._waiting.get(key) is state:
            del self._waiting[key]

    def expire(self, now: float) -> None:
        """Count and drop pending annotations older than the timeout."""
        limit = max(self.timeout_s, 1.0) * 2
        while self._pending:
            k, ann = next(iter(self._pending.items()))
            if now - ann.at < limit:
                break
            del self._pending[k]
            _stats.incr("annotations_unmatched")

    def pending(self) -> int:
        return len(self._pending)
