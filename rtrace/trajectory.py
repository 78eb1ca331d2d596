"""The Trajectory model: what every sink receives.

A trajectory is the set of spans under one root span (one ``rollout_context`` or one
outermost decorated call). The worker thread builds it from finished OTel spans; sinks
only read it. Everything in it is JSON-safe already (captured values were converted,
truncated and redacted in the worker thread), so ``Trajectory.to_dict()`` is the JSONL
schema (``docs/jsonl-schema.md``) and ``Trajectory.from_dict()`` reads it back.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["SCHEMA", "SpanRecord", "Trajectory", "StepMetrics", "RL_FIELDS", "MESSAGE_INDEX", "CHAT_KEYS", "verdict_of",
           "chat_argument", "response_text", "tool_call_id", "token_list", "token_field", "read_token_field",
           "TOKEN_ENCODING"]

#: Version tag written in every JSONL line; bumped only on incompatible changes.
SCHEMA = "rtrace.trajectory/1"

#: RL coordinates carried by every trajectory (``rl.<name>`` on every span).
RL_FIELDS = ("step", "sample_index", "rollout_n", "validate", "experiment", "group_id", "policy_version")

#: Input arguments holding a conversation (a list of ``{"role": ...}`` dicts): ``messages``
#: (OpenAI, AReaL), ``raw_prompt`` (veRL's dataset column, ``ToolAgentLoop.run``),
#: ``prompt`` (SkyRL), ``conversation``.
CHAT_KEYS = ("messages", "raw_prompt", "prompt", "conversation")

#: On a generation span: the index in ``Trajectory.messages`` of the assistant turn it
#: produced (set by the pipeline when it builds the conversation).
MESSAGE_INDEX = "rtrace.message_index"

@dataclass
class StepMetrics:
    """The metrics of one RL step (training or validation), computed by the pipeline over
    the whole job's sampled trajectories; see docs/metrics.md for the names."""

    step: int
    validate: bool
    #: ``rollout/<name>`` or ``eval/<name>`` -> value
    values: dict[str, float]
    #: the slowest trajectory of the step: a straggler is one search away
    slowest_trace_id: str | None = None
    #: the step's rollouts table: one row per exported trajectory (the sample and the tail),
    #: ordered by group then rollout (columns: :data:`rtrace.pipeline.metrics.TABLE_COLUMNS`)
    rows: list[dict[str, Any]] = field(default_factory=list)


def _float_or_none(value: Any) -> float | None:
    # JSONL writes non-finite rewards as "NaN" / "Infinity" / "-Infinity" (strict JSON).
    return None if value is None else float(value)


