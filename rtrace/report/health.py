"""Rollout health in the report: rates per step, and ``rtrace report --check`` for CI.

Each trajectory of a JSONL file written with health checks carries ``health``: a list of
``{"check", "detail"}`` findings, empty when healthy. A line without it was written
before the checks: its health is unknown, and it is counted apart (never as healthy).

``health/<check>_rate`` of a step = trajectories of the step's sample with that check
failing / trajectories of the step's sample that carry ``health`` (the step metrics'
trajectories, :func:`~rtrace.pipeline.metrics.in_sample`). The findings listed are every
trajectory's, those kept for the tail included.

A check that ran on none of a step's trajectories (off, or without what it needs: a
tokenizer for ``retokenization``; each trajectory lists its ``health_checks``) is "not
run" for that step, never a rate of 0. When no rollout of the run has a reward, the reward
check says so once (a note) and fails only with ``--require-reward``.

Exit codes of ``rtrace report --check`` (:data:`EXIT_CODES`): 0 every rate is within its
threshold; 1 some rate is above it (or, with ``--require-reward``, no rollout has a
reward); 2 the command is wrong (a bad ``--max-rate``, a file that cannot be read); 3 no
trajectory carries health (nothing was checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, TextIO

from ..config import HEALTH_CHECKS
from ..pipeline.metrics import in_sample
from .load import Record, by_step

__all__ = ["CHECKS", "EXIT_CODES", "StepHealth", "step_health", "parse_max_rates", "check", "check_steps",
           "step_label"]

#: The health checks of the pipeline (docs/health.md); files may carry others, read too.
CHECKS = HEALTH_CHECKS

OK, FAILED, USAGE, NO_HEALTH = 0, 1, 2, 3
#: exit code -> meaning, for ``--help`` and docs/report.md
EXIT_CODES = {OK: "every health rate is within its threshold", FAILED: "a health rate is above its threshold",
              USAGE: "bad arguments or unreadable input", NO_HEALTH: "no trajectory carries health: nothing checked"}


@dataclass
class StepHealth:
    """The health of one (validate, step)."""

    validate: bool
    step: int | None
    #: trajectories of the step's sample that carry ``health`` (the rates' denominator)
    checked: int = 0
    #: trajectories of the step's sample without ``health``: unknown
    unknown: int = 0
    #: check -> trajectories of the sample with that check failing (a trajectory counts once per check)
    failing: dict[str, int] = field(default_factory=dict)
    #: ``(record index, check, detail)`` of every finding of the step, sample or not
    findings: list[tuple[int, str, str]] = field(default_factory=list)
    #: the checks that ran on some trajectory of the step; None: unknown (files written
    #: before trajectories listed them: every check is taken to have run)
    ran: set[str] | None = None

    def rates(self) -> dict[str, float]:
        """``health/<check>_rate`` for the checks that ran and any other found; empty when
        nothing of the step was checked."""
        if not self.checked:
            return {}
        names = [c for c in CHECKS if self.ran is None or c in self.ran]
        names += sorted(set(self.failing) - set(names))
        return {f"health/{name}_rate": self.failing.get(name, 0) / self.checked for name in names}

    def not_run(self) -> list[str]:
        """The known checks that ran on none of the step's trajectories (empty when unknown)."""
        return [] if self.ran is None else [c for c in CHECKS if c not in self.ran and c not in self.failing]


def step_health(records: Sequence[Record]) -> list[StepHealth]:
    """The health of every step of ``records``, in the report's step order."""
    index = {id(rec): i for i, rec in enumerate(records)}
    out = []
    for (validate, step), recs in by_step(records).items():
        h = StepHealth(validate, step)
        for rec in recs:
            sampled = in_sample(rec.traj)
            if rec.health is None:
                h.unknown += sampled
                continue
            h.checked += sampled
            ran = rec.traj.health_checks
            if ran is not None:
                h.ran = set(ran) if h.ran is None else h.ran | set(ran)
            for name in sorted({f["check"] for f in rec.health}):
                if sampled:
                    h.failing[name] = h.failing.get(name, 0) + 1
            h.findings.extend((index[id(rec)], f["check"], f["detail"]) for f in rec.health)
        out.append(h)
    return out


def parse_max_rates(specs: Iterable[str], known: Iterable[str] = ()) -> tuple[float, dict[str, float]]:
    """``--max-rate`` values: ``RATE`` (every check) or ``CHECK=RATE``; a later one wins.
    Returns ``(default, {check: rate})``; the default is 0 (any finding fails).

    Raises:
        ValueError: a rate that is not a number in [0, 1], or a check that is neither one of
            :data:`CHECKS` nor in ``known`` (a typo must not pass CI silently).
    """
    default, per_check = 0.0, {}
    names = set(CHECKS) | set(known)
    for spec in specs:
        name, _, text = spec.rpartition("=")
        try:
            rate = float(text)
        except ValueError:
            raise ValueError(f"--max-rate {spec!r}: {text!r} is not a number") from None
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--max-rate {spec!r}: a rate is between 0 and 1")
        if not name:
            default = rate
        elif name in names:
            per_check[name] = rate
        else:
            raise ValueError(f"--max-rate {spec!r}: unknown check {name!r}; checks: {', '.join(sorted(names))}")
    return default, per_check


