"""The sinks, one module each, and the one registry of exporter names.

Sinks are imported only when configured, so a missing optional dependency (trackio,
mlflow, opentelemetry-exporter-otlp) costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..config import ConfigError, Settings

if TYPE_CHECKING:
    from .base import Sink

__all__ = ["SINKS", "APP_THREAD_IMPORTS", "create_sink"]

#: exporter name -> (module, class, pip extra)
SINKS = {
    "console": ("rtrace.exporters.console", "ConsoleSink", None),
    "jsonl": ("rtrace.exporters.jsonl", "JsonlSink", None),
    "trackio": ("rtrace.exporters.trackio", "TrackioSink", "trackio"),
    "mlflow": ("rtrace.exporters.mlflow", "MlflowSink", "mlflow"),
    "otlp": ("rtrace.exporters.otlp", "OtlpSink", "otlp"),
    "collector": ("rtrace.exporters.collector", "CollectorSink", "otlp"),
}


#: exporter name -> the backend modules its sink imports, imported by create_sink() on
#: the thread that configures rtrace (the application's) instead of in the sink thread.
#: Two threads importing one package at once can deadlock on the import system's
#: per-module locks; CPython then raises ``_DeadlockError`` in one of them, and that
#: was the application's own ``import mlflow`` in 26 of 50 runs (the package was left
#: half-initialised too). Importing here costs the configure() call the import time
#: (~1.5 s for mlflow), never a traced call, and the application's later ``import
#: mlflow`` is a dictionary lookup. The list names what the sink imports at its first
#: export (rtrace/exporters/mlflow.py); a module missing here is imported in the sink
#: thread as before. MlflowSink adds the modules of its URI's tracking store
#: (``exporters.mlflow._import_store_modules``).
APP_THREAD_IMPORTS: dict[str, tuple[str, ...]] = {
    "mlflow": ("mlflow", "mlflow.entities", "mlflow.exceptions", "mlflow.tracing.client", "mlflow.tracking",
               "mlflow.utils.rest_utils"),
    # the same race, not reproduced but of the same kind; trackio reads TRACKIO_DIR here
    "trackio": ("trackio",),
}


def create_sink(name: str, settings: Settings) -> "Sink":
    """Instantiate the sink registered under ``name``, and import its backend's modules
    (:data:`APP_THREAD_IMPORTS`) on the calling thread.

    Raises:
        ConfigError: the sink's optional dependency is not installed.
    """
    module_name, class_name, extra = SINKS[name]
    try:
        module = importlib.import_module(module_name)
        sink = getattr(module, class_name)(settings)
        for backend_module in APP_THREAD_IMPORTS.get(name, ()):
            importlib.import_module(backend_module)
    except ImportError as exc:
        raise ConfigError(
            f"RTRACE_EXPORTER={name} needs an optional dependency that is not installed "
            f"({exc.name or exc}); install it with: pip install 'rtrace[{extra}]'") from None
    return sink
