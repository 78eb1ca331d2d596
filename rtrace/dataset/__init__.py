"""The run as a dataset: Parquet files any engine reads (docs/dataset.md).

- :mod:`.schema`: the two tables (``trajectories``, ``spans``), versioned;
- :mod:`.encode`: trajectories to Arrow tables and back;
- :mod:`.layout`: folders, file names, the storage (local, or pyarrow / fsspec URLs);
- :mod:`.writer`: the parquet sink's writer (whole files, compaction);
- :mod:`.reader`: :func:`open_run`, a :class:`Run` queried with DuckDB.

Needs the ``parquet`` extra (pyarrow, duckdb); nothing here is imported by ``import rtrace``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["open_run", "Run", "DatasetError", "SchemaVersionError", "list_runs", "vacuum", "hf_load_kwargs"]


def __getattr__(name: str) -> Any:  # the reader imports duckdb: only when asked for
    if name in __all__:
        from . import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'rtrace.dataset' has no attribute {name!r}")
