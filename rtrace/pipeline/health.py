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
  turn k's prompt ids + response ids (its final token may be left out when the tokenizer
  says it is a special one, an end-of-turn: loops that continue one assistant message drop
  it; without a tokenizer no token is exempt); a break means the conversation was re-tokenized
  (chat template re-rendered, special tokens stripped) and the trainer's log-probs are
  not those of what was sampled. The turn and first differing position are reported,
  with the decoded text around it when a tokenizer is set.
* ``retokenization`` (off by default: one ``encode`` per generation): decoding a
  response and encoding the text again does not give back its ids.
* ``reward``: none recorded or annotated by export (while no rollout of the run has one,
  this is said once for the run, not per rollout: ``health_reward_never_recorded``);
  recorded as None; not finite; given to a trajectory whose last generation is empty; on
  another scale than its GRPO group (a non-zero reward within [-1, 1] and one of magnitude
  20 or more times larger and above 10: one rollout scored 0/1, another 0-100); a bool
  among numbers.
* ``generation``: an empty response; ids that decode to no text, or text without ids; a
  truncated final turn (finish reason ``length``); tool-call markup in a response after
  which no tool ran (a call that failed to parse); a parsed tool call (the generation's
  own ``tool_calls``, or a tool parser's output) that no tool ran, each one, also when
  others of the same turn ran (a loop that runs only the first of parallel calls); an
  assistant tool call without a tool result (by ``tool_call_id``, by position when the
  tool messages carry none, or by a tool span's ``gen_ai.tool.call.id``); a tool whose
  result is empty.
* ``staleness``: ``step - policy_version`` above ``RTRACE_HEALTH_MAX_STALENESS`` (the value
  is on every root that has both, as ``rl.staleness``).
* ``logprob_mismatch``: the sampler's per-token logprobs against the trainer's
  (``old_logprob``) over the loss-masked tokens (pipeline/tokens.py): a finding when the
  share of tokens whose probability ratio leaves [1/``RTRACE_MISMATCH_RATIO``, ratio] is
  above ``RTRACE_MISMATCH_MAX_FRACTION``, or k3 above ``RTRACE_MISMATCH_MAX_K3``, naming the
  worst token; every trajectory with both arrays gets ``logprob_mismatch_k1`` / ``_k3`` /
  ``_max`` / ``_frac`` among its annotations (step metrics, ``RTRACE_KEEP_MISMATCH``).
* ``token_arrays``: per-token values that cannot be laid on the tokens: a row of another
  length than the response, values that are not finite, a mask that selects nothing, a
  tensor that cannot be read.
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

Numpy and torch scalars (``np.int64`` steps, an ``np.bool_`` reward) are read as the
Python values they hold in every check. Each checked trajectory lists the checks that ran
on it (``Trajectory.health_checks``), so a report can say "not run" of the others.

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
from .tokens import TOKEN_PROBLEM, Mismatch, mismatch

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
#: The reward check's finding for a reward recorded as None (a reward function that could
#: not score the answer): never dropped, the trajectory has no usable reward.
NONE_REWARD = "the reward was recorded as None (a reward function that could not score?)"
#: A non-zero reward within [-1, 1] and one at least this many times larger (and above
#: :data:`_LARGE`) in one group: two scales (0/1 and 0-100) mixed.
_SCALE_RATIO = 20.0
_LARGE = 10.0


def finding(check: str, detail: str) -> dict[str, str]:
    return {"check": check, "detail": detail}


def group_key(coords: dict[str, Any]) -> Any:
    group = coords.get("group_id")
    return group if group is not None else coords.get("sample_index")


def _gens(records: Iterable[SpanRecord]) -> list[SpanRecord]:
    return sorted([r for r in records if r.kind == "generation"], key=start_end)


_PY = frozenset((int, float, bool, str, type(None)))


def py(value: Any) -> Any:
    """A numpy or torch scalar (``np.int64``, ``np.bool_``, a 0-d tensor) as the Python value
    it holds; anything else as it is. Trainers hand such values everywhere: a check must
    read ``np.int64(5)`` as 5 and ``np.bool_(True)`` as True."""
    if type(value) in _PY:
        return value
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "shape", None) == ():
        try:
            return item()
        except Exception:  # a tensor on a device that cannot be read here
            return value
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _scale(x: float) -> str | None:
    """``unit`` for a non-zero reward within [-1, 1], ``large`` above :data:`_LARGE`, else
    None: 0 belongs to every scale, and 1 < |x| <= 10 to both a 1-10 judge and a 0-100 one."""
    a = abs(x)
    if a == 0.0:
        return None
    if a <= 1.0:
        return "unit"
    return "large" if a > _LARGE else None


class _StepMemory:
    __slots__ = ("coords", "groups", "kinds", "full")

    def __init__(self) -> None:
        self.coords: dict[tuple, int] = {}
        #: group -> (scale, the reward that set it): the first reward of a group with a scale
        #: (:func:`_scale`) sets the group's; one on the other scale is flagged and does not
        #: change it (when the first was the outlier, the others are the ones flagged: the
        #: finding still says the group mixes scales)
        self.groups: dict[Any, tuple[str, float]] = {}
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
                 tokenizer: Callable[[], Any] = lambda: None,
                 mismatch: tuple[float, float, float] = (1.05, 0.05, 0.01)) -> None:
        self.checks = frozenset(checks)
        self.max_staleness = max_staleness
        #: the logprob_mismatch check's (ratio, max fraction of tokens off, max k3)
        self.mismatch = mismatch
        self.tokenizer = tokenizer
        self._steps: OrderedDict[tuple[bool, Any], _StepMemory] = OrderedDict()
        #: a rollout of this run had a reward: from then on, a trajectory without one is a finding
        self._rewarded = False
        #: (tokenizer, its special ids) of the last tokenizer asked
        self._special: tuple[Any, frozenset[int]] = (None, frozenset())
        self._ran = tuple(c for c in CHECKS if c in self.checks)
        self._ran_segment = tuple(c for c in self._ran if c in ("token_continuity", "generation", "retokenization",
                                                                 "logprob_mismatch", "token_arrays"))

    # ------------------------------------------------------------------ phase 1
    def check_state(self, state: Any, records: bool = True, rollout: bool = True) -> None:
        """Check a finished trajectory's spans, reward and coordinates (a
        :class:`~rtrace.pipeline.records.TrajectoryState`); findings go to ``state.health``.
        A summarized rollout in collector mode is checked in two places: its records in the
        worker (``rollout=False``), its reward, staleness and coordinates in the collector,
        where its annotations and the rest of its step are (``records=False``)."""
        out: list[dict[str, str]] = list(state.health)
        try:
            self._check_state(state, out, records, rollout)
        finally:
            if out:
                state.health = out

    def _check_state(self, state: Any, out: list[dict[str, str]], check_records: bool = True,
                     rollout: bool = True) -> None:
        records = state.records
        gens = _gens(records)
        on = self.checks if check_records else frozenset()
        if "token_continuity" in on:
            self._continuity(gens, out)
        if "generation" in on:
            self._generation(records, gens, out)
        if check_records and any(g.token_values or TOKEN_PROBLEM in g.attributes for g in gens):
            self._tokens(gens, state.annotations, out)
        if "capture_gap" in on:
            for k, gen in enumerate(gens, 1):
                gap = gen.attributes.get("rtrace.capture_gap")
                if gap:
                    out.append(finding("capture_gap", f"turn {k}: {gap}"))
        coords = state.coords
        on = self.checks if rollout else frozenset()
        if state.kind == "segment":
            # the part of a trajectory that ran in another process (rtrace.extract): its
            # reward and coordinates belong to the driver's part, written on its own
            return
        if "reward" in on:
            recorded = "reward" in state.annotations or state.has_reward
            reward = py(state.annotations["reward"] if "reward" in state.annotations else state.reward)
            self._reward(reward, recorded, gens, coords, out)
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
                found = self.continuity_break(prev.prompt_ids + prev.response_ids, gen.prompt_ids,
                                              bool(prev.response_ids))
                if found is not None:
                    out.append(continuity_finding(k, len(prev.prompt_ids) + len(prev.response_ids), *found))
                    gen.attributes["rtrace.health.break"] = [found[0], k]  # for the decoded context (check_ids)
            prev = gen if gen.prompt_ids is not None and gen.response_ids is not None else None

    def continuity_break(self, expected: list[int], got: list[int], answered: bool,
                         offset: int = 0) -> tuple[int, int | None, int | None] | None:
        """Where a turn's prompt ``got`` stops continuing the previous turn's prompt + response
        ``expected``: ``(position, expected id, got id)``, or None when it continues. ``answered``:
        the previous response was not empty. A summarized rollout whose prompts are one list grown
        in place compares only what follows the prompt they share (``offset`` ids, the same
        objects): the same answer as over the whole (pipeline/summaries.py)."""
        # A loop may drop the reply's final end-of-turn token to continue the same
        # assistant message (SkyRL's single-turn mode): nothing sampled is then
        # re-tokenized. Only a special token may go: a content token left out or
        # replaced (a reply cut at a stop string, re-rendered) is a break.
        if got[:len(expected)] == expected or (
                answered and got[:len(expected) - 1] == expected[:-1] and self._is_special(expected[-1])):
            return None
        pos = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        want = expected[pos] if pos < len(expected) else None
        have = got[pos] if pos < len(got) else None
        return pos + offset, want, have

    def _generation(self, records: list[SpanRecord], gens: list[SpanRecord], out: list) -> None:
        generation_findings([g.response_ids for g in gens],
                            gens[-1].attributes.get("gen_ai.response.finish_reasons") if gens else None,
                            [rec.attributes.get("gen_ai.tool.name") or rec.name for rec in records
                             if rec.kind == "tool" and rec.status != "error" and rec.input is not None
                             and rec.output in (None, "")], out)

    def _tokens(self, gens: list[SpanRecord], annotations: dict[str, Any], out: list) -> None:
        """token_arrays (what could not be laid on the tokens) and logprob_mismatch."""
        for k, gen in enumerate(gens, 1):
            problem = gen.attributes.pop(TOKEN_PROBLEM, None)
            if problem is not None and "token_arrays" in self.checks:
                out.append(finding("token_arrays", f"turn {k}: {problem}: left out"))
        if "logprob_mismatch" not in self.checks:
            return
        m = mismatch(gens, self.mismatch[0])
        if isinstance(m, str):
            # a loss mask of zeros is a trainer's choice (overlong filtering, masked truncated
            # completions): counted, not a finding
            _stats.incr("logprob_mismatch_mask_empty")
            return
        if m is None:
            return
        if m.nonfinite[0]:
            # a bf16 overflow, a bad kernel: the worst mismatch there is, never a mean over the
            # other tokens (that read as none, and pulled the step's mean down)
            _stats.incr("logprob_mismatch_nonfinite")
            out.append(finding("logprob_mismatch", _nonfinite_detail(m)))
            return
        annotations.update(m.values())
        _, max_frac, max_k3 = self.mismatch
        if m.frac > max_frac or m.k3 > max_k3:  # type: ignore[operator]
            out.append(finding("logprob_mismatch", _mismatch_detail(m, self.mismatch)))

    def _is_special(self, token: int) -> bool:
        """True when the tokenizer (if any) says ``token`` is a special one (an end of turn)."""
        tok = self.tokenizer()
        if tok is None:
            return False
        if self._special[0] is not tok:
            self._special = (tok, _special_ids(tok))
        return token in self._special[1]

    def _reward(self, reward: Any, recorded: bool, gens: list[SpanRecord], coords: dict[str, Any],
                out: list) -> None:
        if reward is None:
            if recorded:
                out.append(finding("reward", NONE_REWARD))
            elif self._rewarded:
                out.append(finding("reward", NO_REWARD))
            else:
                # No rollout of the run has a reward so far (a job that computes none, as
                # veRL's agent loops by default): said once for the run, not per rollout.
                _stats.incr("health_reward_never_recorded")
                _stats.warn_once("health-no-reward", "rtrace: no rollout of this run has recorded a reward "
                                 "(rtrace.record_reward / annotate reward=...): the reward check does not flag "
                                 "each rollout until one has (counted in health_reward_never_recorded)")
            return
        self._rewarded = True
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
        mine = _scale(value)
        if mine is None:
            return
        scale = memory.groups.get(group)
        if scale is None:
            memory.groups[group] = (mine, value)
        elif scale[0] != mine:
            small, large = (abs(value), abs(scale[1])) if mine == "unit" else (abs(scale[1]), abs(value))
            if large >= _SCALE_RATIO * small:
                out.append(finding("reward", f"reward {value!r} is on another scale than reward {scale[1]!r} of its "
                                             f"group {group!r} (a 0-1 score and one above {_LARGE:g})"))

    def _duplicate(self, coords: dict[str, Any], trace_id: int, out: list) -> None:
        index = py(coords.get("sample_index"))
        if index is None:
            return
        memory = self._memory(coords)
        key = (index, py(coords.get("rollout_n")))
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
        key = (bool(py(coords.get("validate"))), py(coords.get("step")))
        memory = self._steps.get(key)
        if memory is None:
            memory = self._steps[key] = _StepMemory()
            if len(self._steps) > _STEPS_KEPT:
                self._steps.popitem(last=False)
        return memory

    def ran(self, traj: Trajectory) -> list[str]:
        """The checks that ran on ``traj`` (after both phases): a segment has no reward,
        staleness or coordinates checks, retokenization needs a tokenizer."""
        names = self._ran_segment if traj.spans and traj.spans[0].kind == "segment" else self._ran
        if "retokenization" in names and self.tokenizer() is None:
            return [n for n in names if n != "retokenization"]
        return list(names)

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
                ran: list[SpanRecord] = []
                sends = False
                for later in order[pos + 1:]:
                    if later.kind == "generation":
                        # an agent that runs its tools itself (through the capture gateway) sends
                        # their results with its next model call
                        sends = _sends_tool_results(later)
                        break
                    if later.kind == "tool":
                        ran.append(later)
                    elif not calls:
                        calls = _parsed_calls(later)  # a tool parser's output (veRL's extract_tool_calls)
                if calls and not ran and not sends:
                    names = ", ".join(sorted({c[0] for c in calls if c[0]})) or "?"
                    traj.health.append(finding("generation", f"turn {k}: the model called {len(calls)} tool(s) "
                                                             f"({names}) but no tool ran"))
                    unran.update(cid for _, cid in calls if cid is not None)  # said once: not again below
                elif len(calls) > len(ran) and not sends:
                    missing = _not_run(calls, ran)
                    unran.update(cid for _, cid in missing if cid is not None)
                    names = ", ".join(f"{name or '?'}" + (f" ({cid})" if cid is not None else "")
                                      for name, cid in missing) or f"{len(calls) - len(ran)} of them"
                    traj.health.append(finding("generation", f"turn {k}: the model called {len(calls)} tools but "
                                                             f"{len(ran)} ran; not run: {names}"))
                elif not calls and text and TOOL_MARKUP.search(text):
                    turn = traj.turn_of(span)
                    if not ran and not sends and not (turn or {}).get("tool_calls"):
                        traj.health.append(finding("generation", f"turn {k}: tool-call markup in the response but "
                                                                 "no tool ran (a call that failed to parse?)"))
            for cid, name in _unanswered(traj, unran):
                traj.health.append(finding("generation", f"tool call {cid} ({name}) has no tool result"))


