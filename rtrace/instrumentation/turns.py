"""The batch/turn core: a finished sample (its prompt and turns) as a trajectory.

``rtrace.log_rollout_batch`` and the trainer adapters (``rtrace.compat``: SkyRL, TRL,
open-instruct) all hold finished samples rather than a decorated agent loop: a prompt's
token ids, then turns — runs of tokens the policy wrote (``assistant``) or the
environment inserted (``tool`` / ``user``) — with a reward, a finish reason, the policy
version, sometimes real times. This module turns one such sample into the
:class:`~rtrace.pipeline.records.TrajectoryState` the pipeline finishes like any other
(sampling, annotations, health, token2text, messages, sinks), and keeps the exact
coordinates of samples that arrive in batches:

* :class:`Turn` and :func:`sample_state`: a sample as spans — a root, then one span per
  turn (``generation`` for the policy's turns, ``tool`` for the others), the first
  generation holding the prompt ids, every turn its own ids (token2text decodes them in
  the worker). Real times when the caller has them; else synthetic (1 µs per turn, the
  root marked ``rtrace.synthetic_times``);
* :class:`PromptIndex`: a dense ``sample_index`` per prompt uid within a (validate,
  step), in order of first arrival, across calls (several batches of one step, an
  evaluation split into batches), so no divisibility rule is needed;
* :func:`submit`: sample (the per-step cap) and queue.

Ids come from :mod:`rtrace._ids` (a private generator seeded from ``os.urandom``, again in a
forked child): drawing from the module-level ``random`` would move the trainer's seeded state.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Hashable, NamedTuple, Sequence

from .. import _ids, _stats
from ..pipeline.records import TrajectoryState
from ..trajectory import SpanRecord
from . import _state

__all__ = ["Turn", "sample_state", "submit", "admit", "PromptIndex", "SEGMENT_NS"]

SEGMENT_NS = 1_000  # synthetic duration of one turn span
ROLES = ("assistant", "tool", "user", "unknown")


class Turn(NamedTuple):
    """One turn of a sample.

    Attributes:
        role: ``assistant`` (the policy wrote these tokens), ``tool`` or ``user`` (the
            environment inserted them: a tool's output, a retry prompt, template glue), or
            ``unknown``: the policy's tokens and perhaps the environment's, the trainer
            keeping nothing that says which (a loss mask of all 1s over a response in which
            a tool ran). An ``unknown`` turn is a generation span with ``rtrace.role`` =
            ``unknown`` (its tokens counted in ``rtrace.tokens``, not as output tokens), and a
            message of role ``unknown``.
        ids: its token ids.
        version: the policy version that wrote it (assistant turns).
        finish_reason: why the generation stopped (``stop``, ``length`` ...).
        loss_tokens: how many of its tokens the trainer trains on (None: unknown).
        start_ns, end_ns: real times (epoch ns), when known.
        name: a tool turn's tool name (default: its role).
        text: the turn's text when it has no ids.
    """

    role: str
    ids: list[int] | None
    version: int | None = None
    finish_reason: str | None = None
    loss_tokens: int | None = None
    start_ns: int | None = None
    end_ns: int | None = None
    name: str | None = None
    text: str | None = None


def admit(coords: dict[str, Any]) -> bool:
    """The per-step sampler's decision for a sample with these coordinates (False with
    tracing off): ask before building it, so a sampled-out sample costs nothing more."""
    rt = _state.get_runtime()
    return rt is not None and rt.sampler.admit(coords)


def submit(states: Sequence[TrajectoryState]) -> int:
    """Queue built samples to the pipeline; returns how many were queued (0 with tracing off)."""
    rt = _state.get_runtime()
    if rt is None or not states:
        return 0
    _stats.incr("batch_trajectories", len(states))
    return rt.intake.submit_states(list(states))


def _span_id() -> str:
    return format(_ids.span_id(), "016x")


def sample_state(coords: dict[str, Any], prompt: list[int] | None, turns: Sequence[Turn], reward: Any = None,
                 *, name: str = "rollout", start_ns: int | None = None, capture: bool = True,
                 root_attributes: dict[str, Any] | None = None, source: str = "tensor_batch",
                 outcome: dict[str, Any] | None = None) -> TrajectoryState:
    """A finished sample as a trajectory the pipeline finishes like any other.

    Args:
        coords: the RL coordinates (``step``, ``sample_index``, ``rollout_n``, ``validate``,
            ``group_id``, ``policy_version``, ``extra``); ``policy_version`` defaults to
            the oldest version of the assistant turns.
        prompt: the prompt's token ids (on the first generation span).
        turns: the turns, in order.
        reward: the reward (any number; None: none recorded).
        start_ns: when the sample started (epoch ns; default now); turns without times
            follow it, 1 µs each.
        capture: keep token ids (``RTRACE_CAPTURE``).
        root_attributes: more attributes of the root span.
        source: the root's ``rtrace.source`` (how the conversation is rebuilt:
            pipeline/messages.py reads turns of ``tensor_batch`` samples by role).
        outcome: ``record_reward``-style outcome values (``correct``, per-function scores ...).
    """
    now = time.time_ns() if start_ns is None else start_ns
    real = all(t.start_ns is not None and t.end_ns is not None for t in turns) and bool(turns)
    root_id = _span_id()
    root_attrs: dict[str, Any] = {"rtrace.source": source}
    if not real:
        root_attrs["rtrace.synthetic_times"] = True
    loss = [t.loss_tokens for t in turns if t.loss_tokens is not None]
    if loss:
        root_attrs["rl.loss_tokens"] = sum(loss)  # 0: the trainer trains on none of it
    root_attrs.update(root_attributes or {})
    spans: list[SpanRecord] = []
    oldest: int | None = None
    context = len(prompt or ())
    first_gen = True
    end = now
    for k, turn in enumerate(turns):
        if real:
            start, stop = turn.start_ns, turn.end_ns
        else:
            start = now + SEGMENT_NS * k
            stop = start + SEGMENT_NS
        end = max(end, stop)
        assistant = turn.role == "assistant"
        unknown = turn.role == "unknown"  # the policy began it: a generation, its authorship unknown
        attrs: dict[str, Any] = {"rtrace.role": turn.role}
        n_ids = len(turn.ids) if turn.ids is not None else None
        span = SpanRecord(span_id=_span_id(), parent_id=root_id,
                          name="generation" if assistant else "response" if unknown else (turn.name or "observation"),
                          kind="generation" if assistant or unknown else "tool", start_ns=start, end_ns=stop,
                          attributes=attrs)
        if turn.loss_tokens is not None:
            attrs["rl.loss_tokens"] = turn.loss_tokens
        if assistant or unknown:
            attrs["gen_ai.operation.name"] = "chat"
            attrs["gen_ai.usage.input_tokens"] = context
            if n_ids is not None:
                attrs["gen_ai.usage.output_tokens" if assistant else "rtrace.tokens"] = n_ids
            if turn.finish_reason is not None:
                attrs["gen_ai.response.finish_reasons"] = [str(turn.finish_reason)]
            if turn.version is not None:
                attrs["rl.policy_version"] = turn.version
                oldest = turn.version if oldest is None else min(oldest, turn.version)
            if capture:
                if first_gen and prompt is not None:
                    span.prompt_ids = list(prompt)
                span.response_ids = turn.ids
            first_gen = False
        else:
            attrs["gen_ai.operation.name"] = "execute_tool"
            attrs["gen_ai.tool.name"] = turn.name or turn.role
            if n_ids is not None:
                attrs["rtrace.tokens"] = n_ids
            if capture:
                span.response_ids = turn.ids
        if turn.text is not None:
            span.output = turn.text
        context += n_ids or 0
        spans.append(span)
    if first_gen and capture and prompt:
        # No generated tokens (truncated at the prompt): keep the prompt on an empty generation.
        spans.append(SpanRecord(span_id=_span_id(), parent_id=root_id, name="generation", kind="generation",
                                start_ns=now, end_ns=now + SEGMENT_NS, prompt_ids=list(prompt), response_ids=[],
                                attributes={"rtrace.role": "assistant", "gen_ai.operation.name": "chat",
                                            "gen_ai.usage.input_tokens": len(prompt),
                                            "gen_ai.usage.output_tokens": 0}))
    if not real:
        end = now + SEGMENT_NS * max(1, len(turns))
    spans.insert(0, SpanRecord(span_id=root_id, parent_id=None, name=name, kind="rollout", start_ns=now, end_ns=end,
                               attributes=root_attrs))
    if oldest is not None and coords.get("policy_version") is None:
        coords["policy_version"] = oldest
    # The pipeline finishes this state like any other: rl.* stamped on every span (a
    # generation's own rl.policy_version wins), the reward on the root.
    state = TrajectoryState(_ids.trace_id(), int(root_id, 16), name, "rollout", coords)
    state.created_ns = now
    state.records = spans
    state.root_at = time.monotonic()
    if reward is not None:
        state.reward, state.has_reward = reward, True
    if outcome:
        state.outcome = dict(outcome)
    return state


class PromptIndex:
    """Dense ``sample_index`` values for prompt uids, per (validate, step), in order of first
    arrival and across calls: the first uid seen in step 3's evaluation is 0, the next new
    one 1, ... however the batches of that step are split. With :meth:`claim`, also the
    uid's rollout numbers, counted on across calls: a uid that comes twice in a step (a
    prompt drawn again, a batch gathered again) gets new ones, not the first's again.
    Thread-safe; the last 64 steps of each stream are remembered."""

    _STEPS = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (validate, step) -> uid -> [its dense index, rollout numbers claimed]
        self._steps: OrderedDict[tuple[bool, Any], dict[Hashable, list[int]]] = OrderedDict()

    def index(self, validate: bool, step: Any, uid: Hashable) -> int:
        return self.claim(validate, step, uid, 0)[0]

    def claim(self, validate: bool, step: Any, uid: Hashable, count: int = 1) -> tuple[int, int]:
        """``uid``'s dense index in the (validate, step), and the first of ``count`` rollout
        numbers taken for it: 0 at its first claim, then counting on."""
        key = (bool(validate), step)
        with self._lock:
            uids = self._steps.get(key)
            if uids is None:
                uids = self._steps[key] = {}
                if len(self._steps) > 2 * self._STEPS:
                    self._steps.popitem(last=False)
            found = uids.get(uid)
            if found is None:
                found = uids[uid] = [len(uids), 0]
            first = found[1]
            found[1] += count
            return found[0], first
