"""Rewards and verdicts as MLflow assessments (the MLflow sink's feedback).

Each trajectory's reward terms become MLflow ``Feedback`` assessments of its trace, with
source ``CODE`` / ``rtrace``: ``reward`` (the total, a number), ``verdict`` (``correct``,
``wrong``, ``truncated``, ``error``, ``partial`` or ``ok``) and each numeric or boolean
outcome component of ``record_reward`` under its key (``outcome.<key>`` for a key named
``reward`` or ``verdict``): the names of the ``gen_ai.evaluation.result`` events
(:func:`rtrace.exporters.semconv.reward_terms`). MLflow shows each name as a column of
its traces list, and ``search_traces`` filters on them (``feedback.reward > 0.5``,
``feedback.verdict = 'wrong'``).

Writing them one call each (``mlflow.log_feedback``) costs a store transaction per
assessment; the sink writes a batch's assessments in one transaction on a SQL store
(:func:`rtrace.exporters._mlflow_private.insert_assessments`), and one request each
against a server (MLflow has no bulk endpoint for them).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from ..trajectory import Trajectory
from .semconv import reward_terms

__all__ = ["SOURCE_ID", "trajectory_assessments", "feedbacks"]

#: The assessments' source id (source type CODE).
SOURCE_ID = "rtrace"


def trajectory_assessments(traj: Trajectory) -> list[tuple[str, Any]]:
    """``[(name, value)]`` of a trajectory: ``reward`` (when a finite number), ``verdict``,
    then each outcome component (booleans as booleans, numbers as floats)."""
    out: list[tuple[str, Any]] = []
    terms = iter(reward_terms(traj))
    _, total, verdict = next(terms)
    if total is not None:
        out.append(("reward", total))
    out.append(("verdict", verdict))
    for name, value, label in terms:
        out.append((name, label == "true" if label in ("true", "false") else value))
    return out


def feedbacks(trajectories: Iterable[Trajectory], trace_ids: Sequence[str]) -> list[Any]:
    """The MLflow ``Feedback`` entities of a batch (``trace_ids``: the MLflow trace id of
    each trajectory, in order)."""
    from mlflow.entities import AssessmentSource, AssessmentSourceType, Feedback

    source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id=SOURCE_ID)
    out = []
    for traj, trace_id in zip(trajectories, trace_ids):
        for name, value in trajectory_assessments(traj):
            if isinstance(value, float) and not math.isfinite(value):
                continue
            out.append(Feedback(name=name, value=value, source=source, trace_id=trace_id))
    return out
