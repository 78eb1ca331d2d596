"""Trace and span ids that never repeat across seeded runs or forked workers.

The OTel SDK's default generator draws from Python's global ``random``, which RL
trainers seed (often with the same seed in every worker): ids repeat across runs and
workers, MLflow then overwrites earlier traces and OTLP backends merge different
rollouts. rtrace's ids come from a private ``random.Random`` seeded from ``os.urandom``:
independent of any seed the program sets (the program's own ``random`` state is never
touched), and seeded again from ``os.urandom`` in a forked child, so a fork never
repeats its parent's ids.

Why not ``os.urandom`` per id: it is a system call that releases the GIL, and with
rtrace's worker thread busy the traced call then waits for the GIL to come back (measured:
7 ids per 6-span trajectory cost most of the traced loop's time). ``getrandbits`` is a
few dozen nanoseconds and keeps the GIL.
"""

from __future__ import annotations

import os
import random

from opentelemetry.sdk.trace.id_generator import IdGenerator

__all__ = ["UrandomIdGenerator", "trace_id", "span_id"]

_rng = random.Random(os.urandom(32))
_bits = _rng.getrandbits


def _reseed() -> None:
    _rng.seed(os.urandom(32))


if hasattr(os, "register_at_fork"):  # POSIX; a spawned process imports this module afresh
    os.register_at_fork(after_in_child=_reseed)


def trace_id() -> int:
    """A random, valid (non-zero) 128-bit trace id."""
    return _bits(128) or 1


def span_id() -> int:
    """A random, valid (non-zero) 64-bit span id."""
    return _bits(64) or 1


class UrandomIdGenerator(IdGenerator):
    """The id generator of rtrace's TracerProvider (and of rtrace's tracer on an
    application's provider): :func:`trace_id` and :func:`span_id`."""

    def generate_span_id(self) -> int:
        return span_id()

    def generate_trace_id(self) -> int:
        return trace_id()
