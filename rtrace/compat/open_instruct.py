"""open-instruct: ``rtrace.compat.open_instruct.install()`` traces each step's generations.

::

    import rtrace.compat.open_instruct
    rtrace.compat.open_instruct.install()   # in the process running grpo_fast.main, and as Ray's
                                             # worker_process_setup_hook (the DataPreparationActor)

``install()`` imports nothing of open-instruct: ``open_instruct.data_loader`` is patched when
it is imported (:mod:`rtrace.compat._open_instruct_private`). open-instruct gathers a step's
generations in ``accumulate_inference_batches`` — training in the ``DataPreparationActor``,
evaluation in ``grpo_utils.maybe_evaluate`` — as one ``GenerationResult`` (``responses``,
``masks``, ``finish_reasons``, ``request_info``...) and a ``Batch`` (``queries``, ``indices``,
``scores``, ``model_steps``). Each sample becomes a trajectory (:func:`log_batch`): its query,
its response cut into turns, the finish reason, the score as reward. Coordinates
(docs/frameworks/open-instruct.md):

* ``step``: the trainer's step. The data preparation actor counts training steps from 0
  while the trainer (its logs, checkpoints, ``maybe_evaluate``) counts from 1: a training
  call's ``training_step`` s is step s + 1; an evaluation's ``training_step`` T is step T;
* ``validate`` for the evaluation call; ``sample_index`` = the dataset index's dense index
  in the step; ``group_id`` = the dataset index; ``rollout_n`` = the sample's place among
  the step's samples of that dataset index, in the order traced (a dataset index that comes
  twice in a step continues where the first left off); ``policy_version`` = ``model_step``.

What open-instruct does not train on is traced too, marked ``extra.filtered`` with the
reason, each of its turns ``rl.loss_tokens`` = 0 and its ``loss_mask`` all 0:
``zero_std`` (``process_group`` dropped the group: ``filter_zero_std_samples``, every score
alike), ``stale`` (``result_is_stale``: generated more than ``max_result_age_steps`` =
``async_steps`` steps before the batch), ``truncated`` (not finished with ``stop``, dropped
by ``mask_truncated_completions``; a batch of only those is gathered again at the same step).

Who wrote which tokens. ``masks`` is a loss mask: 0 on an environment's output only with
``mask_tool_use`` (the default); without it that output is 1 like the model's. So a
response whose mask has a 0 is cut by it (1s the model's turns, 0s the observations), a
response in which no tool ran is the model's, and a response of all 1s in which a tool ran
is one turn of role ``unknown``. An observation is a ``tool`` turn, or a ``user`` turn when
it is a text environment's (``TextRLEnvironment``, whose replies open-instruct inserts as
``user``): read from ``request_info.tool_call_stats`` and the prompt's env config.

The trainer's tokenizer (the function's ``tokenizer`` argument) is handed to rtrace:
token2text decodes the ids unless ``RTRACE_TOKEN2TEXT=0``. Per-token values: vLLM's logprobs
(``GenerationResult.logprobs``) become the generations' ``logprob`` arrays and the masks
their ``loss_mask`` arrays (docs/token-values.md).

Weight updates: open-instruct's broadcast of new weights to its vLLM engines
(``grpo_utils.perform_weight_sync``, in the process running ``grpo_fast.main``) is marked when it
returns (``rtrace.mark_weight_update``): version and step = the training step the engines were
sent, the ``model_step`` they stamp on what they generate next (the rollouts' ``policy_version``),
with the broadcast's ``duration_ms`` and the number of ``engines``.

:func:`log_batch` can also be called by hand with a ``GenerationResult`` and its ``Batch``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Collection, Union

from .. import _setup, _stats
from ..instrumentation.turns import PromptIndex, Turn, admit, sample_state, submit
from . import _open_instruct_private, token_rows, weight_sync

__all__ = ["install", "log_batch", "log_group", "trainer_step", "FILTERED", "STALE", "TRUNCATED"]

_index = PromptIndex()
#: ``extra.filtered`` of a group ``filter_zero_std_samples`` dropped (every score alike)
FILTERED = "zero_std"
#: ``extra.filtered`` of a result ``result_is_stale`` dropped (its policy too old)
STALE = "stale"
#: ``extra.filtered`` of a completion ``mask_truncated_completions`` dropped (not ``stop``)
TRUNCATED = "truncated"
#: the results the accumulate call running in this context dropped: (GenerationResult, reason)
_DROPPED: ContextVar["list[tuple[Any, str]] | None"] = ContextVar("rtrace_oi_dropped", default=None)

#: text environments: their names, or a function of the dataset index giving them
TextEnvs = Union[Collection[str], Callable[[Any], Collection[str]]]


def install() -> bool:
    """Wrap ``open_instruct.data_loader.accumulate_inference_batches`` (and ``process_group``
    and ``result_is_stale``, to see what it drops), and ``open_instruct.grpo_utils.
    perform_weight_sync`` (the weight broadcast: a weight update marked when it returns), now
    if those modules are imported, else when they are. Idempotent; usable as Ray's
    ``worker_process_setup_hook``. False when open-instruct is not installed."""
    done = _open_instruct_private.patch({"accumulate_inference_batches": _wrap,
                                         "process_group": _wrap_group, "result_is_stale": _wrap_stale})
    done = done and _open_instruct_private.patch({"perform_weight_sync": _wrap_sync},
                                                 _open_instruct_private.SYNC_MODULE)
    if not done:
        _stats.warn_once("open-instruct-missing", "rtrace.compat.open_instruct.install(): open_instruct is not "
                         "installed; nothing is traced")
    return done


def _wrap(original: Callable) -> Callable:
    def accumulate(*args: Any, **kwargs: Any) -> Any:
        if not _setup.is_enabled():
            return original(*args, **kwargs)
        dropped: list[tuple[Any, str]] = []
        token = _DROPPED.set(dropped)
        try:
            out = original(*args, **kwargs)
        finally:
            _DROPPED.reset(token)
        try:
            arg = lambda name: _open_instruct_private.argument(original, args, kwargs, name)  # noqa: E731
            _setup.offer_tokenizer(arg("tokenizer"))
            validate = _open_instruct_private.called_from_evaluation()
            step = trainer_step(arg("training_step"), validate)
            dataset = arg("dataset")
            envs = _open_instruct_private.text_envs(arg("base_env_config"), dataset)
            result, batch = out[0], out[1]
            if batch is not None and getattr(result, "responses", None) is not None:
                log_batch(result, batch, step=step, validate=validate, text_envs=envs,
                          mask_truncated_completions=not validate and _open_instruct_private.drops_truncated())
            for group, reason in dropped:
                log_group(group, _open_instruct_private.query_of(dataset, group.index), step=step,
                          validate=validate, filtered=reason, text_envs=envs)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("open-instruct-log", "rtrace.compat.open_instruct could not trace a batch",
                             exc_info=True)
        return out

    return accumulate


def _wrap_group(original: Callable) -> Callable:
    def process_group(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        dropped = _DROPPED.get()
        if group is None and dropped is not None:
            # the one None return: filter_zero_std_samples and every score alike
            _note(dropped, _open_instruct_private.argument(original, args, kwargs, "result"), FILTERED)
        return group

    return process_group


def _wrap_stale(original: Callable) -> Callable:
    def result_is_stale(*args: Any, **kwargs: Any) -> Any:
        stale = original(*args, **kwargs)
        dropped = _DROPPED.get()
        if stale and dropped is not None:  # accumulate_inference_batches drops the result next
            _note(dropped, _open_instruct_private.stale_result(), STALE)
        return stale

    return result_is_stale


def _wrap_sync(original: Callable) -> Callable:
    def perform_weight_sync(*args: Any, **kwargs: Any) -> Any:
        try:  # the step the engines are sent (their new model_step), from the caller: read now
            step = _open_instruct_private.sync_version()
        except Exception:
            step = None
        engines = _open_instruct_private.argument(original, args, kwargs, "vllm_engines")
        extra = {"engines": len(engines)} if isinstance(engines, (list, tuple)) else {}
        return weight_sync.published(lambda: original(*args, **kwargs),
                                     lambda: (step, step) if isinstance(step, int) else None,
                                     name="open_instruct", **extra)

    return perform_weight_sync


def _note(dropped: list[tuple[Any, str]], result: Any, reason: str) -> None:
    """Keep a result the running accumulate call drops, to trace it when the call returns."""
    if result is None:
        _stats.incr("internal_errors")
        _stats.warn_once("open-instruct-dropped", "rtrace.compat.open_instruct could not read a result "
                         "open-instruct dropped (%s)", reason)
    else:
        dropped.append((result, reason))


def trainer_step(training_step: Any, validate: bool) -> int | None:
    """rtrace's step for an ``accumulate_inference_batches`` call: the trainer's numbering
    (the data preparation actor's 0-based training step + 1; evaluation's as given)."""
    if not isinstance(training_step, int) or isinstance(training_step, bool):
        return None
    return training_step if validate else training_step + 1


def log_batch(result: Any, batch: Any, *, step: int | None, validate: bool = False,
              mask_truncated_completions: bool = False, text_envs: TextEnvs = (),
              name: str = "open_instruct_sample") -> int:
    """One trajectory per sample of a step's ``GenerationResult`` and ``Batch``.

    Args:
        step: rtrace's step, in the trainer's numbering (see the module docstring;
            :func:`trainer_step` converts an ``accumulate_inference_batches`` argument).
        mask_truncated_completions: open-instruct's setting of that name: the samples that
            did not finish with ``stop`` are marked ``extra.filtered = "truncated"`` (not
            trained on).
        text_envs: the names of the text environments (their observations are ``user``
            turns), or a function of the dataset index giving them.

    Returns:
        How many were queued (after the per-step sampling).
    """
    n = len(result.responses)
    indices = list(batch.indices) if batch.indices is not None else [None] * n
    scores = list(batch.scores) if batch.scores is not None else [None] * n
    versions = list(batch.model_steps) if batch.model_steps else [None] * n
    rows = [(i, batch.queries[i], indices[i], scores[i], versions[i],
             TRUNCATED if mask_truncated_completions and result.finish_reasons[i] != "stop" else None)
            for i in range(n)]
    return _log(result, rows, step, validate, text_envs, name)


def log_group(result: Any, query: Any, *, step: int | None, validate: bool = False, filtered: str | None = None,
              text_envs: TextEnvs = (), name: str = "open_instruct_sample") -> int:
    """One trajectory per sample of one prompt's ``GenerationResult`` (a group
    ``accumulate_inference_batches`` did not return: ``filtered`` says why; not trained on)."""
    n = len(result.responses)
    scores = list(result.reward_scores) if result.reward_scores is not None else [None] * n
    rows = [(i, query, result.index, scores[i], result.model_step, filtered) for i in range(n)]
    return _log(result, rows, step, validate, text_envs, name)


def _log(result: Any, rows: list[tuple[int, Any, Any, Any, Any, str | None]], step: Any, validate: bool,
         text_envs: TextEnvs, name: str) -> int:
    """Build and queue the rows' trajectories, their per-token values first: vLLM's logprobs
    of each response (``result.logprobs``: 0 on a tool's tokens, NaN on the end token
    open-instruct adds to an empty response) as ``logprob``, its ``masks`` as ``loss_mask``
    (all 0 for a sample not trained on); none when the generation kept no logprobs."""
    envs = text_envs if callable(text_envs) else (lambda index, names=frozenset(text_envs): names)
    states, traced = [], []
    for i, query, index, score, version, filtered in rows:
        uid = index if index is not None else ("row", id(result), i)
        sample_index, rollout_n = _index.claim(validate, step, uid)  # before admit: stable coordinates
        extra: dict[str, Any] = {"dataset_index": index}
        if filtered is not None:
            extra["filtered"] = filtered
        coords: dict[str, Any] = {
            "step": step, "validate": bool(validate), "rollout_n": rollout_n, "sample_index": sample_index,
            "group_id": None if index is None else str(index),
            "policy_version": version if isinstance(version, int) and not isinstance(version, bool) else None,
            "extra": extra}
        if not admit(coords):
            continue
        turns = _turns(list(result.responses[i]), list(result.masks[i]), result.finish_reasons[i],
                       _tool_ran(result.request_info, i), _observers(result.request_info, i, lambda: envs(index)),
                       trained=filtered is None)
        states.append(sample_state(coords, list(query), turns, score, name=name,
                                   root_attributes=_ROOT))
        traced.append((i, coords))
    logprobs = result.logprobs
    if traced and logprobs and len(logprobs) == len(result.responses):
        masks = list(result.masks)
        for i, *_, filtered in rows:
            if filtered is not None:
                masks[i] = [0] * len(masks[i])
        token_rows.send(traced, {"logprob": list(logprobs), "loss_mask": masks})
    return submit(states)


#: on each trajectory's root: open-instruct generates with vLLM (its engines: the GenAI
#: conventions' gen_ai.provider.name of the rollout and its chat spans, docs/semconv.md)
_ROOT = {"rtrace.trainer": "open-instruct", "gen_ai.provider.name": "vllm"}


def _tool_ran(info: Any, i: int) -> bool | None:
    """Did a tool run in sample ``i`` (``request_info.num_calls`` / ``tool_calleds``)? None:
    not known."""
    if info is None:
        return None
    for values in (getattr(info, "num_calls", None), getattr(info, "tool_calleds", None)):
        if values is not None and i < len(values):
            return bool(values[i])
    return None


def _observers(info: Any, i: int, text_envs: Callable[[], Collection[str]]) -> list[tuple[str, str]]:
    """The role and name of each observation (each run of 0s in the loss mask, in order).

    With a text environment, open-instruct calls it after every model turn, after the tool
    calls parsed from that turn (``process_request``): the calls of sample ``i``
    (``request_info.tool_call_stats[i]``) split into rounds at each call to it. A round that
    is that call alone, succeeded, is the environment's reply: ``user``. Any other round is a
    ``tool`` turn (a failed call's error message is inserted as ``tool``; a round of tool
    outputs and the environment's reply is one turn, open-instruct keeping no boundary).
    Without a text environment every observation is a tool's. ``text_envs()`` is asked only
    for a sample that made calls (it may read the prompt's dataset row)."""
    stats = getattr(info, "tool_call_stats", None)
    calls = list(stats[i]) if stats is not None and i < len(stats) and stats[i] else []
    envs = text_envs() if calls else ()
    if not envs:
        return []
    rounds: list[list[Any]] = [[]]
    for call in calls:
        rounds[-1].append(call)
        if call.tool_name in envs:
            rounds.append([])
    return [("user", r[0].tool_name) if len(r) == 1 and r[0].tool_name in envs and r[0].success
            else ("tool", "tool") for r in rounds if r]


def _turns(ids: list[int], mask: list[int], finish: str | None, tool_ran: bool | None,
           observers: list[tuple[str, str]], trained: bool = True) -> list[Turn]:
    """The response as turns (see the module docstring: who wrote which tokens), each with
    its count of trained-on tokens (0 for a sample not trained on)."""
    if len(mask) != len(ids) or all(mask):
        # no 0 in the loss mask: it says nothing of authorship (mask_tool_use=False gives a
        # tool's output 1s too); the model's alone when no tool ran, else unknown
        role = "assistant" if tool_ran is False else "unknown"
        loss = (sum(1 for v in mask if v) if trained else 0) if len(mask) == len(ids) else None
        return [Turn(role, ids, finish_reason=finish, loss_tokens=loss)] if ids else []
    runs: list[tuple[bool, int, int]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or bool(mask[k]) != bool(mask[start]):
            runs.append((bool(mask[start]), start, k))
            start = k
    last = max((i for i, run in enumerate(runs) if run[0]), default=None)
    turns, seen = [], 0
    for i, (model, lo, hi) in enumerate(runs):
        if model:
            turns.append(Turn("assistant", ids[lo:hi], finish_reason=finish if i == last else None,
                              loss_tokens=hi - lo if trained else 0))
        else:
            role, who = observers[seen] if seen < len(observers) else ("tool", "tool")
            seen += 1
            turns.append(Turn(role, ids[lo:hi], name=who, loss_tokens=0))
    return turns
