"""rtrace: OpenTelemetry tracing for agentic RL rollouts.

Decorate the agent loop once; every sampled trajectory (generations, tool calls,
timings, decoded text, reward, RL coordinates) goes to trackio, MLflow, an OTLP
collector or JSONL. See README.md and docs/.
"""

from ._setup import configure, current_settings, flush, is_enabled, set_tokenizer, shutdown, stats
from .config import ConfigError, Settings
from .exporters.base import Sink
from .instrumentation import (
    current_coordinates,
    record_reward,
    rollout_context,
    traced,
    traced_generation,
    traced_rollout,
    traced_tool,
    wrap_context,
)
from .instrumentation.annotate import annotate, annotate_batch
from .instrumentation.batch import log_rollout_batch
from .instrumentation.weights import mark_weight_update
from .instrumentation.propagation import extract, inject
from .gateway.access import gateway_access
from ._setup import start_collector
from .trajectory import SpanRecord, Trajectory

__version__ = "0.1.0"

__all__ = [
    "Collector",
    "ConfigError",
    "Settings",
    "Sink",
    "SpanRecord",
    "Trajectory",
    "annotate",
    "annotate_batch",
    "configure",
    "current_coordinates",
    "current_settings",
    "extract",
    "flush",
    "gateway_access",
    "inject",
    "is_enabled",
    "log_rollout_batch",
    "mark_weight_update",
    "open_run",
    "record_reward",
    "rollout_context",
    "set_tokenizer",
    "shutdown",
    "start_collector",
    "stats",
    "traced",
    "traced_generation",
    "traced_rollout",
    "traced_tool",
    "wrap_context",
]


def open_run(path, connection=None):
    """Open a run's dataset, written by the ``parquet`` exporter (docs/dataset.md): a
    :class:`rtrace.dataset.Run` whose views ``trajectories`` and ``spans`` DuckDB queries,
    and which is its ``trajectories`` relation too::

        rtrace.open_run("rtrace_dataset/run-7").df()          # pandas, one row per trajectory
        rtrace.open_run("rtrace_dataset/run-7").sql(
            "SELECT step, avg(reward) FROM trajectories WHERE NOT validate GROUP BY step").pl()

    ``path`` is a local folder or a URL (``s3://bucket/prefix/run-7``). Needs the
    ``parquet`` extra (pyarrow, duckdb).
    """
    from .dataset.reader import open_run as _open_run

    return _open_run(path, connection)


def __getattr__(name: str):  # Collector is imported on first use: it needs grpcio (the otlp extra)
    if name == "Collector":
        from .pipeline.collector import Collector

        return Collector
    raise AttributeError(f"module 'rtrace' has no attribute {name!r}")