def continuity_finding(k: int, expected: int, pos: int, want: int | None, have: int | None) -> dict[str, str]:
    """The token_continuity finding of turn ``k``, whose prompt breaks at ``pos`` from the
    ``expected`` ids of the turn before."""
    return finding("token_continuity", f"turn {k}: its prompt does not continue turn {k - 1}'s prompt + response "
                                       f"at token {pos} of {expected} (expected id {want}, got {have})")


def generation_findings(responses: list[Any], last_reasons: Any, empty_tools: list[Any], out: list) -> None:
    """The generation check's findings: ``responses`` the generations' response ids in turn
    order (None: unread), ``last_reasons`` the last one's finish reasons, ``empty_tools`` the
    names of the captured tool calls that answered nothing (None or "")."""
    for k, ids in enumerate(responses, 1):
        if ids is not None and not ids:
            out.append(finding("generation", f"turn {k}: empty response (0 tokens)"))
    if responses and "length" in (last_reasons or ()):
        out.append(finding("generation", f"turn {len(responses)} (the final one) was truncated: finish reason length"))
    for name in empty_tools:
        out.append(finding("generation", f"tool {name}: empty result"))


def _unanswered(traj: Trajectory, reported: set[Any]) -> list[tuple[Any, Any]]:
    """The assistant tool calls of the conversation that no tool answered: a tool message
    answers by its ``tool_call_id``, or, without one (Qwen and Hermes templates allow
    it), the first unanswered call before it; a tool span answers its
    ``gen_ai.tool.call.id``. Calls in ``reported`` (said already: no tool ran them) are
    not said again."""
    ran = {s.attributes.get("gen_ai.tool.call.id") for s in traj.spans if s.kind == "tool"}
    pending: list[dict[str, Any]] = []  # calls of the conversation so far not yet answered
    for msg in traj.messages:  # one pass over the conversation
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "assistant" and isinstance(msg.get("tool_calls"), list):
            pending.extend(c for c in msg["tool_calls"] if isinstance(c, dict))
        elif role == "tool" and pending:
            cid = msg.get("tool_call_id")
            at = next((i for i, c in enumerate(pending) if c.get("id") == cid), None) if cid is not None else 0
            if at is not None:
                del pending[at]
    return [(c.get("id"), (c.get("function") or {}).get("name")) for c in pending
            if c.get("id") is not None and c.get("id") not in ran and c.get("id") not in reported]


