"""Capture on the hot path: make a value safe to read later, as cheaply as possible.

Agent loops extend ``prompt_ids`` in place (``prompt_ids += ...``): a reference read later
would show the final list. A list is kept with its length at call time (a
:class:`~rtrace._serialize.ListSnapshot`, sliced in the worker); a dict is
shallow-copied; anything else is kept by reference. Conversion to JSON happens in the
worker thread (:class:`rtrace._serialize.Converter`).
"""

from __future__ import annotations

from typing import Any

from .._serialize import ListSnapshot

__all__ = ["snapshot"]


def snapshot(value: Any) -> Any:
    """Hot path: ``value`` as the call saw it, by reference where that is safe."""
    cls = type(value)
    if cls is list:
        return ListSnapshot(value, len(value))
    if cls is dict:
        return value.copy()
    return value
