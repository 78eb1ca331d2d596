"""Every private MLflow name rtrace touches, each behind one small function.

MLflow offers no public API for these jobs (checked against 3.17 and 3.18; the reasons
are on each function). Nothing else in rtrace touches an MLflow private name
(``tests/test_private_apis.py`` checks the sink modules for it), and the same test
checks every name of :data:`PRIVATE_NAMES` against the installed MLflow, so an upgrade
that moves one fails there, naming it, instead of failing in a user's training job.

Names are ``"module:attribute.path"``; a path step that is an instance attribute (set
in ``__init__``) is checked on a real instance by the canary test.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["PRIVATE_NAMES", "active_run_ids_by_thread", "active_experiment_id", "supports_bulk_tags",
           "upsert_trace_tags", "supports_bulk_assessments", "insert_assessments"]

PRIVATE_NAMES = (
    # The application's active run, from the sink thread: active_run_ids_by_thread().
    "mlflow.tracking.fluent:_active_run_stack",
    "mlflow.tracking.fluent:_active_run_stack.get_all_thread_values",
    # The experiment the application chose with set_experiment(): active_experiment_id().
    "mlflow.tracking.fluent:_active_experiment_id",
    # The batch's trace tags in one upsert: upsert_trace_tags().
    "mlflow.store.tracking.sqlalchemy_store:SqlAlchemyStore.ManagedSessionMaker",
    "mlflow.store.tracking.dbmodels.models:SqlTraceTag.__table__",
    "mlflow.store.tracking.sqlalchemy_store:_bulk_upsert",
    "mlflow.utils.validation:_validate_trace_tag",
    # The batch's assessments in one transaction: insert_assessments().
    "mlflow.store.tracking.dbmodels.models:SqlAssessments.from_mlflow_entity",
    # (its columns request_id, experiment_id, timestamp_ms are read: the canary checks them too)
    "mlflow.store.tracking.dbmodels.models:SqlTraceInfo",
    "mlflow.store.tracking.utils.sql_trace_rollups:rollups_enabled",
)


def active_run_ids_by_thread() -> dict[int, str]:
    """``{thread id: run id}`` of the active MLflow run of every thread that has one
    (the top of each thread's run stack); empty when the application never imported
    MLflow (this never imports it).

    Why private: ``mlflow.active_run()`` is thread-local by design and the sink runs in
    its own thread, so it never sees a run the application started; MLflow keeps every
    thread's run stack in ``fluent._active_run_stack`` and has no public accessor for it.
    """
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return {}
    stacks = fluent._active_run_stack.get_all_thread_values()
    return {tid: stack[-1].info.run_id for tid, stack in stacks.items() if stack}


def active_experiment_id() -> str | None:
    """The experiment id the application set with ``mlflow.set_experiment()``, or None
    (also when MLflow was never imported; this never imports it).

    Why private: MLflow keeps it in the module global ``fluent._active_experiment_id``
    and exposes no getter (``fluent._get_experiment_id()`` is private too, and also
    reads environment variables, which in rtrace only ``config.py`` reads).
    """
    fluent = sys.modules.get("mlflow.tracking.fluent")
    return fluent._active_experiment_id if fluent is not None else None


def supports_bulk_tags(store: Any) -> bool:
    """Can :func:`upsert_trace_tags` write to this tracking store (a SQL store)?"""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return isinstance(store, SqlAlchemyStore)


def upsert_trace_tags(store: Any, rows: list[tuple[str, str, str]]) -> int:
    """Write ``(trace_id, key, value)`` trace tags into a SQL store with one statement.

    Keys and values go through MLflow's own tag validation (length limits, value
    truncation), as ``set_trace_tag`` does; invalid ones are skipped.

    Why private: the public ways, ``mlflow.traceTag.<k>`` root attributes (which
    ``log_spans`` turns into tags) and ``set_trace_tag``, write each tag with its own
    ``session.merge`` (a SELECT and an INSERT): with 8 tags a trajectory that is most of
    the cost of a trace, and the sink would fall below its 150 trajectories/s target.
    This is the upsert into the same ``trace_tags`` table that ``set_trace_tag`` merges
    into, nothing else.

    Returns:
        The number of tags skipped as invalid.
    """
    from mlflow.store.tracking.dbmodels.models import SqlTraceTag
    from mlflow.store.tracking.sqlalchemy_store import _bulk_upsert
    from mlflow.utils.validation import _validate_trace_tag

    valid, skipped = [], 0
    for trace_id, key, value in rows:
        try:
            key, value = _validate_trace_tag(key, value)
        except Exception:
            skipped += 1
            continue
        valid.append({"request_id": trace_id, "key": key, "value": value})
    if not valid:
        return skipped
    with store.ManagedSessionMaker(read_only=False) as session:
        dialect = session.bind.dialect.name
        if dialect in ("sqlite", "postgresql"):
            # One statement run with many parameter sets: compiled once, unlike the
            # multi-row VALUES of _bulk_upsert (compiled again for every 100 rows).
            if dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert
            stmt = insert(SqlTraceTag.__table__)
            stmt = stmt.on_conflict_do_update(index_elements=["request_id", "key"],
                                              set_={"value": stmt.excluded.value})
            session.execute(stmt, valid)
        else:
            _bulk_upsert(session, SqlTraceTag, valid)
    return skipped


def supports_bulk_assessments(store: Any) -> bool:
    """Can :func:`insert_assessments` write to this tracking store: a SQL store whose
    trace rollups (``MLFLOW_SQL_TRACE_ROLLUPS_ENABLED``, off by default) are off? With
    rollups on, ``create_assessment`` also queues rollup rebuilds, which this does not."""
    try:
        from mlflow.store.tracking.utils.sql_trace_rollups import rollups_enabled
    except ImportError:  # an MLflow without trace rollups
        return supports_bulk_tags(store)
    return supports_bulk_tags(store) and not rollups_enabled()


def insert_assessments(store: Any, assessments: list[Any]) -> int:
    """Write MLflow ``Assessment`` entities of traces already in a SQL store, in one
    transaction.

    Each row is made by MLflow's own ``SqlAssessments.from_mlflow_entity`` (value JSON,
    numeric aggregate, timestamps, a new assessment id) and gets its trace's experiment id
    and timestamp, as ``SqlAlchemyStore.create_assessment`` does for one assessment.
    Assessments of a trace the store does not hold are left out.

    Why private: ``create_assessment`` (and ``mlflow.log_feedback`` over it) opens a
    session, locks the trace row and commits per assessment: four per trajectory (reward,
    verdict, two components) took the sink far below its 150 trajectories/s target.

    Returns:
        The number of assessments left out (their trace was not found).
    """
    from mlflow.store.tracking.dbmodels.models import SqlAssessments, SqlTraceInfo

    if not assessments:
        return 0
    trace_ids = sorted({a.trace_id for a in assessments})
    with store.ManagedSessionMaker(read_only=False) as session:
        traces = {}
        for i in range(0, len(trace_ids), 500):  # bound the IN list
            rows = (session.query(SqlTraceInfo.request_id, SqlTraceInfo.experiment_id, SqlTraceInfo.timestamp_ms)
                    .filter(SqlTraceInfo.request_id.in_(trace_ids[i:i + 500])).all())
            traces.update({r[0]: (r[1], r[2]) for r in rows})
        rows, missing = [], 0
        for assessment in assessments:
            found = traces.get(assessment.trace_id)
            if found is None:
                missing += 1
                continue
            row = SqlAssessments.from_mlflow_entity(assessment)
            row.experiment_id, row.trace_timestamp_ms = found
            rows.append(row)
        session.add_all(rows)
    return missing
