"""The page's data: one compact JSON object the page's script reads (docs/report.md).

Compact so 10,000 trajectories stay a few MB: each trajectory is one array whose
positions are named by ``fields``; every text (message contents, answers, group and
prompt keys, span names, health details) is stored once in ``strings`` and referred to
by its index (a system prompt shared by every trajectory is written once, a question once
per prompt); message contents are cut to ``max_chars`` and conversations to
``max_messages`` with rtrace's one truncation marker (``…[truncated, N chars]``).

Every figure the page shows about a step is computed here, with the same code as the
step metrics (:class:`~rtrace.pipeline.metrics.StepStats`), so the page and the sinks agree.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from .._serialize import strict_json, truncate
from ..pipeline.metrics import in_sample
from ..pipeline.sampling import prompt_key
from ..trajectory import Trajectory
from . import plots
from .health import StepHealth, step_health, step_label
from .load import Record, by_step, group_of
from .table import step_stats

__all__ = ["FIELDS", "FAILURES", "MAX_CHARS", "MAX_MESSAGES", "MAX_SPANS", "page_data", "metric_text",
           "failures", "passed"]

#: the positions of a trajectory's array in the page data
FIELDS = ("trace_id", "step", "sample_index", "rollout_n", "group", "prompt", "reward", "advantage", "pass",
          "fail", "error", "finish", "turns", "tools", "tokens_in", "tokens_out", "ms", "gen_ms", "tool_ms",
          "sampled", "health", "answer", "conv", "spans", "meta")
#: why a trajectory is listed as a failure (its ``fail`` field holds indices into this)
FAILURES = ("error", "truncated", "partial", "incorrect", "reward ≤ 0", "no reward")
#: message contents (and tool-call arguments, error texts) are cut to this many characters
MAX_CHARS = 4000
#: a longer conversation keeps its first 2 and last MAX_MESSAGES - 2 messages
MAX_MESSAGES = 40
#: generation and tool spans shown per trajectory (its timeline)
MAX_SPANS = 64
_ERROR_CHARS = 300


class _Strings:
    """The string table: each distinct text once."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: str | None) -> int | None:
        if text is None:
            return None
        i = self.index.get(text)
        if i is None:
            i = self.index[text] = len(self.index)
        return i

    def table(self) -> list[str]:
        return list(self.index)


