"""Every open-instruct name rtrace touches, each behind one small function.

open-instruct gathers each step's generations in
``open_instruct.data_loader.accumulate_inference_batches`` — for training inside the
``DataPreparationActor`` (a Ray actor), for evaluation from ``grpo_utils.maybe_evaluate`` —
and offers no hook there. :mod:`rtrace.compat.open_instruct` replaces module functions of
``open_instruct.data_loader`` with wrappers: that function, ``process_group`` (it returns
None for a group ``filter_zero_std_samples`` drops) and ``result_is_stale`` (True for a
result it drops as too old), both called as module globals by the first.

How the callers reach the wrappers. ``maybe_evaluate`` looks the function up in the module
at each call. The data preparation loop is a method of ``DataPreparationActor``, which Ray
pickles by value when the actor is created (``@ray.remote`` leaves the module's name bound
to Ray's wrapper, not the class): the method's globals travel with it, each function as a
reference (its module and qualified name) resolved where the actor loads the class. So a
wrapper carries its original's module and name (``functools.update_wrapper``) and pickles
as that reference: in the actor it resolves to the module's attribute there — the wrapper
where ``install()`` ran (Ray's setup hook runs before the class loads), the original where
not. A wrapper pickled by value would drag rtrace's state along (a ``ContextVar``: Ray fails
with "Could not serialize the actor class").

Weight updates. open-instruct publishes new weights to its vLLM engines in
``open_instruct.grpo_utils.perform_weight_sync`` (pause the generation actors, broadcast, wait
for the engines' update calls, wake the engines, resume): when it returns, the engines run the
new weights and stamp their results' ``model_step`` with the step they were sent with.
Its callers look it up in ``grpo_utils`` at each call, so a module attribute replaced in the
process that calls it (``grpo_fast.main``'s: ``install()`` runs there) is what they call. The
call does not carry that step: its caller has it, ``weight_sync_thread``'s local
``target_model_step`` (``grpo_fast``), or ``VLLMWeightSyncCallback.post_step``'s
``self.trainer.global_step`` (``grpo_callbacks``): :func:`sync_version` reads it there.

The modules are patched when they are imported (:mod:`rtrace.compat._after_import`), not
imported by ``install()``: the setup hook runs in every Ray worker, vLLM engines and tool
pools included. The names and fields are checked against the real code, read with ``ast``
into ``tests/frameworks/open_instruct_names.json`` (open-instruct cannot be imported here:
its rollout path needs vLLM).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from typing import Any, Callable

from . import _after_import

__all__ = ["PRIVATE_NAMES", "MODULE", "SYNC_MODULE", "patch", "sync_version", "called_from_evaluation", "argument",
           "query_of", "stale_result", "drops_truncated", "text_envs"]

MODULE = "open_instruct.data_loader"
#: where open-instruct's weight broadcast lives
SYNC_MODULE = "open_instruct.grpo_utils"

PRIVATE_NAMES = (
    # gathers a step's GenerationResults into (result, batch, reward_metrics, stats)
    "open_instruct.data_loader:accumulate_inference_batches",
    # one prompt's group, called by it: None when filter_zero_std_samples drops the group
    "open_instruct.data_loader:process_group",
    # called by it on each result: True when it drops the result (older than max_result_age_steps)
    "open_instruct.data_loader:result_is_stale",
    # the dataset column of a prompt's token ids (what process_group reads as the query)
    "open_instruct.data_loader:INPUT_IDS_PROMPT_KEY",
    # a prompt's own environment config (a dataset column), merged with the run's as the
    # vLLM actor gets it
    "open_instruct.data_loader:ENV_CONFIG_KEY",
    "open_instruct.data_loader:_merge_env_config",
    # the training caller, whose config says whether it drops truncated completions next
    "open_instruct.data_loader:DataPreparationActor._data_preparation_loop",
    "open_instruct.data_loader:StreamingDataLoaderConfig.mask_truncated_completions",
    # its evaluation caller
    "open_instruct.grpo_utils:maybe_evaluate",
    # publishes new weights to the vLLM engines; returns when they are in effect (engines awake)
    "open_instruct.grpo_utils:perform_weight_sync",
    # its callers, and where each keeps the step the engines were sent (their model_step)
    "open_instruct.grpo_fast:weight_sync_thread",  # local target_model_step
    "open_instruct.grpo_callbacks:VLLMWeightSyncCallback.post_step",  # self.trainer.global_step
    # Python's frame API: which caller, and the result result_is_stale was asked about
    "sys:_getframe",
)

#: module name -> function name -> wrap(original) -> wrapper, applied when the module is imported
_wrappers: dict[str, dict[str, Callable[[Callable], Callable]]] = {}


def patch(wrappers: dict[str, Callable[[Callable], Callable]], module: str = MODULE) -> bool:
    """Replace each ``<module>.<name>`` (default ``open_instruct.data_loader``) with
    ``wrap(original)``, once: now if the module is imported, else when it is. False when
    open-instruct is not installed."""
    if "open_instruct" not in sys.modules:
        try:
            if importlib.util.find_spec("open_instruct") is None:  # finds the package, runs nothing
                return False
        except (ImportError, ValueError):
            return False
    _wrappers.setdefault(module, {}).update(wrappers)
    _after_import.when_imported(module, _patch_module)
    return True


def _patch_module(module: Any) -> None:
    for name, wrap in _wrappers.get(module.__name__, {}).items():
        original = getattr(module, name, None)
        if original is None or getattr(original, "__rtrace_wrapped__", False):
            continue
        # the original's module, name and qualified name: pickled, the wrapper is a reference
        # to the module attribute it replaces (see the module docstring)
        new = functools.update_wrapper(wrap(original), original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        setattr(module, name, new)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def argument(fn: Callable, args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    """The argument ``name`` of a call ``fn(*args, **kwargs)``, by ``fn``'s signature
    (positional or keyword); None when not given."""
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    try:
        return sig.bind_partial(*args, **kwargs).arguments.get(name)
    except TypeError:
        return kwargs.get(name)


def query_of(dataset: Any, index: Any) -> Any:
    """A prompt's token ids as ``process_group`` reads them: ``dataset[index][INPUT_IDS_PROMPT_KEY]``."""
    key = importlib.import_module(MODULE).INPUT_IDS_PROMPT_KEY
    return dataset[index][key]


