"""The summary of one rollout: what the step metrics and the dataset's trajectories table
need, for every rollout, recorded in full or not.

A step of 10^5-10^6 rollouts cannot be recorded span by span; its metrics must still count
every rollout. So each finished rollout leaves a :class:`RolloutSummary`: a few dozen
plain values (its coordinates, reward, outcome and annotations, verdict, health codes,
turns, tool calls, tokens, times). The full spans, the conversation and the per-token
arrays travel only for the rollouts that may be kept (the per-step sample, the tail).

Where a summary comes from:

* a trajectory recorded in full: :func:`summarize` reads it (in the pipeline, for the
  kept ones and for those the sample drops: its step metrics count both);
* a rollout recorded as a summary only (sampled out when it started: ``max_traces_per_step``
  in one process, ``RTRACE_PRE_SAMPLE_RATE`` in a collector's worker): the pipeline builds it
  from the hot path's tally of the rollout's calls (``rtrace/pipeline/summaries.py``).

It crosses to a collector as JSON (:meth:`RolloutSummary.to_wire`), becomes a row of the
dataset's trajectories table (``recorded`` false: no spans, no conversation), and is read
back from there (the step metrics a publisher computes over many collectors' rows).
"""

from __future__ import annotations

from typing import Any

from .trajectory import Trajectory, verdict_of

__all__ = ["RolloutSummary", "summarize", "fleet_fields", "own_version", "SUMMARY_SCHEMA"]

#: Version tag of the wire form (:meth:`RolloutSummary.to_wire`).
SUMMARY_SCHEMA = "rtrace.summary/1"

#: The longest error text a summary keeps (a summary is small by design).
ERROR_CHARS = 500


