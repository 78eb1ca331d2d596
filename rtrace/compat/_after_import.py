"""Patch a framework's module when it is imported, without importing it.

An adapter's ``install()`` often runs as Ray's ``worker_process_setup_hook``: in every worker
Ray starts, vLLM engines, tool and environment pools included. Importing the framework's
module there to patch it would load vLLM, torch ... in workers that never use it.
:func:`when_imported` patches the module at once if it is imported already, else the first
time anything imports it: a ``sys.meta_path`` finder asks the other finders for the module's
spec and wraps its loader, whose ``exec_module`` runs the module, then the callbacks.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any, Callable

from .. import _stats

__all__ = ["when_imported"]

_lock = threading.Lock()
#: module name -> the callbacks waiting for its import
_pending: dict[str, list[Callable[[Any], Any]]] = {}


def when_imported(name: str, callback: Callable[[Any], Any]) -> bool:
    """Call ``callback(module)`` on the module ``name`` now if it is imported, else right after
    its first import (once). Cheap and idempotent (the same callback is kept once); an error
    in the callback is counted (``internal_errors``), never raised into the import.

    Returns:
        True when the callback ran now, False when it waits for the import.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            waiting = _pending.setdefault(name, [])
            if callback not in waiting:
                waiting.append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return False
    _run(name, callback, module)
    return True


def _run(name: str, callback: Callable[[Any], Any], module: Any) -> None:
    try:
        callback(module)
    except Exception:
        _stats.incr("internal_errors")
        _stats.warn_once(f"after-import-{name}", "rtrace could not patch %s", name, exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a waited-for module with the finders after it (the path finder, an editable
    install's finder ...) and wraps the loader they return; every other import passes by."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader (everything delegated: ``get_source`` ... still work), whose
    ``exec_module`` then runs the callbacks waiting for it. A module whose code raised is
    not patched, and stays waited for: the next import attempt patches it."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(module.__name__, [])
        for callback in callbacks:
            _run(module.__name__, callback, module)
