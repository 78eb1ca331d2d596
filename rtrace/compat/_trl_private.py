"""Every private TRL name rtrace touches, each behind one small function.

TRL's ``GRPOTrainer`` (1.16) gives a ``TrainerCallback`` no view of its completions: the
callback events carry the model, the tokenizer, the optimizer and the dataloaders, never
the trainer, and the completions, per-function rewards and advantages exist only inside
``GRPOTrainer._generate_and_score_completions`` and its ``_logs`` buffer. So
:class:`rtrace.compat.trl.RTraceCallback` finds its trainer once, at ``on_init_end``, and
wraps that one method *on that instance*. Nothing else in rtrace touches a TRL private
name (``tests/test_private_apis.py`` checks the compat modules for it), and the canary
test in ``tests/frameworks/test_trl.py`` checks each name of :data:`PRIVATE_NAMES`
against the installed TRL.

Names are ``"module:attribute.path"``; instance attributes are checked on a real trainer.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "find_trainer", "wrap_scoring", "scoring_logs", "process_index", "num_processes",
           "eos_token_ids"]

PRIVATE_NAMES = (
    # The method that generates, scores and computes advantages of a generation batch
    # (training and evaluation); its return value holds the local token ids.
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions",
    # What it appended to its log buffer: prompts, completions, per-function rewards and
    # the advantages, gathered across processes (instance attribute).
    "trl.trainer.grpo_trainer:GRPOTrainer._logs",
    # The stop tokens of a completion (instance attribute).
    "trl.trainer.grpo_trainer:GRPOTrainer.eos_token_ids",
    # Python's frame API, to find the trainer that calls on_init_end.
    "sys:_getframe",
)


def find_trainer(cls: type, depth: int = 12) -> Any:
    """The instance of ``cls`` whose code called us, up to ``depth`` frames up (None if
    none): ``Trainer.__init__`` calls ``callback_handler.on_init_end``, which calls the
    callback, so the trainer is the ``self`` of a frame two or three levels up.

    Why private: no callback event carries the trainer, and ``CallbackHandler`` keeps
    no reference to it.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back
    return None


def wrap_scoring(trainer: Any, after: Callable[[Any, Any, Any], None]) -> bool:
    """Wrap ``trainer._generate_and_score_completions`` (on the instance only) so that
    ``after(trainer, inputs, output)`` runs after each call; False when TRL has no such
    method. ``after`` must not raise into TRL (the callback catches everything).

    Why private: the one place where a batch's completions, rewards and advantages are
    all known; TRL has no hook there.
    """
    original = getattr(trainer, "_generate_and_score_completions", None)
    if original is None or getattr(original, "__rtrace_wrapped__", False):
        return original is not None

    def scored(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(inputs, *args, **kwargs)
        after(trainer, inputs, output)
        return output

    scored.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
    trainer._generate_and_score_completions = scored
    return True


def scoring_logs(trainer: Any, n: int) -> dict[str, Any]:
    """The last ``n`` entries the latest scoring appended to ``trainer._logs``: prompts,
    completions, ``rewards`` (reward function name -> values) and ``advantages``, in the
    order of the gathered batch (every process's samples, process by process).

    Why private: ``_logs`` is the trainer's completion-table buffer (a deque per column,
    bounded by the generation batch size).
    """
    logs = trainer._logs

    def tail(values: Any) -> list[Any]:
        values = list(values)
        return values[len(values) - n:] if n <= len(values) else [None] * (n - len(values)) + values

    return {"prompt": tail(logs["prompt"]), "completion": tail(logs["completion"]),
            "advantages": tail(logs["advantages"]),
            "rewards": {name: tail(values) for name, values in logs["rewards"].items()}}


def process_index(trainer: Any) -> int:
    """This process's rank among the trainer's processes (0 alone)."""
    return int(getattr(getattr(trainer, "accelerator", None), "process_index", 0) or 0)


def num_processes(trainer: Any) -> int:
    """How many processes the trainer runs on (1 alone)."""
    return int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1)


def eos_token_ids(trainer: Any) -> set[int]:
    """The token ids that end a completion (TRL's ``eos_token_ids``)."""
    ids = getattr(trainer, "eos_token_ids", None) or ()
    return {int(i) for i in ids}
