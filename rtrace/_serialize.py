"""Captured values: a cheap snapshot on the hot path, JSON-safe conversion in the worker.

The decorated call only calls :func:`snapshot` on each argument: lists keep a reference
and their current length (agent loops extend ``prompt_ids`` in place, and the span must
show what the call saw), dicts are shallow-copied, everything else is kept by reference.
The worker thread later turns the snapshot into JSON-safe data with :class:`Converter`:
secrets redacted, every value bounded.

Defined forms (documented in docs/capture.md):

* a value whose JSON text is longer than ``max_chars`` becomes the string
  ``<first max_chars characters of its JSON text>…[truncated, N chars]``;
* a dict key that contains a redaction fragment (``api_key``, ``password``...) keeps
  its key and gets the value ``"[REDACTED]"``;
* tuples and sets become lists, non-string dict keys become their ``str()``;
* floats stay floats, NaN and infinities included: each sink writes those in its own
  documented form;
* bytes become ``"<bytes: N>"``; numpy arrays and torch tensors become lists (or, when
  large, their JSON text truncated as above); other objects become ``repr()``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable

__all__ = ["ListSnapshot", "snapshot", "unsnap", "is_array", "array_to_python", "Converter", "REDACTED"]

REDACTED = "[REDACTED]"
_MAX_DEPTH = 12
_PRIMITIVES = (str, int, float, bool, type(None))


class ListSnapshot:
    """A list as a call saw it: the list and its length at call time."""

    __slots__ = ("ref", "length")

    def __init__(self, ref: list, length: int) -> None:
        self.ref = ref
        self.length = length

    def value(self) -> list:
        # Appends after the call are cut off; other in-place edits would show (documented).
        return self.ref[: self.length]


def snapshot(value: Any) -> Any:
    """Hot path: make ``value`` safe to read later, as cheaply as possible."""
    cls = type(value)
    if cls is list:
        return ListSnapshot(value, len(value))
    if cls is dict:
        return value.copy()
    return value


def unsnap(value: Any) -> Any:
    """The captured value of a :func:`snapshot` (worker thread)."""
    return value.value() if type(value) is ListSnapshot else value


def is_array(value: Any) -> bool:
    """A numpy array / scalar or a torch tensor (anything with ``tolist`` and ``shape``)."""
    return hasattr(value, "tolist") and hasattr(value, "shape")


def array_to_python(value: Any) -> Any:
    """``value.tolist()`` of an array or tensor (a tensor is moved to the CPU first, in
    one copy); any other value unchanged."""
    if not is_array(value):
        return value
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist()


class Converter:
    """Turns captured values into bounded, redacted, JSON-safe data (worker thread only).

    Counts what it did in ``self.truncated`` / ``self.redacted`` / ``self.errors`` so the
    caller can add them to ``rtrace.stats()`` in one step.
    """

    def __init__(self, max_chars: int, redact_keys: Iterable[str]) -> None:
        self.max_chars = max_chars
        self.redact_keys = tuple(k.lower() for k in redact_keys)
        self.truncated = 0
        self.redacted = 0
        self.errors = 0

    def is_secret(self, key: str) -> bool:
        low = key.lower()
        return any(fragment in low for fragment in self.redact_keys)

    def __call__(self, value: Any) -> Any:
        """JSON-safe, redacted and bounded form of ``value``."""
        try:
            data = self._convert(unsnap(value), 0)
        except Exception as exc:  # a __repr__ that raises, a broken __len__ ...
            self.errors += 1
            return f"<unserialisable {type(value).__name__}: {type(exc).__name__}>"
        return self.bound(data)

    def bound(self, data: Any) -> Any:
        """Truncate ``data`` (already JSON-safe) when its JSON text exceeds max_chars."""
        if isinstance(data, str):
            if len(data) <= self.max_chars:
                return data
            text = data
        elif isinstance(data, (list, dict)):
            # Cheap pre-check: short containers cannot exceed the limit.
            text = json.dumps(data, ensure_ascii=False, default=str)
            if len(text) <= self.max_chars:
                return data
        else:
            return data
        self.truncated += 1
        return f"{text[: self.max_chars]}…[truncated, {len(text)} chars]"

    def convert_named(self, values: dict[str, Any]) -> dict[str, Any]:
        """Arguments by name as ``{name: value}``; secret-looking names are redacted."""
        return {key: self._redact_or_convert(key, value) for key, value in values.items()}

    def _redact_or_convert(self, key: str, value: Any) -> Any:
        if self.is_secret(key):
            self.redacted += 1
            return REDACTED
        return self(value)

    def _convert(self, value: Any, depth: int) -> Any:
        if isinstance(value, _PRIMITIVES):
            if type(value) in _PRIMITIVES:
                return value
            # int/str/float subclasses (IntEnum, numpy scalars registered as float ...)
            if isinstance(value, bool):
                return bool(value)
            if isinstance(value, int):
                return int(value)
            if isinstance(value, float):
                return float(value)
            return str(value)
        if depth >= _MAX_DEPTH:
            return f"<{type(value).__name__} nested deeper than {_MAX_DEPTH}>"
        value = unsnap(value)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = k if isinstance(k, str) else str(k)
                if self.is_secret(key):
                    self.redacted += 1
                    out[key] = REDACTED
                else:
                    out[key] = self._convert(v, depth + 1)
            return out
        if isinstance(value, (list, tuple)):
            return [self._convert(v, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            return [self._convert(v, depth + 1) for v in sorted(value, key=repr)]
        if isinstance(value, (bytes, bytearray, memoryview)):
            return f"<bytes: {len(value)}>"
        if is_array(value):  # numpy arrays, torch tensors
            return self._convert(array_to_python(value), depth + 1)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: self._convert(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
        dump = getattr(value, "model_dump", None)  # pydantic v2 models (tool call objects ...)
        if callable(dump):
            return self._convert(dump(), depth + 1)
        return repr(value)


def json_default(value: Any) -> Any:
    """``json.dumps(default=...)`` for values that slipped through: their ``str()``."""
    return str(value)


def finite_or_str(value: float) -> float | str:
    """A float, or ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` when it is not finite."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def strict_json(data: Any) -> Any:
    """Replace non-finite floats anywhere in ``data`` by their string form (strict JSON)."""
    if isinstance(data, float):
        return finite_or_str(data)
    if isinstance(data, dict):
        return {k: strict_json(v) for k, v in data.items()}
    if isinstance(data, list):
        return [strict_json(v) for v in data]
    return data
