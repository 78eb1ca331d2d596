"""AReaL: ``rtrace.compat.areal.install()`` traces every episode AReaL's workflows run.

::

    import rtrace.compat.areal
    rtrace.compat.areal.install()       # once per process that runs workflows, before rollouts

Every ``arun_episode`` of a workflow the remote inference engine runs — each member of a
GRPO group (``GroupedRolloutWorkflow``), or the episode itself when ``group_size == 1``;
training and evaluation; single-turn (``RLVRWorkflow``) or multi-turn
(``MultiTurnWorkflow``, agents) — becomes one trajectory, and each ``engine.agenerate``
inside it a generation span with real times: the prompt ids the engine received, the
output ids, the stop reason, the weight version of the output tokens, and the engine's
per-token logprobs (``output_logprobs``) as the generation's ``logprob`` array. The reward is the
one the episode returns (its ``rewards``); token2text decodes the ids in rtrace's worker
with the workflow's tokenizer (or the request's), which ``install()`` hands to rtrace
(unless ``RTRACE_TOKEN2TEXT=0``), and a prompt the loop extends between generations (MultiTurnWorkflow's retry message) is a
message of the conversation.

Coordinates (docs/frameworks/areal.md):

* ``validate``: AReaL's ``WorkflowContext.is_eval`` of the task;
* ``step`` and ``policy_version``: the engine's weight version when the episode starts
  (``PPOTrainer`` sets version ``global_step + 1`` after each step, so in synchronous
  training the version is the step the rollouts are for); each generation span also
  carries the oldest version of its output tokens;
* ``sample_index``: the task's dense index in its (validate, step) (one task per data item:
  the group's members share it); ``rollout_n``: the member's index in its group, 0 alone;
* ``group_id`` and ``extra.prompt_id``: the item's ``query_id`` / ``id`` when it has one, else
  a short hash of its prompt (``messages``): the same at every step the prompt returns.

Weight updates: ``PPOTrainer`` pauses its rollout engine, updates the weights on the inference
servers, then tells the engine their version (``set_version(global_step + 1)``): a weight update
is marked there (``rtrace.mark_weight_update``), version and step = that version, the one the
episodes started after it carry (their ``step`` and ``policy_version``), with ``duration_ms``
from the engine's ``pause()`` to ``set_version()`` when it was paused. The same version set on a
second engine (the evaluation engine) is not marked again.

Which methods are patched: :mod:`rtrace.compat._areal_private`. In single-controller mode
workflows run in AReaL's rollout worker processes: ``install()`` must run there (with Ray:
``worker_process_setup_hook``; or from the workflow module, which every worker imports).
"""

from __future__ import annotations

import hashlib
import time
from contextvars import ContextVar
from typing import Any, Callable

from .. import _setup, _stats
from ..instrumentation import record_reward, rollout_context, traced_generation
from ..instrumentation.turns import PromptIndex
from . import _areal_private, weight_sync

__all__ = ["install"]

#: the member counter of the group whose members are being started in this task
_GROUP: ContextVar["_Counter | None"] = ContextVar("rtrace_areal_group", default=None)
_index = PromptIndex()
_MARK = "__rtrace_instrumented__"


class _Counter:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        k, self.n = self.n, self.n + 1
        return k


def install() -> bool:
    """Patch AReaL's remote inference engine and grouped workflow. Idempotent; usable as
    Ray's ``worker_process_setup_hook``. Returns False when AReaL does not import."""
    found = _areal_private.classes()
    if found is None:
        _stats.warn_once("areal-missing", "rtrace.compat.areal.install(): AReaL does not import; nothing is traced")
        return False
    _areal_private.patch(*found, resolve=_wrap_resolve, group_run=_wrap_group, agenerate=_wrap_agenerate,
                         set_version=_wrap_set_version, pause=_wrap_pause)
    return True


# ----------------------------------------------------------------------------- weight updates
#: the last version marked in this process (the trainer sets it on its rollout engine and on
#: its evaluation engine: one update), and when each engine was paused for an update
_marked: list[Any] = [None]
_paused: dict[int, float] = {}


