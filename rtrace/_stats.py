"""Process-wide counters behind ``rtrace.stats()`` and log-once warnings.

Every problem rtrace meets at run time (a sink that raises, a value that cannot be
serialised, a queue that is full) is counted here and logged once per kind, never
raised into the traced program.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("rtrace")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_warned: set[str] = set()


def incr(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name``."""
    with _lock:
        _counts[name] += n


def snapshot() -> dict[str, int]:
    """A copy of all counters, sorted by name."""
    with _lock:
        return dict(sorted(_counts.items()))


def reset() -> None:
    """Zero every counter and forget which warnings were logged (tests, reconfigure)."""
    with _lock:
        _counts.clear()
        _warned.clear()


def after_fork() -> None:
    """In a forked child: a new lock (the parent's may have been held by another thread)."""
    global _lock
    _lock = threading.Lock()


def warn_once(key: str, message: str, *args: object, exc_info: bool = False) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen; later calls are silent."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message + " (logged once; see rtrace.stats())", *args, exc_info=exc_info)
