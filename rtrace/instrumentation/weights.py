"""``rtrace.mark_weight_update``: the trainer says it published new weights.

One call per update, in the process that publishes them (the trainer's driver, or each
rollout worker that loads them): a :class:`~rtrace.events.RunEvent` with the wall time, the
version, the step and a few attributes, handed to this process's pipeline (or the collector
running here), which sends it on like an annotation (docs/timeline.md). The call costs a
clock read, a small object and a queue append; it never raises into the program.
"""

from __future__ import annotations

from time import time_ns
from typing import Any

from .. import _stats
from ..events import WEIGHT_UPDATE, RunEvent
from ..pipeline import fleet
from . import _state

__all__ = ["mark_weight_update"]


def mark_weight_update(version: Any, *, step: Any = None, **attributes: Any) -> None:
    """Mark that the trainer published new weights: policy version ``version`` (an int),
    now.

    ``rtrace.mark_weight_update(7, step=7)`` where the trainer broadcasts its weights to the
    inference servers (the framework adapters call it for you). ``attributes`` (a few short
    values: ``duration_ms=``, ``servers=``) travel with it. The timeline draws it as a marker
    (``rtrace timeline``), and rollouts that ran across it are flagged (``crossed_update``)
    with the version they ended on (``policy_version_end``): docs/timeline.md.

    Never raises: a failure is counted (``weight_updates_failed``), a version that is not an
    int is dropped and counted (``weight_updates_invalid``).
    """
    try:
        target = fleet.local_target
        if target is None:
            rt = _state.get_runtime()
            if rt is None:
                return
            target = rt.intake.submit_events
        target([RunEvent(WEIGHT_UPDATE, time_ns(), version, step, None, attributes or None)])
    except Exception:
        _stats.incr("weight_updates_failed")
        _stats.warn_once("mark-weight-update", "rtrace could not record a weight update", exc_info=True)