def _wrap_pause(original: Callable) -> Callable:
    def pause(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if len(_paused) > 64:  # engines paused and never given a version: forgotten
            _paused.clear()
        _paused[id(self)] = time.perf_counter()
        return out

    return pause


def _wrap_set_version(original: Callable) -> Callable:
    def set_version(self: Any, version: Any, *args: Any, **kwargs: Any) -> Any:
        paused = _paused.pop(id(self), None)
        out = original(self, version, *args, **kwargs)
        if version != _marked[0] and isinstance(version, int) and not isinstance(version, bool):
            _marked[0] = version
            # the update ran while the engine was paused: its length, when the trainer paused it
            extra = {"duration_ms": round((time.perf_counter() - paused) * 1000, 3)} if paused is not None else {}
            weight_sync.mark(version, version, name="areal", **extra)
        return out

    return set_version


# ----------------------------------------------------------------------------- workflows
def _wrap_resolve(original: Callable) -> Callable:
    def resolve(self: Any, *args: Any, **kwargs: Any) -> Any:
        workflow = original(self, *args, **kwargs)
        try:
            _instrument(workflow)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("areal-instrument", "rtrace.compat.areal could not instrument a workflow",
                             exc_info=True)
        return workflow

    return resolve


def _instrument(workflow: Any) -> None:
    """Make each episode of ``workflow`` (or of a group's member workflow) a trajectory:
    its ``arun_episode`` is wrapped on the instance, once."""
    found = _areal_private.classes()
    target = _areal_private.member_workflow(workflow) if found and isinstance(workflow, found[1]) else workflow
    if getattr(target, _MARK, False):
        return
    # the workflow's tokenizer (RLVRWorkflow, MultiTurnWorkflow keep theirs): token2text
    # decodes with it unless turned off (docs/token2text.md)
    _setup.offer_tokenizer(getattr(target, "tokenizer", None))
    original = target.arun_episode

    def arun_episode(engine: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        coro = original(engine, data, *args, **kwargs)
        group = _GROUP.get()
        # members are created in order by the group's gather: the index is taken now
        return _episode(coro, engine, data, group.next() if group is not None else 0)

    target.arun_episode = arun_episode
    setattr(target, _MARK, True)


def _wrap_group(original: Callable) -> Callable:
    async def grouped(self: Any, engine: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        token = _GROUP.set(_Counter())
        try:
            return await original(self, engine, data, *args, **kwargs)
        finally:
            _GROUP.reset(token)

    return grouped


async def _episode(coro: Any, engine: Any, data: Any, member: int) -> Any:
    if not _setup.is_enabled():
        return await coro
    try:
        validate, task_id = _areal_private.task_context()
        version = _version(engine)
        prompt = _prompt_id(data)
        coords: dict[str, Any] = {"step": version, "sample_index": _index.index(validate, version, task_id),
                                  "rollout_n": member, "validate": validate, "group_id": prompt,
                                  "policy_version": version, "prompt_id": prompt}
    except Exception:
        _stats.incr("internal_errors")
        _stats.warn_once("areal-coords", "rtrace.compat.areal could not read an episode's coordinates",
                         exc_info=True)
        return await coro
    with rollout_context(**coords):
        result = await coro
        reward = _reward(result)
        if reward is not None:
            record_reward(reward)
    return result


def _version(engine: Any) -> int | None:
    get = getattr(engine, "get_version", None)
    try:
        value = get() if callable(get) else None
    except Exception:
        return None
    return int(value) if isinstance(value, int) else None


def _prompt_id(data: Any) -> str | None:
    if isinstance(data, dict):
        for key in ("query_id", "id", "uid", "index"):
            value = data.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return str(value)
        prompt = data.get("messages", data.get("prompt"))
        if prompt is not None:
            return "p-" + hashlib.blake2b(repr(prompt).encode("utf-8", "replace"), digest_size=6).hexdigest()
    return None


def _reward(result: Any) -> Any:
    """The reward of one episode's result: its ``rewards`` (a one-element tensor, as AReaL's
    workflows return it), or None (a rejected episode, or a result without it)."""
    if isinstance(result, dict):
        return result.get("rewards")
    return None


# ----------------------------------------------------------------------------- generations
class _Generation:
    """One ``agenerate`` call, traced as a generation (the call object is ``self``: not
    captured; the prompt ids are)."""

    __slots__ = ("call", "resp")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.resp: Any = None

    @traced_generation(name="agenerate")
    async def run(self, prompt_ids: list[int]) -> dict[str, Any]:
        resp = self.resp = await self.call()
        versions = [v for v in (getattr(resp, "output_versions", None) or ()) if isinstance(v, int) and v >= 0]
        out: dict[str, Any] = {"response_ids": list(resp.output_tokens), "finish_reason": resp.stop_reason}
        if versions:
            out["policy_version"] = min(versions)
        logprobs = getattr(resp, "output_logprobs", None)
        if logprobs:  # the engine's per-token logprobs: the generation's `logprob` array (docs/token-values.md)
            out["logprobs"] = logprobs
        return out


def _wrap_agenerate(original: Callable) -> Callable:
    async def agenerate(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        from ..instrumentation import current_coordinates

        if not _setup.is_enabled() or not current_coordinates():
            return await original(self, req, *args, **kwargs)  # outside an episode: not traced
        _setup.offer_tokenizer(getattr(req, "tokenizer", None))  # a workflow without .tokenizer: the request's
        gen = _Generation(lambda: original(self, req, *args, **kwargs))
        await gen.run(list(req.input_ids))
        return gen.resp

    return agenerate
