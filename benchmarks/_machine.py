"""How fast this machine runs Python right now: printed next to absolute figures."""

from __future__ import annotations

import timeit


def machine_reference() -> float:
    """Microseconds of a fixed pure-Python loop, best of 5: how fast this machine runs now."""
    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6


def reference_line() -> str:
    return (f"machine reference: sum(range(1000)) takes {machine_reference():.1f} us in this process "
            "(absolute rates move with it: this VM's speed changes with its host's load)")
