"""Every open-instruct name rtrace touches, each behind one small function.

open-instruct gathers each step's generations in
``open_instruct.data_loader.accumulate_inference_batches`` — for training inside the
``DataPreparationActor`` (a Ray actor), for evaluation from ``grpo_utils.maybe_evaluate`` —
and offers no hook there. :mod:`rtrace.compat.open_instruct` wraps that module function
(both callers look it up in the module at each call). The names and fields are checked
against the real code, read with ``ast`` into ``tests/frameworks/open_instruct_names.json``
(open-instruct cannot be imported here: its rollout path needs vLLM).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "patch", "called_from_evaluation"]

PRIVATE_NAMES = (
    # gathers a step's GenerationResults into (result, batch, reward_metrics, stats)
    "open_instruct.data_loader:accumulate_inference_batches",
    # its evaluation caller (the training one is DataPreparationActor._data_preparation_loop)
    "open_instruct.grpo_utils:maybe_evaluate",
    # Python's frame API, to tell the evaluation call from the training one
    "sys:_getframe",
)


def patch(wrap: Callable[[Callable], Callable]) -> bool:
    """Replace ``open_instruct.data_loader.accumulate_inference_batches`` with
    ``wrap(original)``, once; False when open-instruct does not import."""
    try:
        module = importlib.import_module("open_instruct.data_loader")
    except Exception:
        return False
    original = module.accumulate_inference_batches
    if not getattr(original, "__rtrace_wrapped__", False):
        new = wrap(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        new.__wrapped__ = original  # type: ignore[attr-defined]
        module.accumulate_inference_batches = new
    return True


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