def text_envs(base_env_config: Any, dataset: Any) -> Callable[[Any], frozenset]:
    """The names of the text environments a prompt's rollout ran with, by dataset index: its
    env config as ``add_prompt_to_generator`` builds it (``_merge_env_config`` of the run's
    ``base_env_config`` and the prompt's ``env_config`` column), the entries with
    ``is_text_env``. A dataset row is read only when the dataset has that column."""
    module = importlib.import_module(MODULE)
    base = frozenset(_text_names(base_env_config))
    columns = getattr(dataset, "column_names", None)
    per_row = dataset is not None and (columns is None or module.ENV_CONFIG_KEY in columns)
    cache: dict[Any, frozenset] = {}

    def of(index: Any) -> frozenset:
        if not per_row or index is None:
            return base
        found = cache.get(index)
        if found is None:
            row = dataset[index]
            own = row.get(module.ENV_CONFIG_KEY) if hasattr(row, "get") else None
            found = cache[index] = base if own is None else frozenset(
                _text_names(module._merge_env_config(base_env_config, own)))
        return found

    return of


def _text_names(env_config: Any) -> list[str]:
    entries = getattr(env_config, "env_configs", None) or {}
    return [name for name, entry in entries.items() if getattr(entry, "is_text_env", False)]


def _caller(name: str, depth: int) -> Any:
    """The frame of the nearest caller named ``name`` within ``depth`` frames above the
    function calling this one, or None."""
    frame: Any = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == name:
            return frame
        frame = frame.f_back
    return None


def called_from_evaluation(depth: int = 3) -> bool:
    """Is the call being wrapped made by ``maybe_evaluate`` (evaluation) rather than the
    data preparation loop (training)? The call carries no flag: its caller tells."""
    return _caller("maybe_evaluate", depth) is not None


def drops_truncated(depth: int = 3) -> bool:
    """Will the caller drop the completions that did not finish with ``stop``? The data
    preparation loop passes what ``accumulate_inference_batches`` returns to
    ``maybe_mask_truncated_completions(result, batch, self.config.mask_truncated_completions)``;
    evaluation drops none."""
    frame = _caller("_data_preparation_loop", depth)
    config = getattr(frame.f_locals.get("self"), "config", None) if frame is not None else None
    return bool(getattr(config, "mask_truncated_completions", False))


def stale_result(depth: int = 2) -> Any:
    """The result ``accumulate_inference_batches`` asked ``result_is_stale`` about (its local
    ``result``: the call is ``result_is_stale(result.model_step, ...)``), or None."""
    frame = _caller("accumulate_inference_batches", depth)
    return frame.f_locals.get("result") if frame is not None else None


def sync_version(depth: int = 3) -> Any:
    """The step ``perform_weight_sync`` publishes (the engines' new ``model_step``), read from
    its caller: ``weight_sync_thread``'s ``target_model_step``, or the trainer's
    ``global_step`` in ``VLLMWeightSyncCallback.post_step``; None from any other caller."""
    frame = _caller("weight_sync_thread", depth)
    if frame is not None:
        return frame.f_locals.get("target_model_step")
    frame = _caller("post_step", depth)
    trainer = getattr(frame.f_locals.get("self"), "trainer", None) if frame is not None else None
    return getattr(trainer, "global_step", None)