@dataclass(slots=True)
class SpanRecord:
    """One finished span of a trajectory, with JSON-safe captured values.

    ``kind``: the root of a rollout_context is ``rollout``; decorated calls are ``agent``
    (traced_rollout), ``generation``, ``tool`` or the kind given to ``traced(kind=...)``;
    an ``rtrace.extract`` segment is ``segment``; spans made by other OTel
    instrumentation inside a trajectory are ``span``.
    """

    span_id: str
    parent_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status: str = "ok"  # "ok" | "error"
    error: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    input: Any = None
    output: Any = None
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Token ids captured on generation spans; decoded by token2text, then dropped
    #: unless ``token2text_keep_ids`` is set.
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    #: Per-token values of a generation, each aligned with its ``response_ids``: the
    #: sampler's ``logprob``, the trainer's arrays (``old_logprob``, ``advantage``,
    #: ``loss_mask`` ...). float32 arrays in the pipeline; lists of numbers (6 significant
    #: digits, None where not finite) in JSON (docs/token-values.md). None: none.
    token_values: dict[str, Any] | None = None

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def to_dict(self) -> dict[str, Any]:
        start, end = self.start_ns, self.end_ns
        out = {
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "kind": self.kind,
            "start_ns": start,
            "end_ns": end,
            "duration_ms": (end - start) / 1e6,
            "status": self.status,
            "error": self.error,
            "attributes": self.attributes,
            "input": self.input,
            "output": self.output,
            "events": self.events,
        }
        if self.prompt_ids is not None:
            out["prompt_ids"] = self.prompt_ids
        if self.response_ids is not None:
            out["response_ids"] = self.response_ids
        if self.token_values:
            out["token_values"] = {name: token_list(v) for name, v in self.token_values.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpanRecord":
        return cls(
            span_id=data["span_id"],
            parent_id=data.get("parent_id"),
            name=data["name"],
            kind=data.get("kind", "span"),
            start_ns=data["start_ns"],
            end_ns=data["end_ns"],
            status=data.get("status", "ok"),
            error=data.get("error"),
            attributes=data.get("attributes") or {},
            input=data.get("input"),
            output=data.get("output"),
            events=data.get("events") or [],
            prompt_ids=data.get("prompt_ids"),
            response_ids=data.get("response_ids"),
            token_values=data.get("token_values"),
        )


@dataclass
class Trajectory:
    """A finished (or, with ``partial=True``, timed-out) trajectory.

    ``spans`` are in tree order: the root first, then each span's children by start
    time, depth first. ``messages`` is the conversation in chat format (role, content,
    tool_calls, tool_call_id, name), built by the worker from captured chat messages,
    decoded token ids or captured inputs/outputs.
    """

    trace_id: str
    name: str
    spans: list[SpanRecord]
    step: int | None = None
    sample_index: int | None = None
    rollout_n: int | None = None
    validate: bool = False
    experiment: str | None = None
    group_id: str | None = None
    policy_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    outcome: dict[str, Any] = field(default_factory=dict)
    #: values joined from rtrace.annotate / annotate_batch (advantage, returns...), by key
    annotations: dict[str, Any] = field(default_factory=dict)
    #: why it was kept: "sampled" (the per-step sample), "error", "best", "worst",
    #: "zero_variance"; empty when every trajectory is kept (no cap)
    kept: list[str] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    partial: bool = False
    dropped_spans: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: rollout-health findings, ``{"check": ..., "detail": ...}`` each; empty when healthy
    #: (docs/health.md). None: not checked (health checks off, or a file written before them).
    health: list[dict[str, str]] | None = None
    #: the health checks that ran on it (a check needs what it checks: ``retokenization`` a
    #: tokenizer; a segment gets no reward, staleness or coordinates checks). None: unknown
    #: (no check ran, or a file written before this field): a report then says "not run" of
    #: a check only when it knows.
    health_checks: list[str] | None = None
    #: its rank in its step's sample (``rtrace.pipeline.sampling.priority``: the lowest are
    #: kept), set by the pipeline; the dataset keeps it so that readers cut the union of
    #: several collectors' samples to the one-collector sample. Not in the JSONL schema.
    priority: float | None = None
    #: the process it ran in: ``RTRACE_WORKER_NAME``, else ``host:pid`` (in collector mode its
    #: root's sender's OTLP resource); None: unknown (docs/timeline.md)
    worker: str | None = None
    #: the policy version it ended on (its last generation's own version when the server
    #: said, else the latest ``rtrace.mark_weight_update`` at or before its end); None: unknown
    policy_version_end: int | None = None
    #: a weight update was marked while it ran, or its last generation's own version (the
    #: server's) is not the one it started on; None: unknown (no update marked, no version
    #: from a server)
    crossed_update: bool | None = None

    # ------------------------------------------------------------------ derived
    @property
    def root(self) -> SpanRecord:
        return self.spans[0]

    @property
    def start_ns(self) -> int:
        return self.root.start_ns

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def coordinates(self) -> dict[str, Any]:
        """The RL coordinates as a dict (``step``, ``sample_index``, ... ``extra``)."""
        coords = {name: getattr(self, name) for name in RL_FIELDS}
        coords["extra"] = dict(self.extra)
        return coords

    def spans_of_kind(self, kind: str) -> list[SpanRecord]:
        return [s for s in self.spans if s.kind == kind]

    @property
    def num_turns(self) -> int:
        """Number of generation calls (model turns)."""
        return sum(1 for s in self.spans if s.kind == "generation")

    @property
    def num_tool_calls(self) -> int:
        return sum(1 for s in self.spans if s.kind == "tool")

    @property
    def finish_reason(self) -> str | None:
        """Why the last generation that says so stopped (``stop``, ``length``...)."""
        for span in reversed(self.spans):
            if span.kind == "generation":
                reasons = span.attributes.get("gen_ai.response.finish_reasons")
                if reasons:
                    return str(reasons[0] if isinstance(reasons, (list, tuple)) else reasons)
        return None

    def verdict(self) -> str:
        """One word a person can search for (:func:`verdict_of`)."""
        return verdict_of(self.status, self.partial, self.finish_reason, self.outcome)

    def task_messages(self) -> list[dict[str, Any]]:
        """The task: the conversation's messages up to and including the first user
        message (the system prompt and the question); empty without a conversation."""
        for i, msg in enumerate(self.messages):
            if isinstance(msg, dict) and msg.get("role") == "user":
                return self.messages[: i + 1]
        return self.messages[:1]

    def final_answer(self) -> dict[str, Any] | None:
        """The last assistant message of the conversation, if any."""
        for msg in reversed(self.messages):
            if isinstance(msg, dict) and msg.get("role") == "assistant":
                return msg
        return None

    def turn_of(self, span: SpanRecord) -> dict[str, Any] | None:
        """The assistant message a generation span produced (its text and the tool calls
        that followed it), when the pipeline linked them (:data:`MESSAGE_INDEX`)."""
        index = span.attributes.get(MESSAGE_INDEX)
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(self.messages):
            msg = self.messages[index]
            if isinstance(msg, dict) and msg.get("role") == "assistant":
                return msg
        return None

    def walk(self) -> Iterator[tuple[int, SpanRecord]]:
        """(depth, span) pairs in tree order."""
        depth: dict[str | None, int] = {}
        for i, span in enumerate(self.spans):
            # a span whose parent is missing (dropped) sits under the root
            d = 0 if i == 0 else depth.get(span.parent_id, 0) + 1
            depth[span.span_id] = d
            yield d, span

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSONL schema ``rtrace.trajectory/1`` (see docs/jsonl-schema.md)."""
        spans = self.spans
        start, end = spans[0].start_ns, max([s.end_ns for s in spans])
        kinds = [s.kind for s in spans]
        return {
            "schema": SCHEMA,
            "trace_id": self.trace_id,
            "name": self.name,
            "step": self.step,
            "sample_index": self.sample_index,
            "rollout_n": self.rollout_n,
            "validate": self.validate,
            "experiment": self.experiment,
            "group_id": self.group_id,
            "policy_version": self.policy_version,
            "extra": self.extra,
            "reward": self.reward,
            "outcome": self.outcome,
            "annotations": self.annotations,
            "kept": self.kept,
            "status": self.status,
            "error": self.error,
            "partial": self.partial,
            "dropped_spans": self.dropped_spans,
            "start_ns": start,
            "end_ns": end,
            "duration_ms": (end - start) / 1e6,
            "num_turns": kinds.count("generation"),
            "num_tool_calls": kinds.count("tool"),
            "messages": self.messages,
            "health": self.health,
            "health_checks": self.health_checks,
            "worker": self.worker,
            "policy_version_end": self.policy_version_end,
            "crossed_update": self.crossed_update,
            "spans": [s.to_dict() for s in spans],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trajectory":
        """Rebuild a trajectory from :meth:`to_dict` output (e.g. a JSONL line)."""
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not an {SCHEMA} record: schema={data.get('schema')!r}")
        return cls(
            trace_id=data["trace_id"],
            name=data["name"],
            spans=[SpanRecord.from_dict(s) for s in data["spans"]],
            step=data.get("step"),
            sample_index=data.get("sample_index"),
            rollout_n=data.get("rollout_n"),
            validate=bool(data.get("validate", False)),
            experiment=data.get("experiment"),
            group_id=data.get("group_id"),
            policy_version=data.get("policy_version"),
            extra=data.get("extra") or {},
            reward=_float_or_none(data.get("reward")),
            outcome=data.get("outcome") or {},
            annotations=data.get("annotations") or {},
            kept=list(data.get("kept") or []),
            status=data.get("status", "ok"),
            error=data.get("error"),
            partial=bool(data.get("partial", False)),
            dropped_spans=int(data.get("dropped_spans", 0)),
            messages=data.get("messages") or [],
            health=data.get("health"),
            health_checks=data.get("health_checks"),
            worker=data.get("worker"),
            policy_version_end=data.get("policy_version_end"),
            crossed_update=data.get("crossed_update"),
        )


def verdict_of(status: str, partial: bool, finish_reason: str | None, outcome: dict[str, Any]) -> str:
    """A rollout's verdict, one word a person can search for: ``error``, ``partial`` (its
    root never ended), ``truncated`` (the last generation stopped at ``length``), else
    ``correct`` / ``wrong`` when the outcome says (``correct=True/False``), else ``ok``."""
    if status == "error":
        return "error"
    if partial:
        return "partial"
    if finish_reason == "length":
        return "truncated"
    correct = outcome.get("correct")
    if isinstance(correct, bool):
        return "correct" if correct else "wrong"
    return "ok"


#: Significant digits of a per-token value in JSON (float32 holds about 7).
TOKEN_DIGITS = 6


def token_list(values: Any) -> list[Any]:
    """Per-token values as a JSON list: numbers rounded to :data:`TOKEN_DIGITS` significant
    digits (so each is written short), None where a value is not finite."""
    if hasattr(values, "dtype"):  # a numpy array: rounded in one pass
        import numpy as np

        a = values.astype(np.float64)
        finite = np.isfinite(a)
        with np.errstate(divide="ignore", invalid="ignore"):
            exp = TOKEN_DIGITS - 1 - np.floor(np.log10(np.abs(np.where(finite & (a != 0), a, 1.0))))
            # an integer divided by an exact power of ten reads back as the short decimal
            small = np.round(a * 10.0 ** np.maximum(exp, 0)) / 10.0 ** np.maximum(exp, 0)
            rounded = np.where(exp >= 0, small, np.round(a / 10.0 ** -np.minimum(exp, 0)) * 10.0 ** -np.minimum(exp, 0))
        out = rounded.tolist()
        if not finite.all():
            out = [v if ok else None for v, ok in zip(out, finite.tolist())]
        return out
    return [float(f"{v:.{TOKEN_DIGITS}g}") if isinstance(v, (int, float)) and math.isfinite(v) else None
            for v in values]


#: The compact form of per-token values in backends that keep span metadata as JSON
#: (trackio, MLflow, OTLP): little-endian float32, base64 (about 5.5 kB per 1,000 tokens).
TOKEN_ENCODING = "float32-le-base64"


def token_field(token_values: dict[str, Any]) -> dict[str, Any]:
    """A generation's per-token values in the compact form: ``{"encoding":`` :data:`TOKEN_ENCODING`
    ``, "length": n, "arrays": {name: base64}}``; :func:`read_token_field` reads it back."""
    import base64
    from array import array

    arrays, n = {}, 0
    for name, values in token_values.items():
        if hasattr(values, "astype"):
            raw = values.astype("<f4").tobytes()
            n = len(values)
        else:
            a = array("f", [float("nan") if v is None else v for v in values])
            if a.itemsize != 4:  # pragma: no cover - every platform rtrace runs on
                raise ValueError("float is not 4 bytes")
            raw = a.tobytes() if sys.byteorder == "little" else _swapped(a)
            n = len(a)
        arrays[name] = base64.b64encode(raw).decode("ascii")
    return {"encoding": TOKEN_ENCODING, "length": n, "arrays": arrays}


def _swapped(a: Any) -> bytes:  # pragma: no cover - big-endian hosts
    a = a.__copy__()
    a.byteswap()
    return a.tobytes()


def read_token_field(field: dict[str, Any]) -> dict[str, list[float]]:
    """The arrays of a :func:`token_field` as lists of floats (NaN where not finite)."""
    import base64
    from array import array

    if field.get("encoding") != TOKEN_ENCODING:
        raise ValueError(f"not {TOKEN_ENCODING}: {field.get('encoding')!r}")
    out = {}
    for name, text in field["arrays"].items():
        a = array("f")
        a.frombytes(base64.b64decode(text))
        if sys.byteorder != "little":  # pragma: no cover
            a.byteswap()
        out[name] = a.tolist()
    return out


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and not value.keys().isdisjoint(_TEXT_KEYS):  # (the usual miss in C)
        for key in _TEXT_KEYS:
            if isinstance(value.get(key), str):
                return value[key]
    return None


_TEXT_KEYS = ("content", "text", "response_text", "output")


def chat_argument(value: Any) -> tuple[str, list[dict[str, Any]]] | None:
    """``(argument name, messages)`` when a captured input holds a conversation: an argument
    of :data:`CHAT_KEYS` that is a non-empty list of ``{"role": ...}`` dicts."""
    if isinstance(value, dict) and not value.keys().isdisjoint(CHAT_KEYS):  # (the usual miss in C)
        for key in CHAT_KEYS:
            msgs = value.get(key)
            if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs):
                return key, msgs
    return None


def response_text(span: SpanRecord) -> str | None:
    """The assistant text of a generation span, if any is readable."""
    text = span.attributes.get("rtrace.response_text")
    if isinstance(text, str):
        return text
    return _text(span.output)


def tool_call_id(span: SpanRecord) -> str:
    """The tool call id of a tool span: the captured one (``gen_ai.tool.call.id``), else one
    derived from the span id (``call_<first 8 hex>``). The conversation's tool calls and the
    exported ``gen_ai.tool.call.id`` use this one rule."""
    call_id = span.attributes.get("gen_ai.tool.call.id")
    return str(call_id) if call_id is not None else f"call_{span.span_id[:8]}"
