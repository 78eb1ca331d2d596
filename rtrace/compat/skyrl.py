"""SkyRL: ``rtrace.compat.skyrl.install()`` traces every trajectory SkyRL's generator makes.

::

    import rtrace.compat.skyrl
    rtrace.compat.skyrl.install()        # once, where the trainer runs, before training

Each trajectory of ``SkyRLGymGenerator.generate`` — training, evaluation, step-wise or not
— becomes one rtrace trajectory built from what its agent loop really did, turn by turn:
each engine call is a generation span (its prompt ids, the ids it returned, its stop
reason, its real start and end), each ``env.step`` a tool span named after the
environment (the observation's ids and text, the step reward, its real time). The
reward, the stop reason and the loss mask are SkyRL's own output's; the conversation is
the prompt's messages, the model's replies and the environment's observations. The
generator's tokenizer is handed to rtrace: token2text decodes the ids unless
``RTRACE_TOKEN2TEXT=0``.

Coordinates come from the input batch: ``step`` = ``batch_metadata.global_step``,
``validate`` = ``batch_metadata.training_phase == "eval"``, ``group_id`` = the
trajectory id's ``instance_id``, ``rollout_n`` = its ``repetition_id``, ``sample_index`` =
the instance's dense index in its (step, phase) across the generate calls of that step
(:class:`~rtrace.instrumentation.turns.PromptIndex`: no divisibility rule, evaluation
batches included). Step-wise rows (one per turn) are grouped back into their trajectory.

Written vs trained on: turns come from the loop, not the loss mask; the loss mask says
what SkyRL trains on (``rl.loss_tokens`` per turn and on the root: 0 for a response
``apply_overlong_filtering`` masked out).

Per-token values: when the generator's sampling params ask for logprobs, SkyRL's
``rollout_logprobs`` become each generation's ``logprob`` array and its ``loss_masks`` the
``loss_mask`` array (docs/token-values.md), cut into the turns; a response whose tokens do
not lay out the turns gets none (counted: ``skyrl_token_values_unaligned``).

Weight updates: where SkyRL's trainer publishes its weights to the inference engines
(``RayPPOTrainer.sync_policy_weights_to_inference_engines``, whose refs its caller waits for;
``FullyAsyncRayPPOTrainer.async_sync_policy_weights_to_inference_engines``), a weight update is
marked once the policy workers' broadcast finished (``rtrace.mark_weight_update``): version and
step = the trainer's ``global_step`` then, the steps trained (0 before training, ``g`` after
step ``g``), with ``duration_ms``. The rollouts the generator makes after it (in the trainer's
process) carry that version as ``policy_version``; none before the first.

Which methods are wrapped (SkyRL has no tracing hook): :mod:`rtrace.compat._skyrl_private`.
With Ray, the generator lives in the process that runs the trainer: call ``install()``
there (the entrypoint), or pass it as Ray's ``worker_process_setup_hook``
(``rtrace.compat.skyrl.install``). Tracing follows ``rtrace.configure`` /
``RTRACE_EXPORTER`` (off: the wrappers call straight through).
"""

from __future__ import annotations

import contextvars

import time
from contextvars import ContextVar
from typing import Any, Callable

from .. import _setup, _stats
from ..instrumentation.turns import PromptIndex, Turn, admit, sample_state, submit
from . import _after_import, _skyrl_private, token_rows, weight_sync

__all__ = ["install"]

#: the generate() call in progress (its per-trajectory records), seen by its agent loops' tasks
_BATCH: ContextVar["_Batch | None"] = ContextVar("rtrace_skyrl_batch", default=None)
#: the trajectory whose agent loop runs in this task
_SLOT: ContextVar["_Trajectory | None"] = ContextVar("rtrace_skyrl_slot", default=None)

_index = PromptIndex()


class _Turn:
    __slots__ = ("prompt_ids", "output_ids", "text", "stop", "t0", "t1", "obs", "obs_ids", "reward", "done", "e0",
                 "e1", "env")

    def __init__(self, prompt_ids: list[int], t0: int) -> None:
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.text: str | None = None
        self.stop: str | None = None
        self.t0, self.t1 = t0, t0
        self.obs: list[Any] = []
        self.obs_ids: list[int] | None = None
        self.reward: Any = None
        self.done = False
        self.e0 = self.e1 = None
        self.env: str | None = None


class _Trajectory:
    """What one agent loop did, turn by turn (filled by the wrappers, in its own task)."""

    def __init__(self) -> None:
        self.turns: list[_Turn] = []
        self.start = time.time_ns()


