"""The sinks, one module each, and the one registry of exporter names.

Sinks are imported only when configured, so a missing optional dependency (trackio,
mlflow, opentelemetry-exporter-otlp) costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from ..config import ConfigError, Settings

if TYPE_CHECKING:
    from .base import Sink

__all__ = ["SINKS", "APP_THREAD_IMPORTS", "create_sink", "import_problem"]

#: exporter name -> (module, class, pip extra)
SINKS = {
    "console": ("rtrace.exporters.console", "ConsoleSink", None),
    "jsonl": ("rtrace.exporters.jsonl", "JsonlSink", None),
    "trackio": ("rtrace.exporters.trackio", "TrackioSink", "trackio"),
    "mlflow": ("rtrace.exporters.mlflow", "MlflowSink", "mlflow"),
    "otlp": ("rtrace.exporters.otlp", "OtlpSink", "otlp"),
    "collector": ("rtrace.exporters.collector", "CollectorSink", "otlp"),
    "parquet": ("rtrace.exporters.parquet", "ParquetSink", "parquet"),
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
        raise ConfigError(import_problem(name, extra, exc)) from None
    return sink


def import_problem(name: str, extra: str | None, exc: ImportError) -> str:
    """Why the sink ``name`` cannot be imported, and what fixes it.

    A module that is not installed: ``pip install 'rtrace[extra]'``. A module that is
    installed but fails to import (``cannot import name ...``) is a version conflict that
    reinstalling the extra cannot fix (e.g. ``transformers<5`` pins ``huggingface_hub``
    0.x, trackio 0.43 needs 1.x): the message names the installed version and every
    installed package's requirement on it."""
    missing = exc.name or ""
    top = missing.partition(".")[0]
    try:
        installed = bool(top) and importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return (f"RTRACE_EXPORTER={name} needs an optional dependency that is not installed "
                f"({missing or exc}); install it with: pip install 'rtrace[{extra}]'")
    text = f"RTRACE_EXPORTER={name}: {top} is installed but cannot be imported ({exc})"
    conflict = _requirements_on(top)
    if conflict:
        text += f"; a version conflict: {conflict}"
    return text + " (reinstalling the extra does not fix it: align those requirements)"


def _requirements_on(module: str) -> str:
    """``"huggingface_hub 0.36.0 is installed; trackio requires huggingface-hub<3,>=1.10.0;
    transformers requires ..."``: what every installed distribution asks of the one that
    provides ``module`` (empty when unknown)."""
    from importlib import metadata

    try:
        dists = metadata.packages_distributions().get(module) or [module]
        dist = dists[0]
        version = metadata.version(dist)
    except Exception:
        return ""
    key = _norm(dist)
    wants, seen = [], set()
    for d in metadata.distributions():
        owner = d.metadata["Name"] or "?"
        if _norm(owner) in seen:
            continue  # the first on sys.path is the one Python imports
        seen.add(_norm(owner))
        for req in d.requires or ():
            head = req.split(";", 1)
            if "extra ==" in (head[1] if len(head) > 1 else ""):
                continue
            req_name = head[0].strip()
            for sep in "<>=!~ [(":
                req_name = req_name.split(sep, 1)[0]
            if _norm(req_name) == key:
                wants.append(f"{owner} requires {head[0].strip()}")
    return f"{dist} {version} is installed; " + "; ".join(sorted(wants)) if wants else ""


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")
