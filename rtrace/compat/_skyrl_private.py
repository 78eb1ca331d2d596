"""Every SkyRL name rtrace patches, each behind one small function.

SkyRL's generator has no hook for a tracer: ``SkyRLGymGenerator.generate`` runs one
``agent_loop`` per trajectory, which calls the inference engine client and the
environment turn by turn and returns only the concatenated token ids. To see each turn
(its prompt ids, what the engine returned and when, what the environment answered and
when), :mod:`rtrace.compat.skyrl` wraps these methods, on the classes, once
(:func:`patch`). Nothing else in rtrace touches a SkyRL name that is not in
:data:`PRIVATE_NAMES`; ``tests/frameworks/test_skyrl.py`` checks each against the
installed SkyRL (``skyrl_train`` 0.3, and ``skyrl.train`` 0.4 where it imports).

Weight updates: SkyRL's trainer publishes its weights to the inference engines in one method
per trainer (:data:`TRAINER_METHODS`), which rtrace wraps on the class when the trainer's
module is imported (:func:`patch_trainer`); the version is the trainer's ``global_step`` then
(the steps trained: 0 before training, ``g`` after step ``g``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "MODULE_ROOTS", "TRAINER_METHODS", "classes", "patch", "wrap_client", "patch_trainer",
           "steps_trained"]

#: The packages SkyRL ships its trainer in: ``skyrl_train`` (skyrl-train 0.3) and
#: ``skyrl.train`` (skyrl 0.4).
MODULE_ROOTS = ("skyrl_train", "skyrl.train")

PRIVATE_NAMES = (
    # one trajectory's loop: called once per row, in row order, by generate()
    "generators.skyrl_gym_generator:SkyRLGymGenerator.agent_loop",
    # where env.init / env.step / env.close run (in a thread pool or inline); underscored
    "generators.skyrl_gym_generator:SkyRLGymGenerator._run_in_executor_if_available",
    # the observation token ids of a turn
    "generators.skyrl_gym_generator:SkyRLGymGenerator.get_obs_ids_from_obs",
    # the batch entry point (public, the GeneratorInterface method)
    "generators.skyrl_gym_generator:SkyRLGymGenerator.generate",
    # the engine call of a turn (public, the InferenceEngineInterface method): on skyrl-train
    # 0.3's InferenceEngineClient class; any other client (skyrl 0.4's RemoteInferenceClient,
    # under skyrl.backends, or a custom one) is wrapped on the generator's instance
    # (the generator's ``inference_engine_client`` attribute, set in its __init__, is read
    # by wrap_client)
    "inference_engines.inference_engine_client:InferenceEngineClient.generate",
    # where the trainers publish weights (public methods): the synchronous trainer's returns
    # the policy workers' ObjectRefs (its caller ray.get()s them at once); the fully async
    # one's is awaited, between pause_generation and resume_generation
    "trainer:RayPPOTrainer.sync_policy_weights_to_inference_engines",
    "fully_async_trainer:FullyAsyncRayPPOTrainer.async_sync_policy_weights_to_inference_engines",
    # the steps trained when they publish (an instance attribute, checked in the source)
    "trainer:RayPPOTrainer.global_step",
)

#: module (under a root) -> (class, method) where that trainer publishes its weights
TRAINER_METHODS = {"trainer": ("RayPPOTrainer", "sync_policy_weights_to_inference_engines"),
                   "fully_async_trainer": ("FullyAsyncRayPPOTrainer",
                                           "async_sync_policy_weights_to_inference_engines")}


def classes(root: str) -> tuple[Any, Any] | None:
    """``(SkyRLGymGenerator, InferenceEngineClient or None)`` of the SkyRL package ``root``,
    or None when its generator does not import (skyrl 0.4 has no InferenceEngineClient
    module: its clients are wrapped per instance, :func:`wrap_client`)."""
    try:
        gen = importlib.import_module(f"{root}.generators.skyrl_gym_generator")
    except Exception:
        return None
    try:
        client = importlib.import_module(f"{root}.inference_engines.inference_engine_client").InferenceEngineClient
    except Exception:
        client = None
    return gen.SkyRLGymGenerator, client


def wrap_client(generator: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Wrap ``generator.inference_engine_client.generate`` on that instance, once, unless
    its class's method is wrapped already (skyrl-train 0.3's InferenceEngineClient)."""
    import types

    client = getattr(generator, "inference_engine_client", None)
    if client is None or getattr(getattr(type(client), "generate", None), "__rtrace_wrapped__", False):
        return
    if "generate" in getattr(client, "__dict__", {}):
        return  # wrapped on this instance before
    method = getattr(type(client), "generate", None)
    if method is None:
        return
    new = wrap(method)
    new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
    try:
        client.generate = types.MethodType(new, client)
    except (AttributeError, TypeError):  # __slots__ or a read-only attribute: left untraced
        pass


def patch(generator_cls: type, client_cls: type, wrappers: dict[str, Callable[[Callable], Callable]]) -> bool:
    """Replace the methods keyed in ``wrappers`` with ``wrapper(original)``, once per class:
    ``batch`` (``SkyRLGymGenerator.generate``), ``loop`` (``agent_loop``), ``run_in_executor``
    (``_run_in_executor_if_available``), ``obs_ids`` (``get_obs_ids_from_obs``) and
    ``engine`` (``InferenceEngineClient.generate``). False when they were patched already."""
    if getattr(generator_cls, "__rtrace_patched__", False):
        return False
    targets = {"batch": (generator_cls, "generate"), "loop": (generator_cls, "agent_loop"),
               "run_in_executor": (generator_cls, "_run_in_executor_if_available"),
               "obs_ids": (generator_cls, "get_obs_ids_from_obs"), "engine": (client_cls, "generate")}
    for key, wrap in wrappers.items():
        owner, name = targets[key]
        if owner is None:  # no client class (skyrl 0.4): wrapped per instance
            continue
        original = owner.__dict__.get(name) or getattr(owner, name)
        if getattr(original, "__rtrace_wrapped__", False):
            continue
        new = wrap(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        new.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, name, new)
    generator_cls.__rtrace_patched__ = True  # type: ignore[attr-defined]
    return True


def patch_trainer(module: Any, wrap: Callable[[Callable], Callable]) -> bool:
    """Wrap the method of :data:`TRAINER_METHODS` of the trainer class ``module`` defines
    (``<root>.trainer`` or ``<root>.fully_async_trainer``) with ``wrap(original)``, once."""
    found = TRAINER_METHODS.get(module.__name__.rpartition(".")[2])
    owner = getattr(module, found[0], None) if found else None
    original = owner.__dict__.get(found[1]) if owner is not None else None
    if original is None or getattr(original, "__rtrace_wrapped__", False):
        return False
    new = wrap(original)
    new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
    new.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, found[1], new)
    return True


def steps_trained(trainer: Any) -> Any:
    """The trainer's ``global_step`` (when it publishes: the steps trained)."""
    return getattr(trainer, "global_step", None)
