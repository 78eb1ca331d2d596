"""The adapters' weight-update hook: where a trainer publishes new weights to its rollout
engines, run the trainer's own call, then ``rtrace.mark_weight_update``.

Each adapter wraps the one call after which its trainer's new weights are in effect (the
broadcast returned, the engines resumed: docs/timeline.md, "What each trainer feeds") and
hands it to :func:`published`, with a function that reads the version the rollouts
generated next will carry (and the step) once the call returned. The call runs untouched:
its result is returned, its exception raised as it was, and nothing is marked for a call
that raised. The mark carries the call's wall time as ``duration_ms``; reading the version
or marking never raises into the trainer (counted: ``internal_errors``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from .. import _stats
from ..instrumentation.weights import mark_weight_update

__all__ = ["published", "published_async"]

T = TypeVar("T")


def published(call: Callable[[], T], version: Callable[[], tuple[Any, Any] | None], *, name: str,
              **attributes: Any) -> T:
    """Run ``call()`` (the trainer's publish), then mark a weight update of ``version()``.

    Args:
        call: the trainer's own call, with its arguments bound.
        version: read after ``call`` returned: ``(policy version, step)``, or None when this
            call published nothing rtrace can name (then nothing is marked).
        name: the adapter's name, for the one warning a failure logs.
        **attributes: a few short values the mark carries beside ``duration_ms``.

    Returns:
        What ``call()`` returned.
    """
    start = time.perf_counter()
    out = call()  # the trainer's exception, if any, is raised here, as it was: nothing is marked
    _mark(start, version, name, attributes)
    return out


async def published_async(call: Callable[[], Any], version: Callable[[], tuple[Any, Any] | None], *, name: str,
                          **attributes: Any) -> Any:
    """:func:`published` for a coroutine function's call (``call()`` returns the awaitable)."""
    start = time.perf_counter()
    out = await call()
    _mark(start, version, name, attributes)
    return out


def _mark(start: float, version: Callable[[], tuple[Any, Any] | None], name: str, attributes: dict[str, Any]) -> None:
    duration_ms = round((time.perf_counter() - start) * 1000, 3)
    try:
        found = version()
        if found is not None:
            mark_weight_update(found[0], step=found[1], duration_ms=duration_ms, **attributes)
    except Exception:
        _stats.incr("internal_errors")
        _stats.warn_once(f"{name}-weight-update", "rtrace.compat.%s could not mark a weight update", name,
                         exc_info=True)
