"""Every private veRL name rtrace touches, each behind one small function.

veRL's trainer (``RayPPOTrainer.fit`` in ``verl/trainer/ppo/ray_trainer.py``, the trainer
whose agent loop veRL traces: ``trainer.use_v1=False``) has no hook where a step's batch is
whole: ``fit`` is one loop, and the per-token values are together, for one moment, between
``compute_advantage`` and the actor update. So :mod:`rtrace.compat.verl_trainer` wraps three
methods of the class, once (:func:`patch`):

* ``_balance_batch``: reorders the batch across data-parallel ranks. The agent loop numbered
  each rollout (``rollout_n``) in the order before it; the wrapper learns the reordering;
* ``_compute_old_log_prob``: returns the recomputed log probs and the entropy, which ``fit``
  drops after its metric; the wrapper keeps a reference to the entropy;
* ``_update_actor``: called with the batch that holds everything (``old_log_probs``,
  ``advantages``, ``response_mask``); the wrapper hands it to rtrace first.

Weight updates: every veRL trainer (``RayPPOTrainer.fit``, the v1 trainers, the fully async
one) publishes its weights to the rollout replicas through
``CheckpointEngineManager.update_weights(global_steps)`` (``verl/checkpoint_engine/base.py``), a
coroutine function behind veRL's ``auto_await`` (run at once from sync code, awaited from async
code: it looks at its caller's frame, so the wrapper is wrapped by ``auto_await`` again,
:func:`patch_weight_sync`). It returns once the replicas have the weights and generation resumed.

``tests/verl/test_verl_trainer_values.py`` checks each name against the installed veRL and
runs the wrapped methods on veRL's own code.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "TRAINER_MODULE", "WEIGHTS_MODULE", "trainer_class", "patch", "step_of",
           "patch_weight_sync"]

#: The module of veRL's trainer.
TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"

PRIVATE_NAMES = (
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._balance_batch",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._compute_old_log_prob",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._update_actor",
    # the step the batch belongs to (an instance attribute; the agent loop traced the
    # rollouts at gen_batch.meta_info["global_steps"] = self.global_steps)
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer.global_steps",
    # where weights reach the rollout replicas (public method, every trainer), and the
    # decorator that makes it callable from sync and async code
    "verl.checkpoint_engine.base:CheckpointEngineManager.update_weights",
    "verl.utils.ray_utils:auto_await",
)

#: The module of veRL's weight sync to the rollout replicas.
WEIGHTS_MODULE = "verl.checkpoint_engine.base"


def trainer_class(module: Any = None) -> Any:
    """veRL's ``RayPPOTrainer`` (from ``module`` if given, else imported), or None."""
    try:
        module = module or importlib.import_module(TRAINER_MODULE)
    except Exception:
        return None
    return getattr(module, "RayPPOTrainer", None)


def patch(cls: Any, balance: Callable[[Callable], Callable], old_log_prob: Callable[[Callable], Callable],
          update: Callable[[Callable], Callable]) -> bool:
    """Wrap ``_balance_batch``, ``_compute_old_log_prob`` and ``_update_actor`` of ``cls``
    with ``wrapper(original)``, once. False when they were wrapped already (or are missing)."""
    if cls is None or getattr(cls, "__rtrace_patched__", False):
        return False
    targets = (("_balance_batch", balance), ("_compute_old_log_prob", old_log_prob), ("_update_actor", update))
    if not all(callable(getattr(cls, name, None)) for name, _ in targets):
        return False  # another veRL: nothing is wrapped (the canary test names what moved)
    for name, wrap in targets:
        original = cls.__dict__.get(name) or getattr(cls, name)
        new = wrap(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        new.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(cls, name, new)
    cls.__rtrace_patched__ = True
    return True


def step_of(trainer: Any) -> Any:
    """The trainer's current step (``global_steps``)."""
    return getattr(trainer, "global_steps", None)


def patch_weight_sync(module: Any, wrap: Callable[[Callable], Callable]) -> bool:
    """Replace ``CheckpointEngineManager.update_weights`` of ``module`` with
    ``auto_await(wrap(coroutine function))``, once: ``wrap`` gets veRL's own coroutine function
    (under its ``auto_await``) and returns one. False when it is not there (or done before)."""
    cls = getattr(module, "CheckpointEngineManager", None)
    current = cls.__dict__.get("update_weights") if cls is not None else None
    if current is None or getattr(current, "__rtrace_wrapped__", False):
        return False
    inner = getattr(current, "__wrapped__", current)  # functools.wraps in auto_await
    if not inspect.iscoroutinefunction(inner):
        return False
    auto_await = importlib.import_module("verl.utils.ray_utils").auto_await
    new = auto_await(wrap(inner)) if inner is not current else wrap(inner)
    new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
    new.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(cls, "update_weights", new)
    return True
