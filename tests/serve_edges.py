"""A small run with what a researcher's run has and a tidy one lacks, written as JSONL by the
jsonl sink's own encoder, for ``rtrace serve``'s first-contact tests (tests/test_serve_first.py,
tests/ui/test_serve_page.py):

- training and validation rollouts of the same step (:data:`STEPS` training steps of
  :data:`GROUPS` x :data:`ROLLOUTS`, then a validation pass at the last step, its rewards
  higher: a mixed mean is not the training mean);
- one answer of :data:`HUGE` tokens and one rollout of :data:`SLOW_MS` among answers of 30-79
  tokens and latencies of 0.5-2 s (one outlier must not squeeze every other rollout into one bar);
- rewards of two decimals with one that is not (:data:`ODD_REWARD`: its bin's edges and a
  filter chip on it read as round numbers);
- a reward component every rollout carries (``reward/format``) and one a single rollout
  set (:data:`RARE`: it gets no default column and no curve);
- a tool result and a prompt holding a right-to-left override (:data:`BIDI_FILE` reads
  ``exe.png`` in a browser unless the override is shown).

Trajectories are built with the data model (rtrace.trajectory) and written with
``rtrace.exporters.jsonl.encode_line``; every value is set here, so the tests know them.
"""

from __future__ import annotations

import os
from typing import Any

from rtrace.exporters.jsonl import encode_line
from rtrace.trajectory import SpanRecord, Trajectory

STEPS, GROUPS, ROLLOUTS = 3, 4, 4
VALIDATION = 8  # validation rollouts at the last step
HUGE = 185_200
SLOW_MS = 600_000.0
ODD_REWARD = 1.1100249999999998
RARE = "judge_bonus"
BIDI_FILE = "\u202egnp.exe"  # stored "RLO g n p . e x e": shown "exe.png" by a browser
BIDI_TASK = "Open the attachment \u2067report\u2069 and \u202bsummarise\u202c it."
HUGE_AT = (2, 1, 3)  # (step, group, rollout)
SLOW_AT = (3, 2, 0)
ODD_AT = (1, 0, 0)
RARE_AT = (2, 3, 1)
BIDI_AT = (3, 0, 2)
SEC = 1_000_000_000


def key(step: int, group: int, rollout: int, validate: bool = False) -> str:
    return f"{'v' if validate else 't'}{step}-{group}-{rollout}"


def reward_of(step: int, group: int, rollout: int, validate: bool = False) -> float:
    if validate:
        return 1.0 if rollout % 4 else 0.75
    if (step, group, rollout) == ODD_AT:
        return ODD_REWARD
    return round(((step * 7 + group * 3 + rollout * 5) % 10) / 10, 2)


def tokens_of(step: int, group: int, rollout: int, validate: bool = False) -> int:
    if (step, group, rollout) == HUGE_AT and not validate:
        return HUGE
    return 30 + (step * 13 + group * 7 + rollout * 11 + (5 if validate else 0)) % 50


def latency_ms(step: int, group: int, rollout: int, validate: bool = False) -> float:
    if (step, group, rollout) == SLOW_AT and not validate:
        return SLOW_MS
    return 500.0 + (step * 97 + group * 61 + rollout * 37 + (11 if validate else 0)) % 1500


def _trajectory(n: int, step: int, group: int, rollout: int, validate: bool) -> Trajectory:
    where = (step, group, rollout)
    tid = f"{n:08x}0ed9e5" + "0" * 18  # its first 8 digits (what the table shows) differ
    start = (1_800_000_000 + n * 10) * SEC
    end = start + int(latency_ms(step, group, rollout, validate) * 1e6)
    tokens = tokens_of(step, group, rollout, validate)
    bidi = where == BIDI_AT and not validate
    task = BIDI_TASK if bidi else f"Question {group}: what is {group + 2} times 7?"
    result = BIDI_FILE if bidi else str((group + 2) * 7)
    answer = f"The file is {BIDI_FILE}." if bidi else f"The answer is {(group + 2) * 7}."
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": result},
                {"role": "assistant", "content": answer}]
    gen = SpanRecord(span_id=f"{n:015x}1", parent_id=f"{n:015x}0", name="chat", kind="generation",
                     start_ns=start + SEC // 100, end_ns=end - SEC // 100,
                     attributes={"gen_ai.usage.input_tokens": 40, "gen_ai.usage.output_tokens": tokens,
                                 "gen_ai.response.finish_reasons": ["stop"]})
    root = SpanRecord(span_id=f"{n:015x}0", parent_id=None, name="rollout", kind="rollout", start_ns=start,
                      end_ns=end)
    reward = reward_of(step, group, rollout, validate)
    outcome: dict[str, Any] = {"correct": reward >= 0.5, "reward/format": 0.5 if rollout % 2 else 1.0}
    if where == RARE_AT and not validate:
        outcome[RARE] = 3.0
    return Trajectory(trace_id=tid, name="rollout", spans=[root, gen], step=step, sample_index=group,
                      rollout_n=rollout, validate=validate, group_id=f"g{group}", reward=reward, outcome=outcome,
                      annotations={} if validate else {"advantage": round(reward - 0.5, 3)},
                      messages=messages, health=[], health_checks=["coordinates"])


def trajectories() -> dict[str, Trajectory]:
    """Every trajectory of the run by :func:`key`: the training steps, then the validation pass."""
    out, n = {}, 0
    for step in range(1, STEPS + 1):
        for group in range(GROUPS):
            for rollout in range(ROLLOUTS):
                out[key(step, group, rollout)] = _trajectory(n, step, group, rollout, False)
                n += 1
    for rollout in range(VALIDATION):
        out[key(STEPS, 100, rollout, True)] = _trajectory(n, STEPS, 100, rollout, True)
        n += 1
    return out


def write(folder: str) -> dict[str, Any]:
    """The run as ``folder/edges.jsonl``; returns its path and the trajectories by key."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "edges.jsonl")
    trajs = trajectories()
    with open(path, "wb") as f:
        for traj in trajs.values():
            f.write(encode_line(traj)[0])
    return {"jsonl": path, "trajectories": trajs}
