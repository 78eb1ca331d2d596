"""Every private TRL name rtrace touches, each behind one small function.

TRL's ``GRPOTrainer`` (1.16) gives a ``TrainerCallback`` no view of its completions: the
callback events carry the model, the tokenizer, the optimizer and the dataloaders, never
the trainer, and the completions and per-function rewards exist only inside
``GRPOTrainer._generate_and_score_completions`` (which returns the token ids and the
advantages) and the ``_calculate_rewards`` it calls (given the prompts and completions,
returning every function's score). So :class:`rtrace.compat.trl.RTraceCallback` finds its
trainer once, at ``on_init_end``, and wraps those two methods *on that instance*. Not
``_logs``, the completions table's buffer: its deques hold ``generation_batch_size``
entries, fewer than an evaluation batch larger than the generation batch. Where TRL
publishes new weights to vLLM (``use_vllm``), the callback wraps ``sync_weights`` of the
trainer's ``vllm_generation`` *on that instance* (:func:`wrap_weight_sync`): TRL creates it
after ``on_init_end``, so the callback wraps it at ``on_train_begin``, before the first
generation. Nothing else in rtrace touches a TRL private
name (``tests/test_private_apis.py`` checks the compat modules for it), and the canary
test in ``tests/frameworks/test_trl.py`` checks each name of :data:`PRIVATE_NAMES`
against the installed TRL.

Names are ``"module:attribute.path"``; instance attributes are checked on a real trainer.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["PRIVATE_NAMES", "find_trainer", "wrap_scoring", "wrap_weight_sync", "process_index", "num_processes",
           "eos_token_ids"]

PRIVATE_NAMES = (
    # The method that generates, scores and computes advantages of a generation batch
    # (training and evaluation); its return value holds the local token ids.
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions",
    # What it calls to score a batch: (inputs, prompts, completions, completion_ids) of this
    # process in, every reward function's score for the batch gathered across processes out.
    "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards",
    # The stop tokens of a completion (instance attribute).
    "trl.trainer.grpo_trainer:GRPOTrainer.eos_token_ids",
    # Python's frame API, to find the trainer that calls on_init_end.
    "sys:_getframe",
    # Where GRPOTrainer publishes new weights to vLLM (use_vllm): the trainer's vLLM backend
    # (an instance attribute, set after on_init_end, only with use_vllm) and its weight push,
    # called before a generation when global_step moved (_generate_single_turn, and before a
    # rollout_func); the weights are in vLLM when it returns.
    "trl.trainer.grpo_trainer:GRPOTrainer.use_vllm",
    "trl.trainer.grpo_trainer:GRPOTrainer.vllm_generation",
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights",
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


def wrap_scoring(trainer: Any, after: Callable[[Any, Any, Any, dict[str, Any]], None]) -> bool:
    """Wrap ``trainer._generate_and_score_completions`` and ``trainer._calculate_rewards``
    (on the instance only) so that ``after(trainer, inputs, output, scored)`` runs after
    each batch; ``scored`` holds what the batch's ``_calculate_rewards`` call saw and
    returned: ``prompts`` and ``completions`` (this process's, TRL's own objects: text or
    chat messages) and ``rewards`` (a ``[gathered batch, reward functions]`` tensor, NaN
    where a function returned None); empty when TRL did not call it. False when TRL has
    no ``_generate_and_score_completions``. ``after`` must not raise into TRL (the
    callback catches everything).

    Why private: the one place where a batch's completions, rewards and advantages are
    all known; TRL has no hook there.
    """
    original = getattr(trainer, "_generate_and_score_completions", None)
    if original is None or getattr(original, "__rtrace_wrapped__", False):
        return original is not None
    seen: dict[str, Any] = {}
    rewards_fn = getattr(trainer, "_calculate_rewards", None)
    if rewards_fn is not None and not getattr(rewards_fn, "__rtrace_wrapped__", False):
        def calculated(*args: Any, **kwargs: Any) -> Any:
            out = rewards_fn(*args, **kwargs)
            seen["prompts"] = args[1] if len(args) > 1 else kwargs.get("prompts")
            seen["completions"] = args[2] if len(args) > 2 else kwargs.get("completions")
            seen["rewards"] = out
            return out

        calculated.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        trainer._calculate_rewards = calculated

    def scored(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.clear()
        output = original(inputs, *args, **kwargs)
        got = dict(seen)
        seen.clear()  # no reference to the batch is kept past it
        after(trainer, inputs, output, got)
        return output

    scored.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
    trainer._generate_and_score_completions = scored
    return True


def wrap_weight_sync(trainer: Any, wrap: Callable[[Callable], Callable]) -> bool:
    """Replace ``trainer.vllm_generation.sync_weights`` with ``wrap(original)`` on that
    instance, once. False when the trainer does not generate with vLLM.

    Why private: TRL has no hook where its weights reach vLLM; ``vllm_generation`` is an
    instance attribute of ``GRPOTrainer`` that only ``use_vllm`` creates.
    """
    generation = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
    original = getattr(generation, "sync_weights", None)
    if original is None:
        return False
    if not getattr(original, "__rtrace_wrapped__", False):
        new = wrap(original)
        new.__rtrace_wrapped__ = True  # type: ignore[attr-defined]
        generation.sync_weights = new
    return True


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
