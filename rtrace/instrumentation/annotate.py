"""``rtrace.annotate`` / ``rtrace.annotate_batch``: values from the trainer, joined to
trajectories after (or while) they run, in any process.

A trajectory is named by its coordinates ``(step, sample_index, rollout_n, validate)``
or its ``trace_id``. The values travel to where the trajectory is assembled: this
process's pipeline, the collector started in this process, or (collector mode) the
job's collector over the same OTLP channel as the spans. They land on the trajectory
root as ``rl.<key>`` (``reward`` as ``rl.reward``) and in each sink's metadata, tags and
summaries. See docs/annotations.md.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _stats
from .._serialize import array_to_python
from ..pipeline import annotations
from ..pipeline.annotations import Annotation, coord_key
from ..pipeline.tokens import TokenBatch, TokenRow
from . import _state

__all__ = ["annotate", "annotate_batch"]


def _target() -> Callable[[list[Annotation]], None] | None:
    if annotations.local_target is not None:  # a collector runs in this process
        return annotations.local_target
    rt = _state.get_runtime()
    return None if rt is None else rt.intake.annotate


def annotate(step: Any = None, sample_index: Any = None, rollout_n: Any = None, *, validate: bool = False,
             trace_id: str | int | None = None, reward: Any = None, **values: Any) -> None:
    """Attach values to one trajectory, from any process, until it is exported.

    ``rtrace.annotate(step=3, sample_index=17, rollout_n=2, advantage=0.4)``. The
    trajectory is found by its coordinates, or by ``trace_id`` (32 hex digits, as
    ``rollout_context(...).trace_id`` gives it). Values are converted like captured
    values (numbers, strings, small tensors). Trajectories wait for the keys named in
    ``RTRACE_AWAIT_ANNOTATIONS``; an annotation that arrives after its trajectory was
    exported is counted as ``annotations_late``, one for a sampled-out trajectory as
    ``annotations_sampled_out``. Never raises for a missing trajectory.
    """
    if reward is not None:
        values["reward"] = reward
    if not values:
        return
    target = _target()
    if target is None:
        return
    tid = int(trace_id, 16) if isinstance(trace_id, str) else trace_id
    key = coord_key({"step": step, "sample_index": sample_index, "rollout_n": rollout_n, "validate": validate})
    if key is None and tid is None:
        raise ValueError("annotate: give step and sample_index (and rollout_n), or trace_id")
    _stats.incr("annotations_sent")
    target([Annotation(key, tid, {k: _scalar(v) for k, v in values.items()})])


def annotate_batch(step: Any, sample_index: Any, rollout_n: Any, validate: Any = False, *, token_mask: Any = None,
                   token_lengths: Any = None, **columns: Any) -> int:
    """Attach per-trajectory columns from the trainer's tensors or lists, in one call.

    ``rtrace.annotate_batch(step=3, sample_index=idx, rollout_n=n, reward=r, advantage=a)``:
    ``sample_index`` and ``rollout_n`` are ``[B]`` (lists, arrays or tensors), ``step``
    and ``validate`` one value or ``[B]``; every column is ``[B]`` (a tensor is copied
    to the CPU once). Row ``i`` annotates the trajectory ``(step[i], sample_index[i],
    rollout_n[i])``; rows may come in any order.

    A ``[B, T]`` column (a 2-D tensor or array, or a list of lists, ragged or padded) is a
    per-token array over each trajectory's response tokens (``old_logprob=``,
    ``advantage=``, ``loss_mask=``, ``entropy=``, any name; docs/token-values.md):
    ``token_mask`` (``[B, T]``, the attention / response-padding mask) says which
    positions are real, or ``token_lengths`` (``[B]``) how many are; without either, every
    position of a row is. This thread keeps references only (a CUDA tensor gets its copy to
    the CPU queued on the current stream, never waited for here); rtrace's worker reads
    them, and drops the rows of trajectories that are not kept.

    Returns:
        How many annotations were sent (0 when tracing is off).

    Raises:
        ValueError: a column whose length is not ``B`` (the message names it).
    """
    index = _column(sample_index, "sample_index", None)
    size = len(index)
    rollouts = _column(rollout_n, "rollout_n", size)
    steps = _column(step, "step", size)
    flags = _column(validate, "validate", size)
    per_token = {name: value for name, value in columns.items() if _is_matrix(value)}
    for name, value in per_token.items():
        rows = _n_rows(value)
        if rows != size:
            raise ValueError(f"annotate_batch: {name} has {rows} rows; sample_index has {size}")
    for name, value in (("token_mask", token_mask), ("token_lengths", token_lengths)):
        if value is not None and _n_rows(value) != size:
            raise ValueError(f"annotate_batch: {name} has {_n_rows(value)} rows; sample_index has {size}")
    cols = {name: _column(value, name, size, scalar_ok=False) for name, value in columns.items()
            if name not in per_token}
    target = _target()
    if target is None or not (cols or per_token):
        return 0
    tokens = TokenBatch(per_token, token_mask, token_lengths) if per_token else None
    batch = []
    for i in range(size):
        key = coord_key({"step": steps[i], "sample_index": index[i], "rollout_n": rollouts[i],
                         "validate": bool(flags[i])})
        values = {name: _scalar(col[i]) for name, col in cols.items()}
        if tokens is not None:
            row = TokenRow(tokens, i)
            for name in per_token:
                values[name] = row
        batch.append(Annotation(key, None, values))
    _stats.incr("annotations_sent", len(batch))
    target(batch)
    return len(batch)


def _is_matrix(value: Any) -> bool:
    """A ``[B, T]`` column: a 2-D tensor or array, or a list of sequences."""
    ndim = getattr(value, "ndim", None)
    if ndim is not None:
        if ndim > 2:
            raise ValueError(f"annotate_batch: a column of {ndim} dimensions (1: per trajectory, 2: per token)")
        return ndim == 2
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) == 1 for v in value)


def _n_rows(value: Any) -> int:
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else len(value)


def _column(value: Any, name: str, size: int | None, scalar_ok: bool = True) -> list[Any]:
    data = array_to_python(value)  # one device-to-host copy per tensor
    if isinstance(data, (list, tuple)):
        if any(isinstance(v, (list, tuple)) for v in data):
            raise ValueError(f"annotate_batch: {name} must be 1-D ([batch]), got a nested sequence")
        if size is not None and len(data) != size:
            raise ValueError(f"annotate_batch: {name} has {len(data)} entries; sample_index has {size}")
        return list(data)
    if size is None or not scalar_ok:
        raise ValueError(f"annotate_batch: {name} must be a list, array or tensor of length "
                         f"{'the batch' if size is None else size}, got {type(value).__name__}")
    return [data] * size


def _scalar(value: Any) -> Any:
    value = array_to_python(value)
    return value
