"""Every private trackio name rtrace touches, each behind one small function.

trackio (0.43) offers no public API for these jobs: its public surface is
``trackio.__all__`` (``init``, ``log``, ``finish``, ``Trace``...) and ``Run.log`` /
``Run.finish``; the reasons are on each function. Nothing else in rtrace touches a
trackio private name (``tests/test_private_apis.py`` checks the sink modules for it),
and the same test checks every name of :data:`PRIVATE_NAMES` against the installed
trackio, so an upgrade that moves one fails there, naming it.

Names are ``"module:attribute.path"``; a path step that is an instance attribute (set
in ``__init__``) is checked on a real instance by the canary test.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

__all__ = ["PRIVATE_NAMES", "current_run", "run_is_finished", "runs_with_writer_threads", "run_created_at",
           "flush_run", "is_local", "stored_trace_count"]

PRIVATE_NAMES = (
    # The run trackio.init() made current in a thread: current_run(). The module is not
    # underscored but is not in trackio.__all__ either.
    "trackio.context_vars:current_run",
    # Is a run finished: run_is_finished().
    "trackio.run:Run._stop_flag",
    # Find open runs through their writer threads: runs_with_writer_threads().
    "threading:Thread._target",
    # The newest of several runs: run_created_at() (a key trackio writes into run.config).
    "trackio.run:Run.config._Created",
    # Make a run's queued logs durable now: flush_run().
    "trackio.run:Run._is_local",
    "trackio.run:Run._client_lock",
    "trackio.run:Run._flush_queues_inline",
    "trackio.run:Run._queued_logs",
    "trackio.run:Run._sending_batch",
    # Count what a local run has stored: stored_trace_count(). trackio.sqlite_storage is not
    # underscored but not in trackio.__all__; `trackio list traces` reads through it.
    "trackio.sqlite_storage:SQLiteStorage.get_trace_steps",
)


def current_run(trackio: Any = None) -> Any:
    """The run current in the calling thread's context (``trackio.init`` sets it), or
    None; None also when trackio was never imported (this never imports it).

    Why private: ``trackio.log`` uses it internally, and no public function returns it.
    """
    if trackio is None:
        trackio = sys.modules.get("trackio")
        if trackio is None:
            return None
    return trackio.context_vars.current_run.get()


def run_is_finished(run: Any) -> bool:
    """Has ``run.finish()`` (or ``trackio.finish()``) been called on this run?

    Why private: a finished run still accepts ``log`` (and drops it); trackio records
    the finish only in the ``Run._stop_flag`` event.
    """
    return run._stop_flag.is_set()


def runs_with_writer_threads(run_cls: type) -> list[Any]:
    """Every ``run_cls`` instance whose writer thread is alive, oldest thread first.

    Why private: trackio keeps no registry of runs; each ``Run`` starts one writer
    thread whose target is one of its bound methods, and ``threading.Thread`` keeps its
    target only in the private ``_target`` attribute (CPython; None once the thread
    ended). A run opened on another thread than the one that called
    ``rtrace.configure()`` is found only this way.
    """
    found = []
    for thread in threading.enumerate():
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        if isinstance(owner, run_cls):
            found.append(owner)
    return found


def run_created_at(run: Any) -> str:
    """When the run was created (ISO-8601 text, so it sorts), ``""`` when unknown.

    Why private: trackio stores it only as the reserved ``_Created`` key of
    ``run.config``.
    """
    return str((getattr(run, "config", None) or {}).get("_Created", ""))


def flush_run(run: Any, deadline: float) -> bool:
    """Make a run's queued logs durable by ``deadline`` (a ``time.monotonic()`` value).

    A local run writes its queue to SQLite now, inline, under the run's own lock (as its
    writer thread does every 0.5 s); for a remote run this waits until the sender has
    taken the queue and finished the batch in flight.

    Why private: ``Run.finish()`` is trackio's only public flush, and it ends the run,
    which may be the application's. ``_flush_queues_inline`` under ``_client_lock`` is
    what both the writer thread and ``finish()`` run.

    Returns:
        True when everything queued was written in time.
    """
    if run._is_local:
        lock = run._client_lock
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            run._flush_queues_inline()
        finally:
            lock.release()
        return True
    while time.monotonic() < deadline:
        if not run._queued_logs and run._sending_batch is None:
            return True
        time.sleep(0.05)
    return False


def is_local(run: Any) -> bool:
    """Does the run write to this machine's SQLite (no Space, no remote server)?"""
    return bool(run._is_local)


def stored_trace_count(run: Any) -> int:
    """How many traces the local SQLite store holds for ``run`` (all keys and steps).

    Why private: trackio swallows its failed writes (a read-only ``TRACKIO_DIR``: it warns
    ``trackio failed to flush metric logs`` and drops the batch), so "written" can only be
    told by reading back; the count per step that `trackio list traces` and the dashboard
    use is ``SQLiteStorage.get_trace_steps``. Raises when the store cannot be read.
    """
    from trackio.sqlite_storage import SQLiteStorage

    return int(SQLiteStorage.get_trace_steps(run.project, run_id=run.id)["total"])
