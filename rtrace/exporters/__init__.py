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

__all__ = ["SINKS", "create_sink"]

#: exporter name -> (module, class, pip extra)
SINKS = {
    "console": ("rtrace.exporters.console", "ConsoleSink", None),
    "jsonl": ("rtrace.exporters.jsonl", "JsonlSink", None),
    "trackio": ("rtrace.exporters.trackio", "TrackioSink", "trackio"),
    "mlflow": ("rtrace.exporters.mlflow", "MlflowSink", "mlflow"),
    "otlp": ("rtrace.exporters.otlp", "OtlpSink", "otlp"),
    "collector": ("rtrace.exporters.collector", "CollectorSink", "otlp"),
}


def create_sink(name: str, settings: Settings) -> "Sink":
    """Instantiate the sink registered under ``name``.

    Raises:
        ConfigError: the sink's optional dependency is not installed.
    """
    module_name, class_name, extra = SINKS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"RTRACE_EXPORTER={name} needs an optional dependency that is not installed "
            f"({exc.name or exc}); install it with: pip install 'rtrace[{extra}]'") from None
    return getattr(module, class_name)(settings)