def _number(value: Any) -> Any:
    """A finite number as is; NaN / infinities as the strings JSONL uses; else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _truncated(traj: Trajectory) -> bool:
    """A generation stopped by ``length`` (the step metrics' ``truncated_rate``)."""
    return any(s.kind == "generation" and "length" in (s.attributes.get("gen_ai.response.finish_reasons") or ())
               for s in traj.spans)


def passed(traj: Trajectory) -> bool | None:
    """``outcome["correct"]`` when it is a bool, else ``reward > 0`` when the reward is finite."""
    correct = traj.outcome.get("correct")
    if isinstance(correct, bool):
        return correct
    reward = _finite(traj.reward)
    return None if reward is None else reward > 0


def failures(traj: Trajectory) -> list[int]:
    """Indices into :data:`FAILURES` of why ``traj`` failed; empty when it did not."""
    reward = _finite(traj.reward)
    return [i for i, failed in enumerate((
        traj.status == "error", _truncated(traj), traj.partial, traj.outcome.get("correct") is False,
        reward is not None and reward <= 0, reward is None)) if failed]


def metric_text(name: str, value: float) -> str:
    """How the page writes a step metric: fractions and rates as percentages, latencies in ms."""
    if name.endswith(("_frac", "_rate")):
        return plots.fmt_number(value, "%")
    if name.startswith("latency_ms"):
        return plots.fmt_number(round(value, 1)) + " ms"
    return plots.fmt_number(value)


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type"):
                parts.append(f"[{str(part['type']).replace('_url', '')}]")
            else:
                parts.append(json.dumps(part, ensure_ascii=False, default=str))
        return "\n".join(parts)
    return json.dumps(value, ensure_ascii=False, default=str)


def _conversation(traj: Trajectory, s: _Strings, max_chars: int, max_messages: int) -> list[list[Any]]:
    msgs = [m for m in traj.messages if isinstance(m, dict)]
    if len(msgs) > max_messages:
        head, tail = msgs[:2], msgs[len(msgs) - (max_messages - 2):]
        cut = len(msgs) - len(head) - len(tail)
        msgs = head + [{"role": "…", "content": f"…[truncated, {cut} messages]"}] + tail
    out = []
    for m in msgs:
        text = _content(m.get("content"))
        row: list[Any] = [s(str(m.get("role", "?"))), s(text if m.get("role") == "…" else truncate(text, max_chars))]
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            row.append([[s(str((c.get("function") or {}).get("name", "?"))),
                         s(truncate(_content((c.get("function") or {}).get("arguments")), max_chars))]
                        for c in calls if isinstance(c, dict)])
        elif m.get("role") == "tool" and m.get("name") is not None:
            row.append(s(str(m["name"])))
        out.append(row)
    return out


def _spans(traj: Trajectory, s: _Strings) -> tuple[list[list[Any]], int]:
    t0 = traj.start_ns
    rows, hidden = [], 0
    for span in traj.spans:
        if span.kind not in ("generation", "tool") and span.status != "error":
            continue
        if len(rows) >= MAX_SPANS:
            hidden += 1
            continue
        reasons = span.attributes.get("gen_ai.response.finish_reasons") or ()
        rows.append([span.kind[0] if span.kind in ("generation", "tool") else span.kind, s(span.name),
                     round((span.start_ns - t0) / 1e6, 1), round(span.duration_ms, 1), int(span.status == "error"),
                     s(str(reasons[-1])) if reasons else None])
    return rows, hidden


def _meta(traj: Trajectory, s: _Strings, max_chars: int, hidden_spans: int) -> list[list[int]]:
    """``[[name, JSON text], ...]`` (string indices: an outcome such as ``{"correct":true}``
    is stored once for every trajectory that has it)."""
    meta = []
    annotations = {k: v for k, v in traj.annotations.items() if k != "advantage"}  # advantage has its own field
    for name, value in (("name", traj.name), ("policy_version", traj.policy_version), ("outcome", traj.outcome),
                        ("annotations", annotations), ("extra", traj.extra), ("kept", traj.kept),
                        ("partial", traj.partial or None), ("dropped_spans", traj.dropped_spans or None),
                        ("spans_not_shown", hidden_spans or None)):
        if value in (None, {}, []):
            continue
        text = json.dumps(strict_json(value), ensure_ascii=False, default=str, separators=(",", ":"))
        meta.append([s(name), s(text if len(text) <= max_chars else json.dumps(truncate(text, max_chars)))])
    return meta


def _trajectory(rec: Record, step_index: int, sampled: bool, s: _Strings, max_chars: int,
                max_messages: int) -> list[Any]:
    t = rec.traj
    gen = sum(sp.duration_ms for sp in t.spans if sp.kind == "generation")
    tool = sum(sp.duration_ms for sp in t.spans if sp.kind == "tool")
    reasons = [r for sp in t.spans if sp.kind == "generation"
               for r in (sp.attributes.get("gen_ai.response.finish_reasons") or ())]
    tokens_in = sum(_int(sp.attributes.get("gen_ai.usage.input_tokens")) for sp in t.spans if sp.kind == "generation")
    tokens_out = sum(_int(sp.attributes.get("gen_ai.usage.output_tokens")) for sp in t.spans
                     if sp.kind == "generation")
    answer = t.final_answer()
    error = t.error if t.error is not None else ("error" if t.status == "error" else None)
    spans, hidden = _spans(t, s)
    prompt = prompt_key(t.coordinates)
    health = None if rec.health is None else [[s(f["check"]), s(truncate(f["detail"], max_chars))]
                                              for f in rec.health]
    row = {
        "trace_id": t.trace_id, "step": step_index, "sample_index": t.sample_index, "rollout_n": t.rollout_n,
        "group": s(group_of(t)), "prompt": s(None if prompt is None else str(prompt)),
        "reward": _number(t.reward), "advantage": _number(t.annotations.get("advantage")), "pass": passed(t),
        "fail": failures(t), "error": None if error is None else s(truncate(str(error), _ERROR_CHARS)),
        "finish": s(str(reasons[-1])) if reasons else None, "turns": t.num_turns, "tools": t.num_tool_calls,
        "tokens_in": tokens_in, "tokens_out": tokens_out, "ms": round(t.duration_ms, 1), "gen_ms": round(gen, 1),
        "tool_ms": round(tool, 1), "sampled": int(sampled), "health": health,
        "answer": None if answer is None else s(truncate(_content(answer.get("content")), max_chars)),
        "conv": _conversation(t, s, max_chars, max_messages), "spans": spans,
        "meta": _meta(t, s, max_chars, hidden),
    }
    return [row[name] for name in FIELDS]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _health(h: StepHealth, s: _Strings) -> dict[str, Any]:
    return {"checked": h.checked, "unknown": h.unknown, "failing": h.failing,
            "rates": [[name, value, metric_text(name, value)] for name, value in h.rates().items()],
            "findings": [[i, s(check), s(detail)] for i, check, detail in h.findings]}


def page_data(records: Sequence[Record], max_chars: int = MAX_CHARS, max_messages: int = MAX_MESSAGES
              ) -> dict[str, Any]:
    """The page's data (see the module docstring); trajectories in the order of the steps."""
    s = _Strings()
    stats = step_stats(r.traj for r in records)
    health = {(h.validate, h.step): h for h in step_health(records)}
    groups = by_step(records)
    # the page lists trajectories step by step; health findings name records by their index
    order = [rec for recs in groups.values() for rec in recs]
    position = {id(rec): i for i, rec in enumerate(order)}
    page_index = [position[id(rec)] for rec in records]
    steps, trajs = [], []
    for si, ((validate, step), recs) in enumerate(groups.items()):
        first = len(trajs)
        trajs.extend(_trajectory(rec, si, in_sample(rec.traj), s, max_chars, max_messages) for rec in recs)
        st = stats.get((validate, step))
        metrics = [] if st is None else [[k.split("/", 1)[1], v, metric_text(k.split("/", 1)[1], v)]
                                         for k, v in st.values("x").items()]
        sample = [r.traj for r in recs if in_sample(r.traj)]
        rewards = [_finite(t.reward) for t in sample]
        advantages = [_finite(t.annotations.get("advantage")) for t in sample if "advantage" in t.annotations]
        zero = [] if st is None else sorted([g, rs[0], len(rs)] for g, rs in st.groups.items()
                                            if len(rs) >= 2 and max(rs) == min(rs))
        h = _health(health[(validate, step)], s)
        h["findings"] = [[page_index[i], c, d] for i, c, d in h["findings"]]
        steps.append({
            "key": f"{'v' if validate else 't'}{'-' if step is None else step}",
            "label": step_label(validate, step), "validate": validate, "step": step,
            "first": first, "n": len(recs), "sampled": len(sample), "metrics": metrics,
            "slowest": st.slowest[1] if st is not None and st.slowest[1] else None,
            "hist": {"reward": plots.histogram("reward", rewards),
                     "advantage": plots.histogram("advantage", advantages)},
            "non_finite": {"reward": sum(r is None for r in rewards),
                           "advantage": sum(a is None for a in advantages)},
            "zero_var": zero, "health": h,
            # groups of 2 or more finite rewards: zero_variance_groups_frac's denominator
            "groups_2": 0 if st is None else sum(1 for rs in st.groups.values() if len(rs) >= 2),
        })
    return {"fields": list(FIELDS), "failures": list(FAILURES), "max_chars": max_chars, "steps": steps,
            "trajectories": trajs, "strings": s.table()}