def _reward_ran(steps: Sequence[StepHealth]) -> bool:
    return any(h.checked and (h.ran is None or "reward" in h.ran) for h in steps)


def _rewarded(rec: Record) -> bool:
    traj = rec.traj
    return traj.reward is not None or traj.annotations.get("reward") is not None


def step_label(validate: bool, step: int | None) -> str:
    """``step 3``, ``validation step 3``, ``no step`` ..."""
    name = "no step" if step is None else f"step {step}"
    return f"validation {name}" if validate else name


def check(records: Sequence[Record], specs: Sequence[str], out: TextIO, require_reward: bool = False) -> int:
    """``rtrace report --check``: print each step's health rates against the thresholds and
    what failed; return the exit code (:data:`EXIT_CODES`). ``require_reward``: fail when
    no rollout of the run has a reward (else that is a note)."""
    return check_steps(step_health(records), len(records), lambda i: records[i].traj.trace_id, specs, out,
                       any(_rewarded(rec) for rec in records), require_reward)


def check_steps(steps: Sequence[StepHealth], total: int, trace_of: Callable[[int], str], specs: Sequence[str],
                out: TextIO, rewarded: bool = True, require_reward: bool = False) -> int:
    """:func:`check` on steps computed already (``findings`` index what ``trace_of`` names;
    a dataset's are computed by SQL, rtrace/report/dataset.py); ``rewarded``: some rollout
    of the run has a reward."""
    found = {name for h in steps for name in h.failing} | {c for h in steps for _, c, _ in h.findings}
    try:
        default, per_check = parse_max_rates(specs, found)
    except ValueError as exc:
        out.write(f"rtrace report --check: {exc}\n")
        return USAGE
    if not any(h.checked for h in steps):
        out.write(f"rtrace report --check: none of the {total} trajectories carries health (files written "
                  "before rtrace's health checks, or checks turned off): nothing was checked\n")
        return NO_HEALTH
    checked = sum(h.checked for h in steps)
    unknown = sum(h.unknown for h in steps)
    limits = ", ".join([f"{default:g} for every check"] + [f"{k}={v:g}" for k, v in sorted(per_check.items())])
    out.write(f"rtrace report --check: {checked} trajectories checked in {sum(1 for h in steps if h.checked)} "
              f"step(s)" + (f", {unknown} without health (unknown, not counted)" if unknown else "")
              + f"; max rates: {limits}\n")
    failures = []
    for h in steps:
        label = step_label(h.validate, h.step)
        if not h.checked:
            out.write(f"{label}: no health data ({h.unknown} trajectories without health)\n")
            continue
        parts = []
        for name, rate in h.rates().items():
            check_name = name[len("health/"):-len("_rate")]
            limit = per_check.get(check_name, default)
            bad = rate > limit and not math.isclose(rate, limit)
            if rate or bad:
                parts.append(f"{'FAIL' if bad else 'ok'} {check_name} {h.failing.get(check_name, 0)}/{h.checked} = "
                             f"{rate:.2%} {'>' if bad else '<='} {limit:g}")
            if bad:
                # the finding of the smallest trace id: the same example whatever order the files were read in
                example = min(((trace_of(i), d) for i, c, d in h.findings if c == check_name), default=None)
                failures.append((label, name, rate, limit, h.failing.get(check_name, 0), h.checked, example))
        skipped = h.not_run()
        out.write(f"{label}: {'; '.join(parts) if parts else 'ok'} ({h.checked} checked"
                  + (f"; not run: {', '.join(skipped)}" if skipped else "") + ")\n")
    if _reward_ran(steps) and not rewarded:
        out.write("reward: no rollout of the run recorded a reward (rtrace.record_reward / annotate reward=...): "
                  + ("FAIL (--require-reward)" if require_reward else "a note, not a failure (--require-reward "
                                                                         "fails on it)") + "\n")
        if require_reward:
            failures.append(None)
    if not failures:
        out.write("health check passed\n")
        return OK
    out.write(f"health check FAILED: {len(failures)} rate(s) above their threshold\n" if None not in failures
              else f"health check FAILED: {len(failures) - 1} rate(s) above their threshold, and no reward\n")
    for failure in failures:
        if failure is None:
            out.write("  the run: no rollout recorded a reward (--require-reward)\n")
            continue
        label, name, rate, limit, count, total, example = failure
        line = f"  {label}: {name} = {rate:.4g} > {limit:g} ({count} of {total})"
        if example is not None:
            trace_id, detail = example
            line += f"; e.g. trace {trace_id}: {detail}"
        out.write(line + "\n")
    return FAILED
