"""veRL's trainer side: the per-token values veRL's driver computes, on each traced rollout.

After a step's rollouts, veRL's trainer (``RayPPOTrainer.fit``, ray_trainer.py) recomputes
every rollout's log probs with the training weights (``old_log_probs``, and the entropy),
computes token-level ``advantages`` and trains on ``response_mask``. rtrace lays them on
each rollout's generations as ``old_logprob``, ``entropy``, ``advantage`` and ``loss_mask``;
the sampler's ``logprob`` are already there, from the traced ``generate`` calls
(``TokenOutput.log_probs``); the ``logprob_mismatch`` check compares the two
(docs/token-values.md, docs/frameworks/verl.md).

Two ways:

* ``rtrace.compat.verl.install()`` (the Ray setup hook the agent loop already needs) also
  wraps veRL's ``RayPPOTrainer`` in the driver (:mod:`rtrace.compat._verl_private`): each
  step's batch is handed over just before the actor update, with nothing else to write;
* by hand, one line where a trainer of your own has the batch after ``compute_advantage``:
  ``rtrace.compat.verl.annotate_batch(batch)``.

Weight updates: ``install()`` also wraps ``CheckpointEngineManager.update_weights(global_steps)``,
where every veRL trainer publishes its weights to the rollout replicas: when it returns (the
replicas have them, generation resumed) a weight update is marked (``rtrace.mark_weight_update``),
version and step = ``global_steps`` (the steps trained: 0 before training, ``g`` after step
``g``; the fully async trainer passes its parameter version), with ``duration_ms``. Marked when
this process can hand values to rtrace, as below.

Coordinates: ``step`` = the trainer's ``global_steps`` (the batch's
``meta_info["global_steps"]`` by hand), ``sample_index`` = the batch's ``index`` column
(the dataset's ``extra_info.index``), ``rollout_n`` = the rollout's place among the rows of
its index in the order the agent loop numbered them (before ``_balance_batch`` reordered
the batch: the wrapper follows the reordering), counted per agent-loop worker's chunk as
veRL counts. The values join the trajectories where they are assembled: in this process,
or through the job's collector (the driver streams them there when its environment has
``collector.env``); to be checked before a trajectory is written, the trajectories must
wait for them (``RTRACE_AWAIT_ANNOTATIONS=old_logprob``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

from .. import _setup, _stats
from ..config import ConfigError, env_exporters
from ..instrumentation import _state
from ..instrumentation.annotate import annotate_batch as _annotate
from ..pipeline import annotations as _annotations
from . import _after_import, _verl_private, weight_sync

__all__ = ["annotate_batch", "install_hook", "COLUMNS"]

#: rtrace's name for each of veRL's per-token tensors (batch keys).
COLUMNS = {"old_logprob": "old_log_probs", "advantage": "advantages", "loss_mask": "response_mask"}
#: The temporary column that follows the rows through ``_balance_batch``'s reordering.
ROW_KEY = "__rtrace_row__"


def annotate_batch(batch: Any, step: Any = None, *, validate: bool = False, rollout_n: Sequence[int] | None = None,
                   entropy: Any = None, num_workers: int | None = None) -> int:
    """Hand a veRL batch's per-token values to rtrace: one line after ``compute_advantage``.

    ``old_log_probs`` -> ``old_logprob``, ``advantages`` -> ``advantage``, ``response_mask``
    -> ``loss_mask`` (each ``[B, R]`` over the response; the real positions are
    ``attention_mask[:, -R:]``), and ``entropy`` if given (``_compute_old_log_prob``'s
    ``entropys``, which ``fit`` drops). The trainer's thread keeps references only.

    Args:
        batch: a ``DataProto`` holding those tensors and the ``index`` column (or
            ``extra_info`` dicts with an ``index``).
        step: the step the rollouts were generated at (default ``meta_info["global_steps"]``).
        validate: validation rollouts.
        rollout_n: each row's rollout number; default: counted over the rows of equal
            ``index`` in the batch's order (the agent loop's order, before any reordering).
        entropy: ``[B, R]`` per-token entropy.
        num_workers: veRL's ``rollout.agent.num_workers``: the count restarts at each
            worker's chunk, as veRL's does.

    Returns:
        How many rows were sent (0 when rtrace is off here or the batch has none of them).
    """
    tensors = batch.batch
    keys = set(tensors.keys())
    columns = {name: tensors[key] for name, key in COLUMNS.items() if key in keys}
    if entropy is not None:
        columns["entropy"] = entropy
    if not columns or "responses" not in keys or "attention_mask" not in keys:
        return 0
    index = _sample_indices(batch)
    if index is None:
        _stats.warn_once("verl-no-index", "rtrace.compat.verl.annotate_batch: the batch has no `index` column (nor "
                         "extra_info indices): its rows cannot be matched to the traced rollouts")
        return 0
    if step is None:
        step = batch.meta_info.get("global_steps")
    if rollout_n is None:
        rollout_n = rollout_numbers(index, num_workers)
    width = tensors["responses"].shape[1]
    return _annotate(step=step, sample_index=index, rollout_n=list(rollout_n), validate=validate,
                     token_mask=tensors["attention_mask"][:, -width:], **columns)


def _sample_indices(batch: Any) -> list[Any] | None:
    """Each row's dataset index: the ``index`` column, else ``extra_info["index"]``."""
    extra = batch.non_tensor_batch
    if "index" in extra:
        return extra["index"].tolist()
    infos = extra.get("extra_info")
    if infos is not None and all(isinstance(i, dict) and "index" in i for i in infos):
        return [i["index"] for i in infos]
    return None