def _not_run(calls: list[tuple[str, Any]], ran: list[SpanRecord]) -> list[tuple[str, Any]]:
    """``(name, id)`` of the parsed calls no tool span ran: by call id where both sides
    have one, else by tool name (each run answers one call of its name), else the last
    ones (empty when only counts tell)."""
    left = list(ran)
    missing = []
    for name, cid in calls:
        hit = next((i for i, s in enumerate(left) if cid is not None
                    and s.attributes.get("gen_ai.tool.call.id") == cid), None)
        if hit is None:
            hit = next((i for i, s in enumerate(left) if name and (s.attributes.get("gen_ai.tool.name") or s.name)
                        == name), None)
        if hit is None and not name and left:
            hit = 0
        if hit is None:
            missing.append((name, cid))
        else:
            del left[hit]
    return missing


def _sends_tool_results(span: SpanRecord) -> bool:
    """A generation whose request carries tool results (a ``role: tool`` message): an agent
    that runs its tools itself (behind the capture gateway) sends them with its next call."""
    chat = chat_argument(span.input)
    return chat is not None and any(m.get("role") == "tool" for m in chat[1])


def _structured_calls(span: SpanRecord) -> list[tuple[str, Any]]:
    """``(name, id)`` of the tool calls a generation returned already parsed (an
    OpenAI-style ``tool_calls`` list in its output or its ``message``); empty when none."""
    out = span.output
    if not isinstance(out, dict):
        return []
    calls = out.get("tool_calls")
    if calls is None and isinstance(out.get("message"), dict):
        calls = out["message"].get("tool_calls")
    return _calls(calls)


