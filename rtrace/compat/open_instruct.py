"""open-instruct: ``rtrace.compat.open_instruct.install()`` traces each step's generations.

::

    import rtrace.compat.open_instruct
    rtrace.compat.open_instruct.install()   # in the process running grpo_fast.main, and via Ray's
                                             # worker_process_setup_hook in the DataPreparationActor

open-instruct gathers a step's generations in ``accumulate_inference_batches`` — training in
the ``DataPreparationActor``, evaluation in ``grpo_utils.maybe_evaluate`` — as one
``GenerationResult`` (``responses``, ``masks``, ``finish_reasons``, ``request_info``...) and a
``Batch`` (``queries``, ``indices``, ``scores``, ``model_steps``). Each sample becomes a
trajectory (:func:`log_batch`): its query, its response cut into turns, the finish reason, the
score as reward. Coordinates (docs/frameworks/open-instruct.md):

* ``step``: the trainer's step. The data preparation actor counts training steps from 0
  while the trainer (its logs, checkpoints, ``maybe_evaluate``) counts from 1: a training
  call's ``training_step`` s is step s + 1; an evaluation's ``training_step`` T is step T;
* ``validate`` for the evaluation call; ``sample_index`` = the dataset index's dense index
  in the step; ``rollout_n`` = the sample's place among that index's samples; ``group_id``
  = the dataset index; ``policy_version`` = the sample's ``model_step``.

Filtered groups. With ``filter_zero_std_samples`` (on by default) ``process_group`` drops a
group whose scores all agree (every sample solved, or none) before the function returns:
those are traced too, from the group's own ``GenerationResult``, with ``extra.filtered`` =
``zero_std`` (open-instruct trains on none of them).

Who wrote which tokens. ``masks`` is a loss mask: 0 on a tool's output only with
``mask_tool_use`` (the default); without it the tool's tokens are 1 like the model's. So a
response whose mask has a 0 is cut by it (1s the model's turns, 0s the tools'), a response
in which no tool ran is the model's, and a response of all 1s in which a tool ran is one
turn of role ``unknown``: nothing open-instruct keeps says where its tool output is. Each
turn's ``rl.loss_tokens`` is its count of 1s.

The trainer's tokenizer (the function's ``tokenizer`` argument) is handed to rtrace:
token2text decodes the ids unless ``RTRACE_TOKEN2TEXT=0``.

Per-token values: vLLM's logprobs of each response (``GenerationResult.logprobs``) become
its generations' ``logprob`` arrays and its ``masks`` the ``loss_mask`` arrays
(docs/token-values.md); the trainer's own logprobs are computed later, in the learner
actors, on packed sequences: not traced.

:func:`log_batch` can also be called by hand with a ``GenerationResult`` and its ``Batch``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable

from .. import _setup, _stats
from ..instrumentation.turns import PromptIndex, Turn, admit, sample_state, submit
from . import _open_instruct_private, token_rows

__all__ = ["install", "log_batch", "FILTERED"]

_index = PromptIndex()
#: ``extra.filtered`` of a group ``filter_zero_std_samples`` dropped
FILTERED = "zero_std"
#: the groups process_group filtered during the accumulate call running in this context:
#: (the group's GenerationResult, its query ids)
_FILTERED: ContextVar["list[tuple[Any, Any]] | None"] = ContextVar("rtrace_oi_filtered", default=None)


def install() -> bool:
    """Wrap ``open_instruct.data_loader.accumulate_inference_batches`` (and ``process_group``,
    to see the groups it filters). Idempotent; usable as Ray's ``worker_process_setup_hook``.
    False when open-instruct does not import."""
    done = _open_instruct_private.patch(_wrap, _wrap_group)
    if not done:
        _stats.warn_once("open-instruct-missing", "rtrace.compat.open_instruct.install(): open_instruct does not "
                         "import; nothing is traced")
    return done


def _wrap(original: Callable) -> Callable:
    def accumulate(*args: Any, **kwargs: Any) -> Any:
        if not _setup.is_enabled():
            return original(*args, **kwargs)
        filtered: list[tuple[Any, Any]] = []
        token = _FILTERED.set(filtered)
        try:
            out = original(*args, **kwargs)
        finally:
            _FILTERED.reset(token)
        try:
            _setup.offer_tokenizer(_open_instruct_private.argument(original, args, kwargs, "tokenizer"))
            validate = _open_instruct_private.called_from_evaluation()
            step = trainer_step(_open_instruct_private.argument(original, args, kwargs, "training_step"), validate)
            result, batch = out[0], out[1]
            if batch is not None and getattr(result, "responses", None) is not None:
                log_batch(result, batch, step=step, validate=validate)
            for group, query in filtered:
                log_group(group, query, step=step, validate=validate, filtered=FILTERED)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("open-instruct-log", "rtrace.compat.open_instruct could not trace a batch",
                             exc_info=True)
        return out

    return accumulate


def _wrap_group(original: Callable) -> Callable:
    def process_group(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        filtered = _FILTERED.get()
        if group is None and filtered is not None:
            # the one None return: filter_zero_std_samples and every score alike
            try:
                result = _open_instruct_private.argument(original, args, kwargs, "result")
                dataset = _open_instruct_private.argument(original, args, kwargs, "dataset")
                filtered.append((result, _open_instruct_private.query_of(dataset, result.index)))
            except Exception:
                _stats.incr("internal_errors")
                _stats.warn_once("open-instruct-filtered", "rtrace.compat.open_instruct could not read a filtered "
                                 "group", exc_info=True)
        return group

    return process_group


def trainer_step(training_step: Any, validate: bool) -> int | None:
    """rtrace's step for an ``accumulate_inference_batches`` call: the trainer's numbering
    (the data preparation actor's 0-based training step + 1; evaluation's as given)."""
    if not isinstance(training_step, int) or isinstance(training_step, bool):
        return None
    return training_step if validate else training_step + 1


def log_batch(result: Any, batch: Any, *, step: int | None, validate: bool = False,
              name: str = "open_instruct_sample") -> int:
    """One trajectory per sample of a step's ``GenerationResult`` and ``Batch``.

    Args:
        step: rtrace's step, in the trainer's numbering (see the module docstring;
            :func:`trainer_step` converts an ``accumulate_inference_batches`` argument).

    Returns:
        How many were queued (after the per-step sampling).
    """
    n = len(result.responses)
    indices = list(batch.indices) if batch.indices is not None else [None] * n
    scores = list(batch.scores) if batch.scores is not None else [None] * n
    versions = list(batch.model_steps) if batch.model_steps else [None] * n
    seen: dict[Any, int] = {}
    states, traced = [], []
    for i in range(n):
        index = indices[i]
        rollout_n = seen.get(index, 0)
        seen[index] = rollout_n + 1
        st = _sample(result, i, batch.queries[i], index, rollout_n, scores[i], versions[i], step, validate, name, None)
        if st is not None:
            states.append(st)
            traced.append((i, st.coords))
    return _submit(result, states, traced)


def log_group(result: Any, query: Any, *, step: int | None, validate: bool = False, filtered: str | None = None,
              name: str = "open_instruct_sample") -> int:
    """One trajectory per sample of one prompt's ``GenerationResult`` (a group
    ``accumulate_inference_batches`` did not return: ``filtered`` says why)."""
    n = len(result.responses)
    scores = list(result.reward_scores) if result.reward_scores is not None else [None] * n
    states, traced = [], []
    for i in range(n):
        st = _sample(result, i, query, result.index, i, scores[i], result.model_step, step, validate, name, filtered)
        if st is not None:
            states.append(st)
            traced.append((i, st.coords))
    return _submit(result, states, traced)


def _submit(result: Any, states: list[Any], traced: list[tuple[int, dict[str, Any]]]) -> int:
    """Queue the samples' trajectories, their per-token values first (waiting when they
    arrive): vLLM's logprobs of each response (``result.logprobs``: 0 on a tool's tokens, NaN
    on the end token open-instruct adds to an empty response) as ``logprob``, its ``masks``
    as ``loss_mask``; none when the generation kept no logprobs."""
    logprobs = result.logprobs
    if logprobs and len(logprobs) == len(result.responses):
        token_rows.send(traced, {"logprob": list(logprobs), "loss_mask": list(result.masks)})
    return submit(states)


#: on each trajectory's root: open-instruct generates with vLLM (its engines: the GenAI
#: conventions' gen_ai.provider.name of the rollout and its chat spans, docs/semconv.md)
_ROOT = {"rtrace.trainer": "open-instruct", "gen_ai.provider.name": "vllm"}


def _sample(result: Any, i: int, query: Any, index: Any, rollout_n: int, score: Any, version: Any, step: Any,
            validate: bool, name: str, filtered: str | None) -> Any:
    extra: dict[str, Any] = {"dataset_index": index}
    if filtered is not None:
        extra["filtered"] = filtered
    coords: dict[str, Any] = {
        "step": step, "validate": bool(validate), "rollout_n": rollout_n,
        "sample_index": _index.index(validate, step, index if index is not None else ("row", id(result), i)),
        "group_id": None if index is None else str(index),
        "policy_version": version if isinstance(version, int) and not isinstance(version, bool) else None,
        "extra": extra}
    if not admit(coords):
        return None
    turns = _turns(list(result.responses[i]), list(result.masks[i]), result.finish_reasons[i],
                   _tool_ran(result.request_info, i))
    return sample_state(coords, list(query), turns, score, name=name,
                        root_attributes=_ROOT)


def _tool_ran(info: Any, i: int) -> bool | None:
    """Did a tool run in sample ``i`` (``request_info.num_calls`` / ``tool_calleds``)? None:
    not known."""
    if info is None:
        return None
    for values in (getattr(info, "num_calls", None), getattr(info, "tool_calleds", None)):
        if values is not None and i < len(values):
            return bool(values[i])
    return None


def _turns(ids: list[int], mask: list[int], finish: str | None, tool_ran: bool | None) -> list[Turn]:
    """The response as turns (see the module docstring: who wrote which tokens), each with
    its count of trained-on tokens."""
    if len(mask) != len(ids) or all(mask):
        # no 0 in the loss mask: it says nothing of authorship (mask_tool_use=False gives a
        # tool's output 1s too); the model's alone when no tool ran, else unknown
        role = "assistant" if tool_ran is False else "unknown"
        trained = sum(1 for v in mask if v) if len(mask) == len(ids) else None
        return [Turn(role, ids, finish_reason=finish, loss_tokens=trained)] if ids else []
    runs: list[tuple[bool, int, int]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or bool(mask[k]) != bool(mask[start]):
            runs.append((bool(mask[start]), start, k))
            start = k
    last = max((i for i, run in enumerate(runs) if run[0]), default=None)
    return [Turn("assistant", ids[lo:hi], finish_reason=finish if i == last else None, loss_tokens=hi - lo) if model
            else Turn("tool", ids[lo:hi], name="tool", loss_tokens=0) for i, (model, lo, hi) in enumerate(runs)]
