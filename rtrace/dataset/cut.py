"""Several collectors' per-step samples, cut to the one-collector sample.

With N collectors each keeps, per step, what one selector keeps of the GRPO groups it owns:
the ``cap`` rollouts of lowest ``priority`` (the sample), and its tail (errors, unhealthy,
best / worst, zero-variance groups). Every one of those choices is a "lowest k by a key
computed from the rollout alone", and the lowest k of a union is among the union of each
part's lowest k: so the rows the collectors kept hold the one-collector answer, and running
the same selection (:class:`~rtrace.pipeline.sampling.StepSelector`: one sampler) over them
gives it exactly. A failed rollout one collector kept for its sample but the cut leaves out
is an error candidate again, as in one collector (the tail is chosen among the rollouts the
sample does not keep).

The reader (:class:`~rtrace.dataset.reader.Run`) runs the cut for the steps written by more
than one writer, with the selection settings the writers recorded in each file
(:data:`~rtrace.dataset.schema.SELECTION_KEY`), and shows its result: a row the cut leaves out
reads as a rollout counted by its summary only (``kept`` empty, ``recorded`` false) and its
spans leave the ``spans`` view. Rows of a run whose sample was not chosen by rank (one process
without tail keeping: ``priority`` NULL) are never cut.
"""

from __future__ import annotations

import math
from typing import Any

from ..pipeline.sampling import StepSelector, Tail

__all__ = ["cut_step", "CANDIDATE_SQL", "GROUPS_SQL"]

#: the columns the cut reads, of the rows the writers kept (``{where}``: the steps to cut)
CANDIDATE_SQL = (
    "SELECT validate, step, trace_id, sample_index, rollout_n, group_id, priority, kept, status, truncated, "
    "partial, reward, len(health) > 0 AS unhealthy, annotations_double FROM {source} WHERE priority IS NOT NULL "
    "AND len(kept) > 0 AND ({where}) ORDER BY trace_id")


#: every group of a step, one row each (the zero-variance tail ranks them all)
GROUPS_SQL = ("SELECT any_value(validate) AS validate, any_value(step) AS step, any_value(sample_index) AS sample_index, "
              "any_value(rollout_n) AS rollout_n, group_id FROM {source} WHERE ({where}) "
              "GROUP BY group_id, CASE WHEN group_id IS NULL THEN sample_index END")


class _Item:
    __slots__ = ("trace_id", "kept")

    def __init__(self, trace_id: str) -> None:
        self.trace_id = trace_id
        self.kept: list[str] = []


def cut_step(rows: list[dict[str, Any]], selection: dict[str, Any],
             groups: list[dict[str, Any]] | None = None) -> dict[str, list[str]]:
    """The kept reasons of each candidate row of one (validate, step) after the cut (an
    empty list: left out). ``rows``: :data:`CANDIDATE_SQL`'s, ``selection``: a writer's
    :data:`~rtrace.dataset.schema.SELECTION_KEY` settings, ``groups``: every group of the
    step (:data:`GROUPS_SQL`'s rows), for the zero-variance tail: one collector chooses among
    the ``2 * keep`` groups of lowest rank of all it saw, kept or not, so the cut needs the
    ranks of the groups no collector wrote in full too."""
    keep_by = selection.get("keep_by") or "reward"
    selector = StepSelector(selection.get("cap"), selection.get("val_cap"), bool(selection.get("groups")),
                            int(selection.get("seed") or 0), 0.0, keep_errors=int(selection.get("keep_errors") or 0),
                            keep_extremes=int(selection.get("keep_extremes") or 0),
                            keep_zero_variance=int(selection.get("keep_zero_variance") or 0),
                            prompts=bool(selection.get("prompts")),
                            keep_unhealthy=int(selection.get("keep_unhealthy") or 0),
                            keep_mismatch=int(selection.get("keep_mismatch") or 0), counted=False)
    eligible = None
    keep_zv = int(selection.get("keep_zero_variance") or 0)
    if keep_zv and groups is not None:
        ranked = sorted((selector.group_priority(_coords(g)), _group_of(g)) for g in groups)
        eligible = {group for _, group in ranked[:2 * keep_zv]}
    items = {}
    for r in rows:
        item = items[r["trace_id"]] = _Item(r["trace_id"])
        coords = _coords(r)
        notes = dict(r["annotations_double"] or ())
        reward = _finite(r["reward"])
        failed = r["status"] == "error" or bool(r["truncated"]) or bool(r["partial"])
        value = reward if keep_by == "reward" else _finite(notes.get(keep_by))
        # a group beyond the step's 2 * keep lowest is no zero-variance candidate (reward None)
        grouped = reward if eligible is None or _group_of(r) in eligible else None
        tail = Tail(failed, value, grouped, bool(r["unhealthy"]), _finite(notes.get("logprob_mismatch_k3")))
        # only a row its own writer sampled can be in the sample (the lowest k of the union are
        # among each writer's lowest k); the others compete for the tail
        selector.offer(coords, item, 0.0, tail, prio=r["priority"], sample="sampled" in (r["kept"] or ()))
    selector.release(0.0, force=True)
    return {trace_id: item.kept for trace_id, item in items.items()}


def _coords(r: dict[str, Any]) -> dict[str, Any]:
    coords = {"validate": bool(r["validate"]), "step": r["step"], "sample_index": r["sample_index"],
              "rollout_n": r["rollout_n"]}
    if r["group_id"] is not None:
        coords["group_id"] = r["group_id"]
    return coords


def _group_of(r: dict[str, Any]) -> Any:
    return r["group_id"] if r["group_id"] is not None else r["sample_index"]


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