def _parsed_calls(span: SpanRecord) -> list[tuple[str, Any]]:
    """``(name, id)`` of the calls a tool parser returned, when ``span`` is one (not a
    generation or a tool): its output a list of ``{"name", "arguments"}`` calls, or
    ``[text, calls]`` (veRL's ``extract_tool_calls``)."""
    if span.kind in ("generation", "tool"):
        return []
    out = span.output
    if isinstance(out, list) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], list):
        out = out[1]
    if not isinstance(out, list) or not out or not all(isinstance(c, dict) and "name" in c and "arguments" in c
                                                       or isinstance(c, dict) and "function" in c for c in out):
        return []
    return _calls(out)


def _calls(calls: Any) -> list[tuple[str, Any]]:
    if not isinstance(calls, list):
        return []
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(("", None))
            continue
        fn = call.get("function")
        name = (fn.get("name") if isinstance(fn, dict) else None) or call.get("name")
        out.append((name if isinstance(name, str) else "", call.get("id")))
    return out


def _staleness(coords: dict[str, Any]) -> int | None:
    step, version = py(coords.get("step")), py(coords.get("policy_version"))
    if isinstance(step, int) and isinstance(version, int) and not isinstance(step, bool) \
            and not isinstance(version, bool):
        return step - version
    return None


