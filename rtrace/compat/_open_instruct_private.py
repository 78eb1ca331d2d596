"""Every open-instruct name rtrace touches, each behind one small function.

open-instruct gathers each step's generations in
``open_instruct.data_loader.accumulate_inference_batches`` — for training inside the
``DataPreparationActor`` (a Ray actor), for evaluation from ``grpo_utils.maybe_evaluate`` —
and offers no hook there. :mod:`rtrace.compat.open_instruct` wraps that module function
(both callers look it up in the module at each call) and ``process_group``, which it calls
(a module global too) for each prompt's group and which returns None for a group
``filter_zero_std_samples`` drops. The names and fields are checked against the real code,
read with ``ast`` into ``tests/frameworks/open_instruct_names.json`` (open-instruct cannot
be imported here: its rollout path needs vLLM).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "patch", "called_from_evaluation", "argument", "query_of"]

PRIVATE_NAMES = (
    # gathers a step's GenerationResults into (result, batch, reward_metrics, stats)
    "open_instruct.data_loader:accumulate_inference_batches",
    # one prompt's group, called by it: None when filter_zero_std_samples drops the group
    "open_instruct.data_loader:process_group",
    # the dataset column of a prompt's token ids (what process_group reads as the query)
    "open_instruct.data_loader:INPUT_IDS_PROMPT_KEY",
    # its evaluation caller (the training one is DataPreparationActor._data_preparation_loop)
    "open_instruct.grpo_utils:maybe_evaluate",
    # Python's frame API, to tell the evaluation call from the training one
    "sys:_getframe",
)


def patch(wrap: Callable[[Callable], Callable], wrap_group: Callable[[Callable], Callable]) -> bool:
    """Replace ``open_instruct.data_loader.accumulate_inference_batches`` with
    ``wrap(original)`` and ``process_group`` with ``wrap_group(original)``, once; False when
    open-instruct does not import."""
    try:
        module = importlib.import_module("open_instruct.data_loader")
    except Exception:
        return False
    for name, wrapper in (("accumulate_inference_batches", wrap), ("process_group", wrap_group)):
        original = getattr(module, name, None)
        if original is None or getattr(original, "__rtrace_wrapped__", False):
            continue
        new = wrapper(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        new.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, name, new)
    return True


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
    key = importlib.import_module("open_instruct.data_loader").INPUT_IDS_PROMPT_KEY
    return dataset[index][key]


def called_from_evaluation(depth: int = 3) -> bool:
    """Is the call being wrapped made by ``maybe_evaluate`` (evaluation) rather than the
    data preparation loop (training)? The call carries no flag: its caller tells."""
    frame: Any = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "maybe_evaluate":
            return True
        frame = frame.f_back
    return False
