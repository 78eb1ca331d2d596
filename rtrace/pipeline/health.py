"""Rollout health: checks for the silent data bugs of agentic RL, in rtrace's own threads.

A trainer that trains on data which is not what the model generated, or not what the
reward saw, does not crash: its loss curve only looks a little worse. rtrace holds, per
trajectory, every generation's token ids, the tool calls and results, the reward, the
annotations and the RL coordinates, so it checks them where they are assembled (the
worker thread, or the collector), never in the traced call. Each finding is
``{"check": <name>, "detail": <what is wrong, where>}`` in ``Trajectory.health`` (empty
when healthy); docs/health.md explains each check, its causes in real trainers and fixes.

Checks (:data:`CHECKS`; all but ``retokenization`` on by default, ``RTRACE_HEALTH_CHECKS``):

* ``token_continuity``: in a token-in-token-out loop, turn k+1's prompt ids start with
  turn k's prompt ids + response ids (its final stop token may be left out: loops that
  continue one assistant message drop it); a break means the conversation was re-tokenized
  (chat template re-rendered, special tokens stripped) and the trainer's log-probs are
  not those of what was sampled. The turn and first differing position are reported,
  with the decoded text around it when a tokenizer is set.
* ``retokenization`` (off by default: one ``encode`` per generation): decoding a
  response and encoding the text again does not give back its ids.
* ``reward``: none recorded or annotated by export; not finite; given to a trajectory
  whose last generation is empty; two orders of magnitude off the other rewards of its
  GRPO group (one rollout scored 0/1, another 0-100).
* ``generation``: an empty response; ids that decode to no text, or text without ids; a
  truncated final turn (finish reason ``length``); tool-call markup in a response after
  which no tool ran (a call that failed to parse); an assistant tool call without a tool
  result; a tool whose result is empty.
* ``staleness``: ``step - policy_version`` above ``RTRACE_HEALTH_MAX_STALENESS`` (the value
  is on every root that has both, as ``rl.staleness``).
* ``coordinates``: two trajectories of one step with the same ``(sample_index,
  rollout_n, validate)``; and, when the step is done, groups with more or fewer rollouts
  than the step's usual group size (in the step metrics and the step's rollouts table:
  the trajectories were written by then).
* ``capture_gap``: a generation recorded without what training needs, with the reason
  (the capture gateway's ``rtrace.capture_gap`` attribute: the upstream returned no token
  ids, the answer was cut or too large, ...; docs/gateway.md).

A *segment* (the part of a trajectory another process ran, written on its own in one
process; the collector joins them) is checked for continuity and generations only: its
reward and coordinates are those of the driver's part.

Two phases, because of what each needs: :meth:`HealthChecker.check_state` runs on a
finished trajectory's converted spans before the per-step selection (so
``RTRACE_KEEP_UNHEALTHY`` can keep unhealthy ones past the cap), in arrival order (so
duplicate coordinates and a group's reward scale are seen); :meth:`check_ids` runs on the
kept trajectories while their token ids are there (retokenization, the decoded text
around a continuity break), :meth:`check_text` after token2text and the conversation.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Any, Callable, Iterable

from .. import _stats
from ..config import HEALTH_CHECKS
from ..trajectory import SpanRecord, Trajectory, chat_argument, response_text
from .records import start_end

__all__ = ["CHECKS", "DEFAULT_CHECKS", "HealthChecker", "finding", "group_key"]

CHECKS = HEALTH_CHECKS  # declared in config (which imports nothing of the pipeline)
DEFAULT_CHECKS = tuple(c for c in CHECKS if c != "retokenization")

#: Steps whose coordinates and group rewards are remembered (older ones are forgotten).
_STEPS_KEPT = 64
#: Coordinates remembered per step; beyond, duplicates of a step are not looked for (counted).
_PER_STEP = 200_000
#: Tokens of decoded text shown on each side of a continuity break.
_CONTEXT_TOKENS = 8
#: Tool-call markup of common chat templates (Qwen / Hermes ``<tool_call>``, Llama-3.1
#: ``<|python_tag|>``, Mistral ``[TOOL_CALLS]``, DeepSeek ``<｜tool▁call▁begin｜>``).
TOOL_MARKUP = re.compile(r"<tool_call>|<\|python_tag\|>|\[TOOL_CALLS\]|<｜tool▁call▁begin｜>")


#: The reward check's finding for a trajectory written without a reward. The worker drops
#: it when the reward came while the sample held the trajectory (worker.Pipeline._export).
NO_REWARD = "no reward recorded or annotated by the time it was written"


def finding(check: str, detail: str) -> dict[str, str]:
    return {"check": check, "detail": detail}


def group_key(coords: dict[str, Any]) -> Any:
    group = coords.get("group_id")
    return group if group is not None else coords.get("sample_index")


def _gens(records: Iterable[SpanRecord]) -> list[SpanRecord]:
    return sorted([r for r in records if r.kind == "generation"], key=start_end)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _magnitude(x: float) -> int:
    """0 for |x| <= 1, else the number of digits before the point (10 -> 2, 87 -> 2)."""
    return 0 if abs(x) <= 1 else int(math.floor(math.log10(abs(x)))) + 1


class _StepMemory:
    __slots__ = ("coords", "groups", "kinds", "full")

    def __init__(self) -> None:
        self.coords: dict[tuple, int] = {}
        #: group -> {magnitude class: first reward seen of that class}. The first rollout of
        #: a group to arrive sets its scale: when that one is the outlier, the others are the
        #: ones flagged (the finding still says the group mixes scales)
        self.groups: dict[Any, dict[int, float]] = {}
        #: group -> the kind of its first reward ("bool" or "number")
        self.kinds: dict[Any, str] = {}
        self.full = False


class HealthChecker:
    """The checks of one pipeline (worker thread only).

    Args:
        checks: the enabled check names (a subset of :data:`CHECKS`).
        max_staleness: the largest ``step - policy_version`` that is not reported.
        tokenizer: returns the tokenizer (or None), read when a check needs one.
    """

    def __init__(self, checks: Iterable[str], max_staleness: int = 1,
                 tokenizer: Callable[[], Any] = lambda: None) -> None:
        self.checks = frozenset(checks)
        self.max_staleness = max_staleness
        self.tokenizer = tokenizer
        self._steps: OrderedDict[tuple[bool, Any], _StepMemory] = OrderedDict()

    # ------------------------------------------------------------------ phase 1
    def check_state(self, state: Any) -> None:
        """Check a finished trajectory's spans, reward and coordinates (a
        :class:`~rtrace.pipeline.records.TrajectoryState`); findings go to ``state.health``."""
        out: list[dict[str, str]] = list(state.health)
        try:
            self._check_state(state, out)
        finally:
            if out:
                state.health = out

    def _check_state(self, state: Any, out: list[dict[str, str]]) -> None:
        records = state.records
        gens = _gens(records)
        on = self.checks
        if "token_continuity" in on:
            self._continuity(gens, out)
        if "generation" in on:
            self._generation(records, gens, out)
        if "capture_gap" in on:
            for k, gen in enumerate(gens, 1):
                gap = gen.attributes.get("rtrace.capture_gap")
                if gap:
                    out.append(finding("capture_gap", f"turn {k}: {gap}"))
        coords = state.coords
        if state.kind == "segment":
            # the part of a trajectory that ran in another process (rtrace.extract): its
            # reward and coordinates belong to the driver's part, written on its own
            return
        if "reward" in on:
            reward = state.annotations["reward"] if "reward" in state.annotations else (
                state.reward if state.has_reward else None)
            self._reward(reward, gens, coords, out)
        if "staleness" in on:
            stale = _staleness(coords)
            if stale is not None and stale > self.max_staleness:
                out.append(finding("staleness", f"step {coords.get('step')} - policy_version "
                                                f"{coords.get('policy_version')} = {stale} > {self.max_staleness} "
                                                "(RTRACE_HEALTH_MAX_STALENESS)"))
        if "coordinates" in on:
            self._duplicate(coords, state.trace_id, out)

    def _continuity(self, gens: list[SpanRecord], out: list) -> None:
        prev = None
        for k, gen in enumerate(gens, 1):
            if prev is not None and gen.prompt_ids is not None:
                expected = prev.prompt_ids + prev.response_ids
                got = gen.prompt_ids
                # A loop may drop the reply's final stop token to continue the same assistant
                # message (SkyRL's single-turn mode): nothing sampled is then re-tokenized.
                if got[:len(expected)] != expected and not (
                        prev.response_ids and got[:len(expected) - 1] == expected[:-1]):
                    pos = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected),
                                                                                                   len(got)))
                    want = expected[pos] if pos < len(expected) else None
                    have = got[pos] if pos < len(got) else None
                    out.append(finding("token_continuity",
                                       f"turn {k}: its prompt does not continue turn {k - 1}'s prompt + response "
                                       f"at token {pos} of {len(expected)} (expected id {want}, got {have})"))
                    gen.attributes["rtrace.health.break"] = [pos, k]  # for the decoded context (check_ids)
            prev = gen if gen.prompt_ids is not None and gen.response_ids is not None else None

    def _generation(self, records: list[SpanRecord], gens: list[SpanRecord], out: list) -> None:
        for k, gen in enumerate(gens, 1):
            if gen.response_ids is not None and not gen.response_ids:
                out.append(finding("generation", f"turn {k}: empty response (0 tokens)"))
        if gens:
            reasons = gens[-1].attributes.get("gen_ai.response.finish_reasons") or ()
            if "length" in reasons:
                out.append(finding("generation", f"turn {len(gens)} (the final one) was truncated: finish reason "
                                                 "length"))
        for rec in records:
            if rec.kind == "tool" and rec.status != "error" and rec.input is not None and rec.output in (None, ""):
                name = rec.attributes.get("gen_ai.tool.name") or rec.name
                out.append(finding("generation", f"tool {name}: empty result"))

    def _reward(self, reward: Any, gens: list[SpanRecord], coords: dict[str, Any], out: list) -> None:
        if reward is None:
            out.append(finding("reward", NO_REWARD))
            return
        group = group_key(coords)
        memory = self._memory(coords) if group is not None else None
        if isinstance(reward, (int, float)):  # a bool too
            kind = "bool" if isinstance(reward, bool) else "number"
            if memory is not None:
                kinds = memory.kinds.setdefault(group, kind)
                if kinds != kind:
                    out.append(finding("reward", f"reward {reward!r} is a {kind} in group {group!r}, whose first "
                                                 f"reward was a {kinds} (a correctness flag mixed with scores?)"))
                    return
        value = _number(reward)
        if value is None:
            return  # not a number: counted as reward_errors, kept as outcome reward_raw
        if not math.isfinite(value):
            out.append(finding("reward", f"reward is {value!r}"))
            return
        if gens and gens[-1].response_ids is not None and not gens[-1].response_ids:
            out.append(finding("reward", f"reward {value!r} given to a trajectory whose last generation is empty"))
        if memory is None:
            return
        classes = memory.groups.setdefault(group, {})
        mine = _magnitude(value)
        for other_class, other in classes.items():
            if abs(other_class - mine) >= 2:
                out.append(finding("reward", f"reward {value!r} is on another scale than reward {other!r} of its "
                                             f"group {group!r} (two or more orders of magnitude apart)"))
                return  # an outlier does not set its group's scale
        classes.setdefault(mine, value)

    def _duplicate(self, coords: dict[str, Any], trace_id: int, out: list) -> None:
        index = coords.get("sample_index")
        if index is None:
            return
        memory = self._memory(coords)
        key = (index, coords.get("rollout_n"))
        seen = memory.coords.get(key)
        if seen is not None:
            out.append(finding("coordinates", f"same (step {coords.get('step')}, sample_index {index}, rollout_n "
                                              f"{coords.get('rollout_n')}, validate "
                                              f"{bool(coords.get('validate'))}) as trace {seen:032x}"))
        elif len(memory.coords) < _PER_STEP:
            memory.coords[key] = trace_id  # (its hex only in a finding)
        elif not memory.full:
            memory.full = True
            _stats.incr("health_steps_too_large")

    def _memory(self, coords: dict[str, Any]) -> _StepMemory:
        key = (bool(coords.get("validate")), coords.get("step"))
        memory = self._steps.get(key)
        if memory is None:
            memory = self._steps[key] = _StepMemory()
            if len(self._steps) > _STEPS_KEPT:
                self._steps.popitem(last=False)
        return memory

    # ------------------------------------------------------------------ phase 2
    def check_ids(self, trajectories: list[Trajectory]) -> None:
        """With the token ids still on the spans (before token2text drops them): the text
        around each continuity break, and retokenization."""
        tok = None
        for traj in trajectories:
            for span in traj.spans:
                where = span.attributes.pop("rtrace.health.break", None)
                if span.kind != "generation":
                    continue
                if where is not None and traj.health:
                    tok = tok or self.tokenizer()
                    if tok is not None:
                        _decoded_context(tok, traj, span, where)
                if "retokenization" in self.checks and span.response_ids:
                    tok = tok or self.tokenizer()
                    if tok is not None:
                        _retokenization(tok, traj, span)

    def check_text(self, trajectories: list[Trajectory]) -> None:
        """With the decoded text and the conversation: ids without text and text without
        ids, tool-call markup after which no tool ran, tool calls without a result."""
        if "generation" not in self.checks:
            return
        for traj in trajectories:
            order = sorted(traj.spans, key=start_end)  # stable: ties keep the tree order
            k = 0
            unran: set[Any] = set()
            for pos, span in enumerate(order):
                if span.kind != "generation":
                    continue
                k += 1
                text = response_text(span)
                n = span.attributes.get("gen_ai.usage.output_tokens")
                calls = _structured_calls(span)
                if isinstance(n, int) and n > 0 and text == "" and not calls:
                    # (a reply that is only a parsed tool call has empty content: not a finding)
                    traj.health.append(finding("generation", f"turn {k}: {n} response tokens decode to no text"))
                elif n == 0 and text:
                    traj.health.append(finding("generation", f"turn {k}: text ({len(text)} chars) without "
                                                             "response token ids"))
                ran = False
                for later in order[pos + 1:]:
                    if later.kind == "generation":
                        # an agent that runs its tools itself (through the capture gateway) sends
                        # their results with its next model call
                        ran = ran or _sends_tool_results(later)
                        break
                    ran = ran or later.kind == "tool"
                if calls and not ran:
                    names = ", ".join(sorted({c for c in calls if c})) or "?"
                    traj.health.append(finding("generation", f"turn {k}: the model called {len(calls)} tool(s) "
                                                             f"({names}) but no tool ran"))
                    unran.update(_call_ids(span))  # reported once: not again as calls without a result
                elif text and TOOL_MARKUP.search(text):
                    turn = traj.turn_of(span)
                    if not ran and not (turn or {}).get("tool_calls"):
                        traj.health.append(finding("generation", f"turn {k}: tool-call markup in the response but "
                                                                 "no tool ran (a call that failed to parse?)"))
            answered, asked = set(), []  # one pass over the conversation
            for msg in traj.messages:
                if isinstance(msg, dict):
                    role = msg.get("role")
                    if role == "tool":
                        answered.add(msg.get("tool_call_id"))
                    elif role == "assistant" and msg.get("tool_calls"):
                        asked.append(msg["tool_calls"])
            for tool_calls in asked:
                for call in tool_calls:
                    cid = call.get("id") if isinstance(call, dict) else None
                    if cid is not None and cid not in answered and cid not in unran:
                        name = (call.get("function") or {}).get("name")
                        traj.health.append(finding("generation", f"tool call {cid} ({name}) has no tool result"))


def _call_ids(span: SpanRecord) -> list[Any]:
    """The ids of the tool calls a generation returned already parsed."""
    out = span.output
    calls = out.get("tool_calls") if isinstance(out, dict) else None
    return [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _sends_tool_results(span: SpanRecord) -> bool:
    """A generation whose request carries tool results (a ``role: tool`` message)."""
    chat = chat_argument(span.input)
    return chat is not None and any(m.get("role") == "tool" for m in chat[1])


def _structured_calls(span: SpanRecord) -> list[str]:
    """The names of the tool calls a generation returned already parsed (an OpenAI-style
    ``tool_calls`` list in its output or its ``message``); empty when none."""
    out = span.output
    if not isinstance(out, dict):
        return []
    calls = out.get("tool_calls")
    if calls is None and isinstance(out.get("message"), dict):
        calls = out["message"].get("tool_calls")
    if not isinstance(calls, list):
        return []
    names = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = (fn.get("name") if isinstance(fn, dict) else None) or (call.get("name") if isinstance(call, dict)
                                                                      else None)
        names.append(name if isinstance(name, str) else "")
    return names


def _staleness(coords: dict[str, Any]) -> int | None:
    step, version = coords.get("step"), coords.get("policy_version")
    if isinstance(step, int) and isinstance(version, int) and not isinstance(step, bool) \
            and not isinstance(version, bool):
        return step - version
    return None


def staleness(coords: dict[str, Any]) -> int | None:
    """``step - policy_version`` when both are integers (``rl.staleness`` on the root)."""
    return _staleness(coords)


def _decode(tok: Any, ids: list[int]) -> str:
    try:
        return tok.decode(ids, skip_special_tokens=False)
    except TypeError:
        return tok.decode(ids)


def _decoded_context(tok: Any, traj: Trajectory, span: SpanRecord, where: list[int]) -> None:
    """Add the decoded text on both sides of a continuity break to its finding."""
    pos, turn = where
    ids = span.prompt_ids or []
    try:
        before = _decode(tok, ids[max(0, pos - _CONTEXT_TOKENS):pos])
        after = _decode(tok, ids[pos:pos + _CONTEXT_TOKENS])
    except Exception:
        return
    for f in traj.health:
        if f["check"] == "token_continuity" and f["detail"].startswith(f"turn {turn}:"):
            f["detail"] += f"; text at the break: {before!r} | {after!r}"
            return


def _retokenization(tok: Any, traj: Trajectory, span: SpanRecord) -> None:
    ids = span.response_ids
    try:
        text = _decode(tok, ids)
        encoded = tok.encode(text, add_special_tokens=False) if callable(getattr(tok, "encode", None)) else None
    except Exception:
        _stats.incr("health_errors")
        return
    if encoded is None or list(encoded) == list(ids):
        return
    pos = next((i for i, (a, b) in enumerate(zip(ids, encoded)) if a != b), min(len(ids), len(encoded)))
    turn = 1 + sum(1 for s in traj.spans if s.kind == "generation" and s.start_ns < span.start_ns)
    traj.health.append(finding("retokenization", f"turn {turn}: decoding the {len(ids)} response ids and encoding "
                                                 f"the text gives {len(encoded)} ids, first different at {pos}"))
