"""Every AReaL name rtrace patches, each behind one small function.

AReaL (1.0) runs one ``RolloutWorkflow.arun_episode(engine, data)`` per sample, a
``GroupedRolloutWorkflow`` gathering the GRPO group's members, and ``engine.agenerate(req)``
per generation; no hook is offered for a tracer. :mod:`rtrace.compat.areal` patches, once
per class (:func:`patch`): ``RemoteInfEngine._resolve_workflow`` (every workflow the engine
runs passes through it: rtrace instruments the instance it returns),
``GroupedRolloutWorkflow.arun_episode`` (the group: its members are numbered in the order
it starts them) and ``RemoteInfEngine.agenerate`` (a generation). It reads the
``WorkflowContext`` AReaL sets for each task (``is_eval``, ``task_id``). Weight updates:
``RemoteInfEngine.set_version`` (the trainer tells the rollout engine the version of the
weights it just updated: ``PPOTrainer.train`` calls ``rollout.pause()``,
``actor.update_weights(...)``, then ``rollout.set_version(global_step + 1)``) and
``RemoteInfEngine.pause`` (when that update began). Nothing else in
rtrace touches an AReaL name not in :data:`PRIVATE_NAMES`; ``tests/frameworks/test_areal.py``
checks each against the installed AReaL.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "classes", "patch", "task_context"]

PRIVATE_NAMES = (
    # where the engine resolves a workflow (instance, class, import path) and wraps it in a
    # GroupedRolloutWorkflow for group_size > 1; underscored
    "areal.infra.remote_inf_engine:RemoteInfEngine._resolve_workflow",
    # the group: gathers group_size runs of its member workflow
    "areal.infra.remote_inf_engine:GroupedRolloutWorkflow.arun_episode",
    # the member workflow of a group (instance attribute)
    "areal.infra.remote_inf_engine:GroupedRolloutWorkflow.workflow",
    # one generation (public, the InferenceEngine method)
    "areal.infra.remote_inf_engine:RemoteInfEngine.agenerate",
    # the weight version generations are made with (public)
    "areal.infra.remote_inf_engine:RemoteInfEngine.get_version",
    # the trainer sets it once the new weights are on the servers (public): a weight update
    "areal.infra.remote_inf_engine:RemoteInfEngine.set_version",
    # the trainer pauses the rollouts before it updates the weights (public)
    "areal.infra.remote_inf_engine:RemoteInfEngine.pause",
    # the per-task context the WorkflowExecutor sets (is_eval, task_id)
    "areal.infra.workflow_context:get",
)


def classes() -> tuple[Any, Any] | None:
    """``(RemoteInfEngine, GroupedRolloutWorkflow)``, or None when AReaL does not import."""
    try:
        module = importlib.import_module("areal.infra.remote_inf_engine")
    except Exception:
        return None
    return module.RemoteInfEngine, module.GroupedRolloutWorkflow


def task_context() -> tuple[bool, Any]:
    """``(is_eval, task_id)`` of the workflow task running in this context."""
    ctx = importlib.import_module("areal.infra.workflow_context").get()
    return bool(ctx.is_eval), ctx.task_id


def member_workflow(group: Any) -> Any:
    """The workflow a GroupedRolloutWorkflow runs ``group_size`` times."""
    return group.workflow


def patch(engine_cls: type, group_cls: type, resolve: Callable[[Callable], Callable],
          group_run: Callable[[Callable], Callable], agenerate: Callable[[Callable], Callable],
          set_version: Callable[[Callable], Callable], pause: Callable[[Callable], Callable]) -> bool:
    """Wrap ``_resolve_workflow``, ``GroupedRolloutWorkflow.arun_episode``, ``agenerate``,
    ``set_version`` and ``pause`` with ``wrapper(original)``, once; False when done before."""
    if getattr(engine_cls, "__rtrace_patched__", False):
        return False
    for owner, name, wrap in ((engine_cls, "_resolve_workflow", resolve), (group_cls, "arun_episode", group_run),
                              (engine_cls, "agenerate", agenerate), (engine_cls, "set_version", set_version),
                              (engine_cls, "pause", pause)):
        original = getattr(owner, name)
        new = wrap(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        new.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, name, new)
    engine_cls.__rtrace_patched__ = True  # type: ignore[attr-defined]
    return True
