"""The trainer adapters' per-token values: a trainer's ``[B, T]`` arrays handed to rtrace
for the samples an adapter traces.

``rtrace.annotate_batch`` annotates every row of a batch. An adapter that builds its
trajectories itself admits each sample first (the per-step cap) and builds only the
admitted ones: its per-token rows go to those alone, so a sampled-out sample leaves no
annotation waiting for a trajectory that never comes (``annotations_unmatched``). Same
contract as ``annotate_batch`` otherwise (docs/token-values.md): the trainer's thread keeps
references (no copy, no ``.tolist()``, a CUDA tensor's copy to the CPU only queued), rtrace's
worker reads the batch once and cuts each trajectory's row into its generations, in one
process or through a collector.
"""

from __future__ import annotations

from typing import Any, Sequence

from .. import _stats
from ..instrumentation.annotate import _target
from ..pipeline.annotations import Annotation, coord_key
from ..pipeline.tokens import TokenBatch, TokenRow

__all__ = ["send"]


def send(rows: Sequence[tuple[int, dict[str, Any]]], columns: dict[str, Any], *, token_mask: Any = None,
         token_lengths: Any = None) -> int:
    """Annotate the trajectory with coordinates ``coords`` with row ``i`` of each column, for
    each ``(i, coords)`` of ``rows``.

    Args:
        rows: the batch rows to hand over, each with its trajectory's coordinates
            (``step``, ``sample_index``, ``rollout_n``, ``validate``).
        columns: name -> ``[B, T]`` tensor, array or list of rows, over each sample's
            response (None values are left out).
        token_mask: ``[B, T]``: which positions are real; or
        token_lengths: ``[B]``: how many are (the first ones).

    Returns:
        How many trajectories were annotated (0 with tracing off or nothing to send).
    """
    columns = {name: value for name, value in columns.items() if value is not None}
    if not rows or not columns:
        return 0
    target = _target()
    if target is None:
        return 0
    batch = TokenBatch(columns, token_mask, token_lengths)
    out = []
    for i, coords in rows:
        key = coord_key(coords)
        if key is None:
            continue
        row = TokenRow(batch, i)  # one object for all the batch's names: the annotation's key names the column
        out.append(Annotation(key, None, {name: row for name in columns}))
    if out:
        _stats.incr("annotations_sent", len(out))
        target(out)
    return len(out)
