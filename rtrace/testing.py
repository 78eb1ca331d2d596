"""Testing helpers for code traced with rtrace: a clean slate, and trajectories in memory.

::

    import rtrace.testing

    def test_my_agent_loop():
        with rtrace.testing.capture(max_traces_per_step=4) as got:
            run_my_rollouts()
        assert [t.step for t in got.trajectories] == [1, 1, 1, 1]

:func:`capture` configures rtrace with an in-memory sink (plus any settings given),
and on exit flushes and restores the previous state. :func:`reset` shuts rtrace down
and returns it to "never configured" (the first traced call then reads the
environment), with zeroed counters and no tokenizer. For pytest, add
``pytest_plugins = ["rtrace.testing"]`` to a ``conftest.py``: every test then starts
and ends with :func:`reset`, and fixture ``rtrace_capture`` yields a :class:`Captured`
with tracing on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

from . import _setup, _stats
from .exporters.base import Sink
from .instrumentation import _state
from .trajectory import Trajectory

__all__ = ["reset", "capture", "Captured", "MemorySink"]


class MemorySink(Sink):
    """A sink that keeps every trajectory it receives, in order (thread-safe)."""

    name = "memory"

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._trajectories: list[Trajectory] = []

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        with self._lock:
            self._trajectories.extend(trajectories)

    @property
    def trajectories(self) -> list[Trajectory]:
        with self._lock:
            return list(self._trajectories)


class Captured:
    """What :func:`capture` collected. ``trajectories`` flushes first."""

    def __init__(self, sink: MemorySink) -> None:
        self.sink = sink

    @property
    def trajectories(self) -> list[Trajectory]:
        """Every trajectory exported so far (flushes rtrace first)."""
        _setup.flush(30)
        return self.sink.trajectories

    def stats(self) -> dict[str, int]:
        """``rtrace.stats()``."""
        return _setup.stats()


def reset() -> None:
    """Shut rtrace down and forget its configuration: unconfigured (the environment is
    read on the first traced call), counters zeroed, warnings re-armed, no tokenizer."""
    _setup.shutdown()
    _state.set_runtime(_state.UNSET)
    _stats.reset()
    _setup._tokenizer = None
    _setup._offered = None
    _setup._fork_kwargs = None


@contextlib.contextmanager
def capture(**settings: Any) -> Iterator[Captured]:
    """Tracing on with an in-memory sink (and ``settings``), for the ``with`` block.

    Extra sinks can be given with ``sinks=[...]``; ``exporter`` defaults to none (only
    the memory sink). On exit rtrace is flushed and :func:`reset`.
    """
    sink = MemorySink()
    sinks = list(settings.pop("sinks", ()))
    settings.setdefault("export_interval_s", 0.02)
    _setup.configure(sinks=[sink, *sinks], **settings)
    try:
        yield Captured(sink)
    finally:
        _setup.flush(30)
        reset()


# ----------------------------------------------------------------------------- pytest plugin
try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(autouse=True)
    def _rtrace_reset() -> Iterator[None]:
        """Every test starts unconfigured and leaves no pipeline or open trajectory behind."""
        reset()
        assert _state.FRAME.get() is None, "an rtrace trajectory leaked from an earlier test"
        yield
        reset()

    @pytest.fixture
    def rtrace_capture() -> Iterator[Captured]:
        """Tracing on with an in-memory sink; ``.trajectories`` flushes and returns them."""
        with capture() as got:
            yield got