#: the policy version this process's trainer last published (None before any): the weights the
#: generator's rollouts are made with, in SkyRL where the generator runs in the trainer's process
_published: list[int | None] = [None]


class _Batch:
    def __init__(self) -> None:
        self.slots: list[_Trajectory] = []
        self.version = _published[0]

    def slot(self) -> _Trajectory:
        traj = _Trajectory()
        self.slots.append(traj)
        return traj


# ----------------------------------------------------------------------------- wrappers
def _wrap_generate(original: Callable) -> Callable:
    async def traced_batch(self: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not _setup.is_enabled():
            return await original(self, input_batch, *args, **kwargs)
        try:  # a client whose class is not patched (skyrl 0.4, a custom client): on the instance
            _skyrl_private.wrap_client(self, _wrap_engine_generate)
        except Exception:
            _stats.incr("internal_errors")
        # the generator's tokenizer: token2text decodes with it unless turned off (docs/token2text.md)
        _setup.offer_tokenizer(getattr(self, "tokenizer", None))
        batch = _Batch()
        token = _BATCH.set(batch)
        try:
            output = await original(self, input_batch, *args, **kwargs)
        finally:
            _BATCH.reset(token)
        try:
            _log(self, input_batch, output, batch)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("skyrl-log", "rtrace.compat.skyrl could not trace a generated batch", exc_info=True)
        return output

    return traced_batch


def _wrap_agent_loop(original: Callable) -> Callable:
    # A plain function: generate() creates the agent loops' coroutines in row order, so the
    # slot is taken here, at creation, and the coroutine runs inside it.
    def traced_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        coro = original(self, *args, **kwargs)
        batch = _BATCH.get()
        if batch is None:
            return coro
        return _in_slot(coro, batch.slot())

    return traced_loop


async def _in_slot(coro: Any, slot: _Trajectory) -> Any:
    token = _SLOT.set(slot)  # this task's context only: concurrent loops keep their own
    try:
        return await coro
    finally:
        _SLOT.reset(token)


#: set while a traced engine call runs: a client that delegates to another traced client
#: (both wrapped) records the call once
_IN_ENGINE: contextvars.ContextVar[bool] = contextvars.ContextVar("rtrace_skyrl_engine", default=False)


def _wrap_engine_generate(original: Callable) -> Callable:
    async def traced_engine(self: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        slot = _SLOT.get()
        ids = input_batch.get("prompt_token_ids") if slot is not None and isinstance(input_batch, dict) else None
        if slot is None or not ids or len(ids) != 1 or _IN_ENGINE.get():
            return await original(self, input_batch, *args, **kwargs)
        turn = _Turn(list(ids[0]), time.time_ns())
        token = _IN_ENGINE.set(True)
        try:
            out = await original(self, input_batch, *args, **kwargs)
        finally:
            _IN_ENGINE.reset(token)
        try:
            turn.t1 = time.time_ns()
            turn.output_ids = out["response_ids"][0]  # the loop may append an EOS to this very list
            turn.text = out["responses"][0]
            turn.stop = out["stop_reasons"][0]
            slot.turns.append(turn)
        except Exception:
            _stats.incr("internal_errors")
        return out

    return traced_engine


def _wrap_run_in_executor(original: Callable) -> Callable:
    async def run(self: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        slot = _SLOT.get()
        if slot is None or getattr(func, "__name__", None) != "step" or not slot.turns:
            return await original(self, func, *args, **kwargs)
        turn = slot.turns[-1]
        turn.e0 = time.time_ns()
        result = await original(self, func, *args, **kwargs)
        turn.e1 = time.time_ns()
        try:
            turn.env = type(getattr(func, "__self__", None)).__name__
            turn.obs = list(result.get("observations") or [])
            turn.reward, turn.done = result.get("reward"), bool(result.get("done"))
        except Exception:
            _stats.incr("internal_errors")
        return result

    return run


def _wrap_obs_ids(original: Callable) -> Callable:
    def obs_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids = original(self, *args, **kwargs)
        slot = _SLOT.get()
        if slot is not None and slot.turns:
            slot.turns[-1].obs_ids = list(ids)
        return ids

    return obs_ids


def install() -> list[str]:
    """Wrap SkyRL's generator (every SkyRL package that imports: ``skyrl_train``,
    ``skyrl.train``). Idempotent; usable as Ray's ``worker_process_setup_hook``.

    Returns:
        The packages patched now or before.
    """
    done = []
    for root in _skyrl_private.MODULE_ROOTS:
        found = _skyrl_private.classes(root)
        if found is None:
            continue
        _skyrl_private.patch(*found, {"batch": _wrap_generate, "loop": _wrap_agent_loop,
                                      "run_in_executor": _wrap_run_in_executor, "obs_ids": _wrap_obs_ids,
                                      "engine": _wrap_engine_generate})
        done.append(root)
        for module in _skyrl_private.TRAINER_METHODS:  # the trainer: patched when imported
            _after_import.when_imported(f"{root}.{module}", _patch_trainer)
    if not done:
        _stats.warn_once("skyrl-missing", "rtrace.compat.skyrl.install(): neither skyrl_train nor skyrl.train "
                         "imports; nothing is traced")
    return done


# ----------------------------------------------------------------------------- weight updates
def _patch_trainer(module: Any) -> None:
    _skyrl_private.patch_trainer(module, _wrap_sync if module.__name__.endswith(".trainer") else _wrap_async_sync)


def _steps_trained(trainer: Any) -> int | None:
    version = _skyrl_private.steps_trained(trainer)
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _wrap_sync(original: Callable) -> Callable:
    def sync_policy_weights_to_inference_engines(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        refs = original(self, *args, **kwargs)
        try:
            version = _steps_trained(self)
            if version is not None:
                # the trainer ray.get()s the refs at once and generates after: its next
                # rollouts are made with these weights
                _published[0] = version
                weight_sync.published_when_done([ref.future() for ref in refs], version, version, start,
                                                name="skyrl")
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("skyrl-weight-update", "rtrace.compat.skyrl could not mark a weight update",
                             exc_info=True)
        return refs

    return sync_policy_weights_to_inference_engines


def _wrap_async_sync(original: Callable) -> Callable:
    async def async_sync_policy_weights_to_inference_engines(self: Any, *args: Any, **kwargs: Any) -> Any:
        def version() -> tuple[int, int] | None:
            found = _steps_trained(self)
            if found is not None:
                _published[0] = found
            return None if found is None else (found, found)

        return await weight_sync.published_async(lambda: original(self, *args, **kwargs), version, name="skyrl")

    return async_sync_policy_weights_to_inference_engines


# ----------------------------------------------------------------------------- a batch
def _log(generator: Any, input_batch: Any, output: Any, batch: _Batch) -> None:
    meta = input_batch.get("batch_metadata")
    step = getattr(meta, "global_step", None)
    validate = getattr(meta, "training_phase", "train") == "eval"
    ids = input_batch.get("trajectory_ids")
    prompts = input_batch.get("prompts") or []
    env_classes = input_batch.get("env_classes") or []
    n_in = len(prompts)
    rows = len(output["response_ids"])
    step_wise = output.get("is_last_step") is not None
    slots = batch.slots if len(batch.slots) == n_in else None  # batched generation has no agent loop
    logprobs = output.get("rollout_logprobs")  # set when the sampling params ask for logprobs
    row = 0
    states = []
    traced: list[tuple[int, dict[str, Any]]] = []  # (its row in the columns below, coordinates)
    columns: dict[str, list[Any]] = {"logprob": [], "loss_mask": []}
    for i in range(n_in):
        tid = ids[i] if ids is not None else None
        uid = str(tid.instance_id) if tid is not None else None
        coords: dict[str, Any] = {
            "step": step, "validate": validate,
            "sample_index": _index.index(validate, step, uid) if uid is not None else _index.index(
                validate, step, ("row", id(batch), i)),
            "rollout_n": int(tid.repetition_id) if tid is not None else 0,
            "group_id": uid, "extra": {"env_class": env_classes[i] if i < len(env_classes) else None}}
        if batch.version is not None:
            coords["policy_version"] = batch.version
        if step_wise:  # one output row per turn: the rows of trajectory i
            n_rows = len(slots[i].turns) if slots is not None else 1
            mine = list(range(row, min(rows, row + max(1, n_rows))))
        else:
            mine = [i]
        row = (mine[-1] + 1) if mine else row
        if not admit(coords):
            continue
        try:
            state = _trajectory(generator, coords, output, mine, slots[i] if slots is not None else None,
                                prompts[i] if i < len(prompts) else None, step_wise)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("skyrl-row", "rtrace.compat.skyrl could not trace a trajectory", exc_info=True)
            continue
        states.append(state)
        if logprobs is not None:
            values = _row_values(state, output, logprobs, mine)
            if values is not None:
                traced.append((len(columns["logprob"]), coords))
                columns["logprob"].append(values[0])
                columns["loss_mask"].append(values[1])
    token_rows.send(traced, columns)  # before the trajectories: waiting when they arrive
    submit(states)


def _row_values(state: Any, output: Any, logprobs: Any, rows: list[int]) -> tuple[list, list] | None:
    """The trajectory's ``rollout_logprobs`` and ``loss_masks`` over its response (its rows'
    lists, joined for step-wise rows), when they lay out its turns: as long as the turns'
    tokens together (token in, token out). Else None, counted: a response SkyRL re-tokenized
    (``use_conversation_multi_turn=False`` adds an end token, a chat template rebuilt the
    history) has no place per turn for its values."""
    lp = [v for r in rows for v in logprobs[r]] if len(rows) > 1 else logprobs[rows[0]]
    mask = [v for r in rows for v in output["loss_masks"][r]] if len(rows) > 1 else output["loss_masks"][rows[0]]
    tokens = sum(len(s.response_ids) for s in state.records if s.kind in ("generation", "tool") and s.response_ids)
    if lp is None or len(lp) != tokens or len(mask) != tokens:
        _stats.incr("skyrl_token_values_unaligned")
        return None
    return lp, mask


def _number(value: Any) -> float:
    if isinstance(value, (list, tuple)):
        return float(sum(v for v in value if v))
    return float(value or 0.0)


def _trajectory(generator: Any, coords: dict[str, Any], output: Any, rows: list[int], slot: _Trajectory | None,
                prompt: Any, step_wise: bool) -> Any:
    reward = sum(_number(output["rewards"][r]) for r in rows)
    stop = (output.get("stop_reasons") or [None] * (rows[-1] + 1))[rows[-1]]
    loss = [output["loss_masks"][r] for r in rows]
    trained = sum(sum(1 for v in m if v) for m in loss)
    if slot is None or not slot.turns:
        # no loop seen (batched, single-turn generation): the row as one prompt and one response
        r = rows[0]
        response = list(output["response_ids"][r])
        turns = [Turn("assistant", response, finish_reason=stop, loss_tokens=trained)]
        return sample_state(coords, list(output["prompt_token_ids"][r]), turns, reward, name="skyrl_trajectory",
                            root_attributes={"rtrace.trainer": "skyrl"})
    turns: list[Turn] = []
    messages: list[dict[str, Any]] = [dict(m) for m in prompt] if isinstance(prompt, list) else []
    per_turn = _loss_per_turn(slot, output, rows, step_wise)
    for k, t in enumerate(slot.turns):
        last = k == len(slot.turns) - 1
        turns.append(Turn("assistant", list(t.output_ids), finish_reason=t.stop if not last else (stop or t.stop),
                          loss_tokens=per_turn[k][0] if per_turn else None, start_ns=t.t0, end_ns=t.t1,
                          text=None))
        messages.append({"role": "assistant", "content": t.text if t.text is not None else ""})
        obs_text = "\n".join(str(m.get("content", "")) for m in t.obs if isinstance(m, dict))
        if t.obs_ids or obs_text:  # a done loop's empty observation is no turn
            turns.append(Turn("tool", list(t.obs_ids or []), loss_tokens=per_turn[k][1] if per_turn else None,
                              start_ns=t.e0 if t.e0 is not None else t.t1, end_ns=t.e1 if t.e1 is not None else t.t1,
                              name=t.env or "env", text=obs_text or None))
            messages.extend(dict(m) for m in t.obs if isinstance(m, dict))
    prompt_ids = slot.turns[0].prompt_ids
    state = sample_state(coords, prompt_ids, turns, reward, name="skyrl_trajectory", start_ns=slot.start,
                         root_attributes={"rtrace.trainer": "skyrl", "rl.loss_tokens": trained},
                         source="skyrl_loop")
    state.messages = messages
    return state


def _loss_per_turn(slot: _Trajectory, output: Any, rows: list[int], step_wise: bool) -> list[tuple[int, int]] | None:
    """(trained-on tokens of the model's reply, of the observation) per turn, read from SkyRL's
    loss mask where its rows line up with the turns (token in, token out); None otherwise."""
    if step_wise:
        out = []
        for t, r in zip(slot.turns, rows):
            mask = output["loss_masks"][r]
            n = len(t.output_ids)
            out.append((sum(1 for v in mask[:n] if v), sum(1 for v in mask[n:] if v)))
        return out if len(out) == len(slot.turns) else None
    response = list(output["response_ids"][rows[0]])
    mask = output["loss_masks"][rows[0]]
    pos, out = 0, []
    for t in slot.turns:
        n, m = len(t.output_ids), len(t.obs_ids or [])
        if response[pos:pos + n] != list(t.output_ids)[:max(0, len(response) - pos)]:
            return None
        out.append((sum(1 for v in mask[pos:pos + n] if v), sum(1 for v in mask[pos + n:pos + n + m] if v)))
        pos += n + m
    return out
