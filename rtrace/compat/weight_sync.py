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

import threading
import time
from typing import Any, Callable, TypeVar

from .. import _stats
from ..instrumentation.weights import mark_weight_update

__all__ = ["published", "published_async", "published_when_done", "mark"]

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


def published_when_done(futures: list[Any], version: Any, step: Any, start: float, *, name: str,
                        **attributes: Any) -> None:
    """Mark a weight update of ``version`` when every one of ``futures`` (``concurrent.futures``
    futures of the calls that push the weights, e.g. Ray's ``ObjectRef.future()``) has
    finished, none failed or cancelled: for a publish whose caller waits for it later. The mark
    runs on the thread that finishes the last one; ``start`` is the publish's
    ``time.perf_counter()`` at its call. Returns at once."""
    left = [len(futures)]
    failed = [False]
    lock = threading.Lock()

    def done(future: Any) -> None:
        try:
            bad = future.cancelled() or future.exception() is not None
        except Exception:
            bad = True
        with lock:
            failed[0] = failed[0] or bad
            left[0] -= 1
            last = left[0] == 0
        if last and not failed[0]:
            _mark(start, lambda: (version, step), name, attributes)

    if not futures:
        _mark(start, lambda: (version, step), name, attributes)
    for future in futures:
        future.add_done_callback(done)


def mark(version: Any, step: Any, *, name: str, **attributes: Any) -> None:
    """Mark a weight update now (the publish has returned). ``name``: the adapter's, for the
    one warning a failure logs (``mark_weight_update`` itself never raises)."""
    _mark(None, lambda: (version, step), name, attributes)


def _mark(start: float | None, version: Callable[[], tuple[Any, Any] | None], name: str,
          attributes: dict[str, Any]) -> None:
    try:
        found = version()
        if found is not None:
            if start is not None:
                attributes = {"duration_ms": round((time.perf_counter() - start) * 1000, 3), **attributes}
            mark_weight_update(found[0], step=found[1], **attributes)
    except Exception:
        _stats.incr("internal_errors")
        _stats.warn_once(f"{name}-weight-update", "rtrace.compat.%s could not mark a weight update", name,
                         exc_info=True)