class RolloutSummary:
    """One rollout's summary (see the module docstring). Plain values only."""

    __slots__ = ("trace_id", "name", "step", "sample_index", "rollout_n", "validate", "experiment", "group_id",
                 "policy_version", "extra", "reward", "outcome", "annotations", "status", "error", "partial",
                 "turns", "tool_calls", "tokens_in", "tokens_out", "finish_reasons", "finish_reason",
                 "start_ns", "end_ns", "generation_ms", "tool_ms", "health", "recorded", "kept", "priority",
                 "dropped_spans", "worker", "policy_version_end", "crossed_update", "wait_ms", "server_ms")

    def __init__(self, trace_id: str, name: str = "rollout", *, step: int | None = None,
                 sample_index: int | None = None, rollout_n: int | None = None, validate: bool = False,
                 experiment: str | None = None, group_id: Any = None, policy_version: int | None = None,
                 extra: dict[str, Any] | None = None, reward: float | None = None,
                 outcome: dict[str, Any] | None = None, annotations: dict[str, Any] | None = None,
                 status: str = "ok", error: str | None = None, partial: bool = False, turns: int = 0,
                 tool_calls: int = 0, tokens_in: int = 0, tokens_out: int = 0,
                 finish_reasons: dict[str, int] | None = None, finish_reason: str | None = None,
                 start_ns: int = 0, end_ns: int = 0, generation_ms: float = 0.0, tool_ms: float = 0.0,
                 health: list[dict[str, str]] | None = None, recorded: bool = False,
                 kept: list[str] | None = None, priority: float | None = None, dropped_spans: int = 0,
                 worker: str | None = None, policy_version_end: int | None = None,
                 crossed_update: bool | None = None, wait_ms: float = 0.0,
                 server_ms: dict[str, float] | None = None) -> None:
        self.trace_id = trace_id
        self.name = name
        self.step = step
        self.sample_index = sample_index
        self.rollout_n = rollout_n
        self.validate = validate
        self.experiment = experiment
        self.group_id = group_id
        self.policy_version = policy_version
        self.extra = extra or {}
        #: a float (None: no reward; NaN and infinities as they are, the metrics count them)
        self.reward = reward
        self.outcome = outcome or {}
        self.annotations = annotations or {}
        self.status = status
        self.error = error
        self.partial = partial
        self.turns = turns
        self.tool_calls = tool_calls
        self.tokens_in = tokens_in
        self.tokens_out = tokens_out
        #: every generation's finish reasons, counted (``{"stop": 3, "tool_calls": 2}``)
        self.finish_reasons = finish_reasons or {}
        #: the last generation's (what ``Trajectory.finish_reason`` says)
        self.finish_reason = finish_reason
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.generation_ms = generation_ms
        self.tool_ms = tool_ms
        #: rollout-health findings (``{"check", "detail"}``); None: no check ran
        self.health = health
        #: recorded in full (spans, conversation) somewhere: kept, or a candidate for it
        self.recorded = recorded
        #: why it was kept (the selection's reasons); empty: not kept
        self.kept = kept or []
        #: the per-step sample's rank (``pipeline.sampling.priority``), when known
        self.priority = priority
        self.dropped_spans = dropped_spans
        #: the process it ran in (``RTRACE_WORKER_NAME``, else ``host:pid``; docs/timeline.md)
        self.worker = worker
        #: the policy version it ended on: its last generation's own version when the server
        #: said (``rtrace.weight_version``), else the latest weight update at or before its end
        #: (``rtrace.mark_weight_update``); None: unknown
        self.policy_version_end = policy_version_end
        #: a weight update was marked while it ran, or its last generation's own version (the
        #: server's) is not the one it started on; None: unknown (no update marked, no version
        #: from a server)
        self.crossed_update = crossed_update
        #: its time in neither a generation nor a tool call (ms): waiting for a slot, a
        #: parser, an environment, the trainer
        self.wait_ms = wait_ms
        #: generation time by inference server (``server.address[:server.port]``), ms
        self.server_ms = server_ms or {}

    # ------------------------------------------------------------------ derived
    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def truncated(self) -> bool:
        """A generation stopped at ``length``."""
        return "length" in self.finish_reasons

    @property
    def group(self) -> Any:
        """The group the step metrics count: ``group_id``, else ``sample_index``."""
        return self.group_id if self.group_id is not None else self.sample_index

    def verdict(self) -> str:
        """As :meth:`rtrace.Trajectory.verdict` (:func:`~rtrace.trajectory.verdict_of`)."""
        return verdict_of(self.status, self.partial, self.finish_reason, self.outcome)

    def __repr__(self) -> str:
        return (f"RolloutSummary(step={self.step}, sample_index={self.sample_index}, rollout_n={self.rollout_n}, "
                f"validate={self.validate}, reward={self.reward}, recorded={self.recorded})")

    # ------------------------------------------------------------------ wire
    def to_wire(self) -> dict[str, Any]:
        """The JSON form a worker sends to its collector (plain values; NaN rewards as
        ``"NaN"`` strings: strict JSON)."""
        reward = self.reward
        if isinstance(reward, float) and reward - reward != 0.0:  # NaN or an infinity
            reward = repr(reward)  # "nan", "inf", "-inf": float() reads them back
        # written out (a test keeps it equal to __slots__): a third of a comprehension's time
        return {"trace_id": self.trace_id, "name": self.name, "step": self.step, "sample_index": self.sample_index,
                "rollout_n": self.rollout_n, "validate": self.validate, "experiment": self.experiment,
                "group_id": self.group_id, "policy_version": self.policy_version, "extra": self.extra,
                "reward": reward, "outcome": self.outcome, "annotations": self.annotations, "status": self.status,
                "error": self.error, "partial": self.partial, "turns": self.turns, "tool_calls": self.tool_calls,
                "tokens_in": self.tokens_in, "tokens_out": self.tokens_out, "finish_reasons": self.finish_reasons,
                "finish_reason": self.finish_reason, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "generation_ms": self.generation_ms, "tool_ms": self.tool_ms, "health": self.health,
                "recorded": self.recorded, "kept": self.kept, "priority": self.priority,
                "dropped_spans": self.dropped_spans, "worker": self.worker,
                "policy_version_end": self.policy_version_end, "crossed_update": self.crossed_update,
                "wait_ms": self.wait_ms, "server_ms": self.server_ms}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "RolloutSummary":
        """Read :meth:`to_wire`'s form; raises ValueError, naming the field, on anything else
        (a collector reads what workers send: a value of the wrong type would reach the
        step metrics and the sinks)."""
        if type(data) is not dict or type(data.get("trace_id")) is not str:
            raise ValueError("not a rollout summary")
        fields = {}
        for key, types, ok in _WIRE_CHECKS:
            if key in data:
                value = data[key]
                # most fields are one of a few exact types: checked without a call
                if type(value) not in types and (ok is None or not ok(value)):
                    raise ValueError(f"a summary's {key} is not {_WIRE_TYPES[key]}")
                fields[key] = value
        reward = fields.get("reward")
        if type(reward) is str:
            fields["reward"] = float(reward)  # (checked: "nan", "inf", "-inf" or a number's text)
        return cls(data["trace_id"], **fields)


def _opt_int(v: Any) -> bool:
    return v is None or type(v) is int


def _opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _number(v: Any) -> bool:
    return (type(v) is float or type(v) is int) and v - v == 0  # finite (JSON readers may take NaN)


def _reward_value(v: Any) -> bool:
    if v is None or type(v) is float or type(v) is int:
        return True
    if type(v) is str:
        try:
            float(v)
        except ValueError:
            return False
        return True
    return False


def _str_dict(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str for k in v)


def _counts(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str and type(n) is int for k, n in v.items())


