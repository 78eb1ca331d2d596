"""open-instruct: ``rtrace.compat.open_instruct.install()`` traces each step's generations.

::

    import rtrace.compat.open_instruct
    rtrace.compat.open_instruct.install()   # in the process running grpo_fast.main, and via Ray's
                                             # worker_process_setup_hook in the DataPreparationActor

open-instruct gathers a step's generations in ``accumulate_inference_batches`` — training in
the ``DataPreparationActor``, evaluation in ``grpo_utils.maybe_evaluate`` — as one
``GenerationResult`` (``responses``, ``masks``: 1 = the model's tokens, 0 = a tool's output;
``finish_reasons``, ``model_step``...) and a ``Batch`` (``queries``, ``indices``, ``scores``,
``model_steps``). Each sample becomes a trajectory (:func:`log_batch`): its query, its
response cut into the model's turns and the tools' outputs, the finish reason, the score
as reward; ``step`` = ``training_step``, ``validate`` for the evaluation call,
``sample_index`` = the dataset index's dense index in the step, ``rollout_n`` = the
sample's place among that index's samples, ``group_id`` = the dataset index,
``policy_version`` = the sample's ``model_step``.

:func:`log_batch` can also be called by hand with a ``GenerationResult`` and its ``Batch``.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _setup, _stats
from ..instrumentation.turns import PromptIndex, Turn, admit, sample_state, submit
from . import _open_instruct_private

__all__ = ["install", "log_batch"]

_index = PromptIndex()


def install() -> bool:
    """Wrap ``open_instruct.data_loader.accumulate_inference_batches``. Idempotent; usable as
    Ray's ``worker_process_setup_hook``. False when open-instruct does not import."""
    done = _open_instruct_private.patch(_wrap)
    if not done:
        _stats.warn_once("open-instruct-missing", "rtrace.compat.open_instruct.install(): open_instruct does not "
                         "import; nothing is traced")
    return done


def _wrap(original: Callable) -> Callable:
    def accumulate(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not _setup.is_enabled():
            return out
        try:
            result, batch = out[0], out[1]
            if batch is not None and getattr(result, "responses", None) is not None:
                step = kwargs.get("training_step", args[7] if len(args) > 7 else None)
                log_batch(result, batch, step=step, validate=_open_instruct_private.called_from_evaluation())
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("open-instruct-log", "rtrace.compat.open_instruct could not trace a batch",
                             exc_info=True)
        return out

    return accumulate


def log_batch(result: Any, batch: Any, *, step: int | None, validate: bool = False,
              name: str = "open_instruct_sample") -> int:
    """One trajectory per sample of a step's ``GenerationResult`` and ``Batch``.

    Returns:
        How many were queued (after the per-step sampling).
    """
    indices = list(batch.indices) if batch.indices is not None else [None] * len(result.responses)
    scores = list(batch.scores) if batch.scores is not None else [None] * len(result.responses)
    versions = list(batch.model_steps) if batch.model_steps else [None] * len(result.responses)
    seen: dict[Any, int] = {}
    states = []
    for i, response in enumerate(result.responses):
        index = indices[i]
        rollout_n = seen.get(index, 0)
        seen[index] = rollout_n + 1
        coords: dict[str, Any] = {
            "step": step, "validate": bool(validate), "rollout_n": rollout_n,
            "sample_index": _index.index(validate, step, index if index is not None else ("row", i)),
            "group_id": None if index is None else str(index),
            "policy_version": versions[i] if isinstance(versions[i], int) else None,
            "extra": {"dataset_index": index}}
        if not admit(coords):
            continue
        turns = _turns(list(response), list(result.masks[i]), result.finish_reasons[i])
        states.append(sample_state(coords, list(batch.queries[i]), turns, scores[i], name=name,
                                   root_attributes={"rtrace.trainer": "open-instruct"}))
    return submit(states)


def _turns(ids: list[int], mask: list[int], finish: str | None) -> list[Turn]:
    """The response cut into the model's turns (mask 1) and the tools' outputs (mask 0)."""
    runs: list[tuple[bool, int, int]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or bool(mask[k]) != bool(mask[start]):
            runs.append((bool(mask[start]), start, k))
            start = k
    last = max((i for i, run in enumerate(runs) if run[0]), default=None)
    return [Turn("assistant", ids[lo:hi], finish_reason=finish if i == last else None) if model
            else Turn("tool", ids[lo:hi], name="tool") for i, (model, lo, hi) in enumerate(runs)]
