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

__all__ = ["cut_step", "CANDIDATE_SQL"]

#: the columns the cut reads, of the rows the writers kept (``{where}``: the steps to cut)
CANDIDATE_SQL = (
    "SELECT validate, step, trace_id, sample_index, rollout_n, group_id, priority, kept, status, truncated, "
    "partial, reward, len(health) > 0 AS unhealthy, annotations_double FROM {source} WHERE priority IS NOT NULL "
    "AND len(kept) > 0 AND ({where}) ORDER BY trace_id")


class _Item:
    __slots__ = ("trace_id", "kept")

    def __init__(self, trace_id: str) -> None:
        self.trace_id = trace_id
        self.kept: list[str] = []


def cut_step(rows: list[dict[str, Any]], selection: dict[str, Any]) -> dict[str, list[str]]:
    """The kept reasons of each candidate row of one (validate, step) after the cut (an
    empty list: left out). ``rows``: :data:`CANDIDATE_SQL`'s, ``selection``: a writer's
    :data:`~rtrace.dataset.schema.SELECTION_KEY` settings."""
    keep_by = selection.get("keep_by") or "reward"
    selector = StepSelector(selection.get("cap"), selection.get("val_cap"), bool(selection.get("groups")),
                            int(selection.get("seed") or 0), 0.0, keep_errors=int(selection.get("keep_errors") or 0),
                            keep_extremes=int(selection.get("keep_extremes") or 0),
                            keep_zero_variance=int(selection.get("keep_zero_variance") or 0),
                            prompts=bool(selection.get("prompts")),
                            keep_unhealthy=int(selection.get("keep_unhealthy") or 0),
                            keep_mismatch=int(selection.get("keep_mismatch") or 0), counted=False)
    items = {}
    for r in rows:
        item = items[r["trace_id"]] = _Item(r["trace_id"])
        coords = {"validate": bool(r["validate"]), "step": r["step"], "sample_index": r["sample_index"],
                  "rollout_n": r["rollout_n"]}
        if r["group_id"] is not None:
            coords["group_id"] = r["group_id"]
        notes = dict(r["annotations_double"] or ())
        reward = _finite(r["reward"])
        failed = r["status"] == "error" or bool(r["truncated"]) or bool(r["partial"])
        value = reward if keep_by == "reward" else _finite(notes.get(keep_by))
        tail = Tail(failed, value, reward, bool(r["unhealthy"]), _finite(notes.get("logprob_mismatch_k3")))
        # only a row its own writer sampled can be in the sample (the lowest k of the union are
        # among each writer's lowest k); the others compete for the tail
        selector.offer(coords, item, 0.0, tail, prio=r["priority"], sample="sampled" in (r["kept"] or ()))
    selector.release(0.0, force=True)
    return {trace_id: item.kept for trace_id, item in items.items()}


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