def staleness(coords: dict[str, Any]) -> int | None:
    """``step - policy_version`` when both are integers (``rl.staleness`` on the root)."""
    return _staleness(coords)


def _mismatch_detail(m: Mismatch, limits: tuple[float, float, float]) -> str:
    ratio, max_frac, max_k3 = limits
    turn, pos, token, s, t = m.worst
    tok = f" (id {token})" if token is not None else ""
    return (f"{m.frac:.1%} of {m.tokens} tokens outside [1/{ratio:g}, {ratio:g}] (max {max_frac:g}), k3 {m.k3:.3g} "
            f"(max {max_k3:g}), k1 {m.k1:.3g}; worst: turn {turn}, token {pos}{tok}: sampler logprob {s:.4g}, "
            f"trainer {t:.4g} (|Δ| {abs(t - s):.3g})")


def _nonfinite_detail(m: Mismatch) -> str:
    n, sampler, trainer = m.nonfinite
    turn, pos, token, s, t = m.worst
    tok = f" (id {token})" if token is not None else ""
    return (f"{n} of {m.tokens} trained tokens have a logprob that is not finite (trainer {trainer}, sampler "
            f"{sampler}): the mismatch is not measured (k1, k3, max and share left out); first: turn {turn}, token "
            f"{pos}{tok}: sampler logprob {s:.4g}, trainer {t:.4g}")


def _special_ids(tok: Any) -> frozenset[int]:
    """The ids a tokenizer marks special: ``all_special_ids`` (eos, pad ...), and added
    tokens flagged special (chat templates' end-of-turn tokens: ``<|im_end|>``, ``<|eot_id|>``)."""
    ids: set[int] = set()
    try:
        ids.update(int(i) for i in (getattr(tok, "all_special_ids", None) or ()))
        eos = getattr(tok, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        added = getattr(tok, "added_tokens_decoder", None)
        if isinstance(added, dict):
            ids.update(int(i) for i, t in added.items() if getattr(t, "special", False))
    except Exception:
        _stats.incr("health_errors")
    return frozenset(ids)


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