def _health(v: Any) -> bool:
    return v is None or type(v) is list and all(
        type(f) is dict and type(f.get("check")) is str and type(f.get("detail")) is str for f in v)


def _strings(v: Any) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


_NONE, _INT, _STR, _BOOL = type(None), int, str, bool
#: each field of the wire form, what it must be, the exact types that are it, and the check of a
#: value of another type (None: no other value is; the order of __slots__)
_WIRE_RULES: tuple[tuple[str, str, frozenset, Any], ...] = (
    ("name", "a string", frozenset((_STR,)), None),
    ("step", "an int", frozenset((_INT, _NONE)), None), ("sample_index", "an int", frozenset((_INT, _NONE)), None),
    ("rollout_n", "an int", frozenset((_INT, _NONE)), None),
    ("validate", "a bool", frozenset((_BOOL,)), None), ("experiment", "a string", frozenset((_STR, _NONE)), None),
    ("group_id", "a scalar", frozenset((_NONE, _STR, _INT, float, _BOOL)), None),
    ("policy_version", "an int", frozenset((_INT, _NONE)), None), ("extra", "an object", frozenset(), _str_dict),
    ("reward", "a number", frozenset((_NONE, float, _INT)), _reward_value),
    ("outcome", "an object", frozenset(), _str_dict), ("annotations", "an object", frozenset(), _str_dict),
    ("status", "ok or error", frozenset(), lambda v: v == "ok" or v == "error"),
    ("error", "a string", frozenset((_STR, _NONE)), None), ("partial", "a bool", frozenset((_BOOL,)), None),
    ("turns", "an int", frozenset((_INT,)), None), ("tool_calls", "an int", frozenset((_INT,)), None),
    ("tokens_in", "an int", frozenset((_INT,)), None), ("tokens_out", "an int", frozenset((_INT,)), None),
    ("finish_reasons", "an object of counts", frozenset(), _counts),
    ("finish_reason", "a string", frozenset((_STR, _NONE)), None),
    ("start_ns", "an int", frozenset((_INT,)), None), ("end_ns", "an int", frozenset((_INT,)), None),
    ("generation_ms", "a number", frozenset(), _number), ("tool_ms", "a number", frozenset(), _number),
    ("health", "a list of findings", frozenset(), _health), ("recorded", "a bool", frozenset((_BOOL,)), None),
    ("kept", "a list of strings", frozenset(), _strings),
    ("priority", "a number", frozenset((_NONE,)), _number),
    ("dropped_spans", "an int", frozenset((_INT,)), None),
    ("worker", "a string", frozenset((_STR, _NONE)), None),
    ("policy_version_end", "an int", frozenset((_INT, _NONE)), None),
    ("crossed_update", "a bool", frozenset((_BOOL, _NONE)), None),
    ("wait_ms", "a number", frozenset(), _number),
    ("server_ms", "an object of numbers", frozenset(), lambda v: type(v) is dict and all(
        type(k) is str and _number(x) for k, x in v.items())),
)
_WIRE_CHECKS = tuple((key, types, ok) for key, _, types, ok in _WIRE_RULES)
_WIRE_TYPES = {key: what for key, what, _, _ in _WIRE_RULES}


def fleet_fields(spans: Any, start_ns: int, end_ns: int) -> tuple[float, dict[str, float], int | None]:
    """What the timeline's step metrics need of a rollout's spans (records, or SpanRecords):
    ``(wait_ms, server_ms, version_end)``.

    ``wait_ms``: the time of ``[start_ns, end_ns]`` in no generation and no tool call (their
    union: parallel tool calls count once); ``server_ms``: generation time by inference server
    (``server.address``, with ``:server.port`` when set); ``version_end``: the own version
    (``rl.policy_version`` beside ``rtrace.weight_version``, which the gateway and the adapters
    set when the server says which weights answered) of the last generation that has one."""
    busy: list[tuple[int, int]] = []
    servers: dict[str, float] = {}
    for span in spans:
        kind = span.kind
        if kind != "generation" and kind != "tool":
            continue
        s, e = span.start_ns, span.end_ns
        busy.append((s, e))
        if kind == "generation":
            address = span.attributes.get("server.address")
            if address is not None:
                port = span.attributes.get("server.port")
                key = f"{address}:{port}" if type(port) is int else str(address)
                servers[key] = servers.get(key, 0.0) + (e - s) / 1e6
    return wait_ms(busy, start_ns, end_ns), servers, own_version(spans)


