"""Trace and span ids that never repeat across seeded runs or forked workers.

The OTel SDK's default generator draws from Python's global ``random``, which RL
trainers seed (often with the same seed in every worker): ids repeat across runs and
workers, MLflow then overwrites earlier traces and OTLP backends merge different
rollouts. These ids come from ``os.urandom``: independent of any seed, different in a
forked child, and the program's own ``random`` state is never touched.
"""

from __future__ import annotations

import os

from opentelemetry.sdk.trace.id_generator import IdGenerator

__all__ = ["UrandomIdGenerator", "trace_id", "span_id"]


def trace_id() -> int:
    """A random, valid (non-zero) 128-bit trace id."""
    return int.from_bytes(os.urandom(16), "big") or 1


def span_id() -> int:
    """A random, valid (non-zero) 64-bit span id."""
    return int.from_bytes(os.urandom(8), "big") or 1


class UrandomIdGenerator(IdGenerator):
    """The id generator of rtrace's TracerProvider."""

    def generate_span_id(self) -> int:
        return span_id()

    def generate_trace_id(self) -> int:
        return trace_id()