def rollout_numbers(index: Sequence[Any], num_workers: int | None = None) -> list[int]:
    """veRL's ``rollout_n`` of each row (``get_trajectory_info``): 0 at a row whose index
    differs from the row before, else one more; restarting at each agent-loop worker's
    chunk (the batch split in ``num_workers`` equal parts)."""
    n = len(index)
    size = n // num_workers if num_workers and n % num_workers == 0 and n >= num_workers else n
    out: list[int] = []
    for i, value in enumerate(index):
        out.append(out[-1] + 1 if i % max(size, 1) and index[i - 1] == value else 0)
    return out


# ----------------------------------------------------------------------------- the trainer hook
#: id(batch) -> what the wrappers learnt about it (a few steps at most: popped at the update)
_ORDER: OrderedDict[int, list[int]] = OrderedDict()
_ENTROPY: OrderedDict[int, Any] = OrderedDict()
_KEPT = 4


def _remember(table: OrderedDict[int, Any], batch: Any, value: Any) -> None:
    table[id(batch)] = value
    while len(table) > _KEPT:
        table.popitem(last=False)


def _ready() -> bool:
    """True when this process can hand values to rtrace: a collector runs here, rtrace is
    configured, or the environment says to stream to the job's collector."""
    if _annotations.local_target is not None:
        return True
    if _state.runtime is _state.UNSET:  # nobody configured rtrace in this process
        try:
            streams = "collector" in env_exporters()
        except ConfigError:
            streams = False
        if not streams:
            _stats.warn_once("verl-trainer-off", "rtrace.compat.verl: rtrace is not configured in veRL's trainer "
                             "process: the trainer's per-token values (old_logprob, advantage, entropy) are not "
                             "traced. They reach the rollouts through the job's collector (collector.env in the "
                             "driver's environment; docs/frameworks/verl.md)")
            return False
    return _setup.is_enabled()


def _workers(trainer: Any) -> int | None:
    try:
        return int(trainer.config.actor_rollout_ref.rollout.agent.num_workers)
    except Exception:
        return None


def _wrap_balance(original: Callable) -> Callable:
    def balance(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        index = _sample_indices(batch) if _ready() else None
        if index is None:
            return original(self, batch, *args, **kwargs)
        import numpy as np

        before = rollout_numbers(index, _workers(self))
        # a row number that _balance_batch's reorder carries along, taken out again at once
        batch.non_tensor_batch[ROW_KEY] = np.arange(len(index))
        try:
            return original(self, batch, *args, **kwargs)
        finally:
            rows = batch.non_tensor_batch.pop(ROW_KEY, None)
            if rows is not None and len(rows) == len(before):
                _remember(_ORDER, batch, [before[i] for i in rows.tolist()])

    return balance


def _wrap_old_log_prob(original: Callable) -> Callable:
    def compute(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, batch, *args, **kwargs)
        if _ready():
            try:  # fit drops the entropy after its metric: a reference keeps it for the update
                _remember(_ENTROPY, batch, out[0].batch["entropys"])
            except Exception:
                pass
        return out

    return compute


def _wrap_update(original: Callable) -> Callable:
    def update(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        order, entropy = _ORDER.pop(id(batch), None), _ENTROPY.pop(id(batch), None)
        if _ready():
            try:
                if order is not None and len(order) != len(batch):
                    order = None
                annotate_batch(batch, _verl_private.step_of(self), rollout_n=order, entropy=entropy,
                               num_workers=_workers(self))
            except Exception:
                _stats.incr("internal_errors")
                _stats.warn_once("verl-trainer", "rtrace.compat.verl could not hand a step's per-token values to "
                                 "rtrace", exc_info=True)
        return original(self, batch, *args, **kwargs)

    return update


def _patch(module: Any = None) -> bool:
    return _verl_private.patch(_verl_private.trainer_class(module), _wrap_balance, _wrap_old_log_prob, _wrap_update)


def _wrap_weight_sync(original: Callable) -> Callable:
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps = kwargs.get("global_steps", args[0] if args else None)  # update_weights(self, global_steps=None)

        def version() -> tuple[int, int] | None:
            if not isinstance(steps, int) or isinstance(steps, bool) or not _ready():
                return None
            return steps, steps

        return await weight_sync.published_async(lambda: original(self, *args, **kwargs), version, name="verl")

    return update_weights


def _patch_weights(module: Any) -> bool:
    return _verl_private.patch_weight_sync(module, _wrap_weight_sync)


def install_hook() -> None:
    """Wrap veRL's ``RayPPOTrainer`` and its weight sync (``CheckpointEngineManager.
    update_weights``) now if their modules are imported, else when they are. Cheap and
    idempotent (called by ``rtrace.compat.verl.install()``)."""
    _after_import.when_imported(_verl_private.TRAINER_MODULE, _patch)
    _after_import.when_imported(_verl_private.WEIGHTS_MODULE, _patch_weights)