def own_version(spans: Any) -> int | None:
    """The own version (``rl.policy_version`` beside ``rtrace.weight_version``, which the
    gateway and the adapters set when the server says which weights answered) of the last
    generation of ``spans`` (records, or SpanRecords) that has one; None without one."""
    version = None
    version_at = -1
    for span in spans:
        if span.kind == "generation" and span.start_ns >= version_at and "rtrace.weight_version" in span.attributes:
            own = span.attributes.get("rl.policy_version")
            if type(own) is int:
                version, version_at = own, span.start_ns
    return version


def wait_ms(busy: list[tuple[int, int]], start_ns: int, end_ns: int) -> float:
    """The time of ``[start_ns, end_ns]`` outside every ``(start, end)`` of ``busy`` (their
    union: overlapping calls count once), in milliseconds."""
    return sum(b - a for a, b in idle(busy, start_ns, end_ns)) / 1e6


def idle(busy: list[tuple[int, int]], start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    """The parts of ``[start_ns, end_ns]`` outside every ``(start, end)`` of ``busy``, in order:
    a rollout's waits (the timeline draws them; :func:`wait_ms` adds them up)."""
    out = []
    cur = start_ns
    for s, e in sorted(busy):
        if s >= end_ns:
            break
        if s > cur:
            out.append((cur, s))
        if e > cur:
            cur = e
    if end_ns > cur:
        out.append((cur, end_ns))
    return out


class Calls:
    """What a rollout's generations and tool calls add up to (:func:`count_calls`)."""

    __slots__ = ("turns", "tools", "tokens_in", "tokens_out", "gen_ns", "tool_ns", "reasons", "last_reason", "end")

    def __init__(self) -> None:
        self.turns = self.tools = self.tokens_in = self.tokens_out = 0
        # summed in nanoseconds (ints: exact), so a rollout's summary is the same kept (tree
        # order), dropped (arrival order) or tallied (start order), and equal to its dataset row's
        self.gen_ns = self.tool_ns = 0
        self.reasons: dict[str, int] = {}
        #: the finish reason of the generation that started last (of those that say one)
        self.last_reason: str | None = None
        #: the latest end of the spans counted
        self.end = 0


def count_calls(spans: Any) -> Calls:
    """The turns, tool calls, tokens, times and finish reasons of a rollout's spans (records
    or SpanRecords, in any order): one reading for a kept trajectory's summary and a dropped
    one's (rtrace/pipeline/summaries.py), so they are the same."""
    out = Calls()
    reasons = out.reasons
    last_start = None
    for span in spans:
        if span.end_ns > out.end:
            out.end = span.end_ns
        kind = span.kind
        if kind == "generation":
            attrs = span.attributes
            out.turns += 1
            out.gen_ns += span.end_ns - span.start_ns
            out.tokens_in += _int(attrs.get("gen_ai.usage.input_tokens"))
            out.tokens_out += _int(attrs.get("gen_ai.usage.output_tokens"))
            found = attrs.get("gen_ai.response.finish_reasons")
            if found:
                for reason in found if isinstance(found, (list, tuple)) else (found,):
                    reasons[str(reason)] = reasons.get(str(reason), 0) + 1
                if last_start is None or span.start_ns >= last_start:
                    last_start = span.start_ns
                    out.last_reason = str(found[0] if isinstance(found, (list, tuple)) else found)
        elif kind == "tool":
            out.tools += 1
            out.tool_ns += span.end_ns - span.start_ns
    return out


def summarize(traj: Trajectory, priority: float | None = None) -> RolloutSummary:
    """The summary of a trajectory recorded in full (``recorded`` True)."""
    spans = traj.spans
    calls = count_calls(spans)
    start, end = spans[0].start_ns, calls.end
    wait_ms, server_ms, own = fleet_fields(spans, start, end)
    return RolloutSummary(
        traj.trace_id, traj.name, step=traj.step, sample_index=traj.sample_index, rollout_n=traj.rollout_n,
        validate=traj.validate, experiment=traj.experiment, group_id=traj.group_id,
        policy_version=traj.policy_version, extra=traj.extra, reward=traj.reward, outcome=traj.outcome,
        annotations=traj.annotations, status=traj.status,
        error=traj.error[:ERROR_CHARS] if isinstance(traj.error, str) else None, partial=traj.partial,
        turns=calls.turns, tool_calls=calls.tools, tokens_in=calls.tokens_in, tokens_out=calls.tokens_out,
        finish_reasons=calls.reasons, finish_reason=calls.last_reason, start_ns=start, end_ns=end,
        generation_ms=calls.gen_ns / 1e6, tool_ms=calls.tool_ns / 1e6, health=traj.health, recorded=True,
        kept=list(traj.kept), priority=priority, dropped_spans=traj.dropped_spans, worker=traj.worker,
        policy_version_end=traj.policy_version_end if traj.policy_version_end is not None else own,
        crossed_update=traj.crossed_update, wait_ms=wait_ms, server_ms=server_ms)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
