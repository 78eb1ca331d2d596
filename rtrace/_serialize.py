"""Captured values: JSON-safe, bounded, redacted conversion in the worker thread.

The decorated call only snapshots its arguments (``rtrace.instrumentation.capture``):
lists keep a reference and their length at call time (:class:`ListSnapshot`), dicts
are shallow-copied, everything else is kept by reference. The worker thread later
turns the snapshot into JSON-safe data with :class:`Converter`.

Defined forms (documented in docs/capture.md):

* a value whose JSON text is longer than ``max_chars`` becomes the string
  ``<first max_chars characters of its JSON text>…[truncated, N chars]`` (the one
  truncation marker, :func:`truncate`; N is a lower bound when conversion stopped early);
* conversion is bounded *while* it runs: at most ``max_chars`` nodes and characters
  are produced per value, so shared or self-referential containers (``a = []; a.extend([a] * 4)``)
  and huge collections cost at most that much work;
* a dict key (or dataclass field) that contains a redaction fragment (``api_key``,
  ``password``, ``x-api-key``...; ``-`` and ``_`` are the same) keeps its key and gets
  the value ``"[REDACTED]"``; inside strings, well-known token shapes (``sk-...``,
  ``hf_...``, ``ghp_...``, ``Bearer ...``) are replaced by ``[REDACTED]``;
* tuples and sets become lists, non-string dict keys become their ``str()``;
* floats stay floats, NaN and infinities included: each sink writes those in its own
  documented form; integers beyond 64 bits become their decimal string (or
  ``"<int of N bits>"`` past Python's digit limit); lone surrogates in strings become
  ``\\udXXX`` escapes;
* bytes become ``"<bytes: N>"``; numpy arrays and torch tensors of up to
  :data:`ARRAY_INLINE` elements become lists, larger ones
  ``{"shape": [...], "dtype": "...", "preview": [first elements]}`` without copying the
  whole tensor; other objects become ``repr()`` (bounded), ``"<module.Class object>"``
  for a class without its own ``__repr__`` (object's default repr has the address, which
  differs run to run); a value whose conversion fails becomes ``"<unserialisable TYPE: ERROR>"`` and only that element is lost.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import re
from typing import Any, Iterable

__all__ = ["ListSnapshot", "unsnap", "is_array", "array_to_python", "Converter", "REDACTED", "truncate",
           "attr_ok", "finite_or_str", "strict_json", "json_default", "is_plain_json", "fast_json", "json_safe",
           "json_text", "clean_text", "ARRAY_INLINE", "vouch", "vouched", "plain_json", "bidi_visible",
           "bidi_visible_messages", "BIDI_CONTROLS"]

REDACTED = "[REDACTED]"
_MAX_DEPTH = 12
_PRIMITIVES = (str, int, float, bool, type(None))
#: arrays / tensors with more elements than this are summarised, not listed
ARRAY_INLINE = 4096
_PREVIEW = 16
_INT_BITS = 64
_INT_LIMIT = 2**_INT_BITS  # ints strictly inside (-_INT_LIMIT, _INT_LIMIT) stay ints
#: An upper bound of the JSON characters one unit of a conversion's budget can produce
#: (a node costs one unit and a string character one; the longest are a 21-digit int
#: key with its value, ``"-18446744073709551615": null, ``, and a control character
#: escaped as ``\u001f``). A value that spent less than max_chars / this is not
#: encoded to check its length. Text the walk makes without spending (summaries of
#: arrays, bytes, errors) sets ``_measure`` and is checked.
_CHARS_PER_UNIT = 32
_INT_SET = frozenset((int,))
_count_of = operator.countOf
#: the types _mapping converts with :meth:`Converter._scalar`
_SCALARS = frozenset((int, bool, type(None)))
#: A string cut to max_chars is redacted over this many more characters first, so a
#: token that straddles the cut is still recognised (and replaced) whole.
_REDACT_WINDOW = 256
#: Well-known secret shapes inside strings.
_SECRET_VALUES = re.compile(
    r"\b(?:sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|xox[abpr]-[A-Za-z0-9\-]{10,}|AKIA[0-9A-Z]{16})"
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=\-]{8,}")


def truncate(text: str, max_chars: int, total: int | None = None) -> str:
    """The one truncation marker: ``text`` cut to ``max_chars`` characters, followed by
    ``…[truncated, N chars]`` (N = ``total`` or ``len(text)``). Text that fits is
    returned unchanged."""
    if total is None:
        if len(text) <= max_chars:
            return text
        total = len(text)
    return f"{text[:max_chars]}…[truncated, {total} chars]"


def clean_text(text: str) -> str:
    """``text`` with lone surrogates as ``\\udXXX`` escapes: no sink can encode them."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


#: Unicode's bidirectional controls (embeddings, overrides, isolates, marks): text holding them
#: displays in another order than it is stored (RLO + "gnp.exe" shows as "exe.png")
BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_BIDI = re.compile(f"[{BIDI_CONTROLS}]")


def bidi_visible(text: str) -> str:
    """``text`` as a person should read it on a page: each bidirectional control written as
    ``⟨U+202E⟩`` where it stands, so none reorders what follows it. For what rtrace *shows*
    (serve, the report page, trackio's and MLflow's conversation views); the data itself
    (the dataset, JSONL, JSON pages) keeps the characters as they were."""
    if not text or _BIDI.search(text) is None:
        return text
    return _BIDI.sub(lambda m: f"⟨U+{ord(m.group()):04X}⟩", text)


def bidi_visible_messages(messages: list[Any]) -> list[Any]:
    """Chat messages with :func:`bidi_visible` applied to what a viewer shows of them (text
    content, text parts, a tool message's name); copies only of the messages that change."""
    out = []
    for msg in messages:
        if isinstance(msg, dict):
            shown = dict(msg)
            content = msg.get("content")
            if isinstance(content, str):
                shown["content"] = bidi_visible(content)
            elif isinstance(content, list):
                shown["content"] = [{**part, "text": bidi_visible(part["text"])} if isinstance(part, dict)
                                    and isinstance(part.get("text"), str) else part for part in content]
            if isinstance(msg.get("name"), str):
                shown["name"] = bidi_visible(msg["name"])
            msg = shown if shown != msg else msg
        out.append(msg)
    return out


@functools.lru_cache(maxsize=8)
def _assignment_pattern(fragments: tuple[str, ...]) -> re.Pattern[str] | None:
    """``<key containing a fragment><quote?> = or : <quote?><value>`` inside text (query
    strings, ``repr()`` of objects, log lines, JSON): group 1 is kept, the value replaced."""
    if not fragments:
        return None
    keys = "|".join(re.escape(f).replace("_", "[-_]") for f in sorted(fragments, key=len, reverse=True))
    return re.compile(rf"(?i)((?:{keys})[\w-]*[\"']?\s*[=:]\s*)"
                      rf"(?!\[REDACTED\]|[\"']\[REDACTED\])(?:\"[^\"]*\"|'[^']*'|[^\s\"'&,;)}}\]]+)")


def _redact_assignment(match: re.Match[str]) -> str:
    value = match.group(0)[len(match.group(1)):]
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group(1)}{quote}{REDACTED}{quote}"


#: Lower-case substrings one of which every match of _SECRET_VALUES contains: a cheap
#: test in C before the regular expression runs (most strings contain none of them).
_TOKEN_MARKERS = ("sk-", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xoxa-", "xoxb-",
                  "xoxp-", "xoxr-", "akia", "bearer")


def _redact_text(text: str, assignment: re.Pattern[str] | None = None,
                 fragments: tuple[str, ...] = ()) -> tuple[str, int]:
    """``text`` with well-known token shapes, and values assigned to secret-looking keys
    (``api_key=...``; ``fragments`` are the keys, lower case with ``_``), replaced by
    ``[REDACTED]``; and how many were replaced."""
    if len(text) < 12:
        return text, 0
    low = text.lower()
    n = 0
    if any(marker in low for marker in _TOKEN_MARKERS) and _SECRET_VALUES.search(text):
        text, n = _SECRET_VALUES.subn(REDACTED, text)
    if assignment is not None:
        if "-" in low:
            low = low.replace("-", "_")
        if any(fragment in low for fragment in fragments) and assignment.search(text):
            text, m = assignment.subn(_redact_assignment, text)
            n += m
    return text, n


#: Strings this long or shorter have their redaction result remembered (per set of
#: redact keys): RL captures repeat the same texts (a system prompt, tool names, finish
#: reasons) in every rollout, and a dict lookup costs less than the scans. Bounded:
#: cleared when it holds _MEMO_ENTRIES (at most ~4 MiB of keys).
_MEMO_CHARS = 512
_MEMO_ENTRIES = 8192


@functools.lru_cache(maxsize=8)
def _memos(fragments: tuple[str, ...]) -> tuple[dict[str, bool], dict[str, tuple[str, int]]]:
    """The shared memos of one set of redact keys: key -> is secret, text -> redacted."""
    return {}, {}


def _remember(memo: dict, key: str, value: Any) -> None:
    if len(memo) >= _MEMO_ENTRIES:
        memo.clear()
    memo[key] = value


def attr_ok(value: Any) -> bool:
    """The one check of an OTel attribute value: a str, bool, float or 64-bit int, or a
    homogeneous list / tuple of one of those (an empty one included)."""
    cls = type(value)
    if cls is str or cls is bool or cls is float:
        return True
    if cls is int:
        return -(2**63) <= value < 2**63
    if cls is list or cls is tuple:
        if not value:
            return True
        first = type(value[0])
        if first not in (str, bool, int, float) or not all(type(v) is first for v in value):
            return False
        return first is not int or all(-(2**63) <= v < 2**63 for v in value)
    return False


class ListSnapshot:
    """A list as a call saw it: the list and its length at call time."""

    __slots__ = ("ref", "length")

    def __init__(self, ref: list, length: int) -> None:
        self.ref = ref
        self.length = length

    def value(self) -> list:
        # Appends after the call are cut off; other in-place edits would show (documented).
        return self.ref[: self.length]


def unsnap(value: Any) -> Any:
    """The captured value of a snapshot (worker thread)."""
    return value.value() if type(value) is ListSnapshot else value


def is_array(value: Any) -> bool:
    """A numpy array / scalar or a torch tensor (its type has ``tolist`` and ``shape``).

    Looked up on the type, so an object whose ``__getattr__`` raises something other
    than AttributeError (``class AttrDict(dict): __getattr__ = dict.__getitem__``) is
    not asked."""
    cls = type(value)
    known = _ARRAY_TYPES.get(cls)
    if known is None:
        known = hasattr(cls, "tolist") and hasattr(cls, "shape")
        if len(_ARRAY_TYPES) < 256:  # bounded: types are few, but a program can make them
            _ARRAY_TYPES[cls] = known
    return known


#: type -> is it an array type (:func:`is_array`); a lookup instead of two failed attribute
#: lookups (list, dict, str: every captured value asks)
_ARRAY_TYPES: dict[type, bool] = {}


def array_to_python(value: Any) -> Any:
    """``value.tolist()`` of an array or tensor (a tensor is moved to the CPU first, in
    one copy); any other value unchanged."""
    if not is_array(value):
        return value
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist()


def _numel(value: Any) -> int:
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel())
    return int(getattr(value, "size", 0) or 0)


class _Budget(Exception):
    """Raised inside a conversion when its node/character budget is spent."""


class Converter:
    """Turns captured values into bounded, redacted, JSON-safe data (worker thread only).

    Counts what it did in ``self.truncated`` / ``self.redacted`` / ``self.errors`` so the
    caller can add them to ``rtrace.stats()`` in one step.

    ``self.unplain`` only grows: each value it returned that is not plain JSON data (a
    non-finite float, an attribute value it left as it was) adds one. Everything else it
    returns is dicts, lists, exact strings, 64-bit ints, bools, None and finite floats,
    which lets the worker vouch for a trajectory none of whose values added one
    (:func:`vouch`).
    """

    def __init__(self, max_chars: int, redact_keys: Iterable[str]) -> None:
        self.max_chars = max_chars
        self.redact_keys = tuple(_norm_key(k) for k in redact_keys)
        self._assignment = _assignment_pattern(self.redact_keys)
        self._secret_keys, self._texts = _memos(self.redact_keys)
        self.truncated = 0
        self.redacted = 0
        self.errors = 0
        self.unplain = 0
        self._left = 0

    def is_secret(self, key: str) -> bool:
        hit = self._secret_keys.get(key)
        if hit is None:
            low = _norm_key(key)
            hit = any(fragment in low for fragment in self.redact_keys)
            if len(key) <= _MEMO_CHARS:
                _remember(self._secret_keys, key, hit)
        return hit

    def _redact(self, text: str) -> str:
        """``text`` redacted (:func:`_redact_text`), counted; short texts remembered."""
        if len(text) < 12:
            return text
        if len(text) > _MEMO_CHARS:
            text, n = _redact_text(text, self._assignment, self.redact_keys)
        else:
            hit = self._texts.get(text)
            if hit is None:
                hit = _redact_text(text, self._assignment, self.redact_keys)
                _remember(self._texts, text, hit)
            text, n = hit
        self.redacted += n
        return text

    def __call__(self, value: Any) -> Any:
        """JSON-safe, redacted and bounded form of ``value``."""
        cls = type(value)
        if cls is bool or value is None or (cls is int and -_INT_LIMIT < value < _INT_LIMIT):
            return value  # what the walk would return, without it (coordinates, rewards)
        if cls is float:
            if value - value != 0.0:  # NaN or an infinity (inf - inf is NaN)
                self.unplain += 1
            return value
        if cls is str:
            if len(value) < 12 and value.isascii():
                return value  # clean, too short to be redacted, within max_chars (>= 16)
            if len(value) <= self.max_chars:  # the walk's result for a short string
                return self.bound(self._redact(clean_text(value)))
        elif cls is ListSnapshot:  # token ids as the call saw them: its slice is a new list already
            ids = value.value()
            n = len(ids)
            if 0 < n and (n + 1) * _CHARS_PER_UNIT <= self.max_chars and _plain_ints(ids):
                return ids  # the walk's result (a list of n plain ints: n + 1 units, not measured)
            value = ids
        self._left = self.max_chars + 2
        self._measure = False
        try:
            data = self._convert(unsnap(value), 0)
        except _Budget:
            self.truncated += 1
            if isinstance(self._partial, str):  # already cut and marked
                return self._partial
            data = self._partial
        except Exception as exc:  # a __repr__ that raises, a broken __len__ ...
            self.errors += 1
            return _unserialisable(value, exc)
        if not self._measure and (self.max_chars + 2 - self._left) * _CHARS_PER_UNIT <= self.max_chars:
            return data  # its JSON text cannot exceed max_chars: not encoded to check
        return self.bound(data)

    def bound(self, data: Any) -> Any:
        """Truncate ``data`` (already JSON-safe) when its JSON text exceeds max_chars."""
        if isinstance(data, str):
            if len(data) <= self.max_chars:
                return data
            text = data
        elif isinstance(data, (list, dict)):
            text = json_text(data)
            if len(text) <= self.max_chars:
                return data
        else:
            return data
        self.truncated += 1
        return truncate(text, self.max_chars)

    def convert_named(self, values: dict[str, Any]) -> dict[str, Any]:
        """Values by name as ``{name: value}``; secret-looking names are redacted."""
        out: dict[str, Any] = {}
        for key, value in values.items():
            if type(key) is not str:
                key = str(key)
            if self.is_secret(key):
                self.redacted += 1
                out[key] = REDACTED
            else:
                out[key] = self(value)
        return out

    def text(self, text: str, limit: int | None = None) -> str:
        """A string that did not come through a capture (exception text, an attribute the
        application set): lone surrogates escaped, token shapes redacted, then cut to
        ``limit`` (default max_chars) with the truncation marker."""
        limit = self.max_chars if limit is None else limit
        total = len(text)
        if total > limit:
            text = text[:limit + _REDACT_WINDOW]
        text = self._redact(clean_text(text))
        if total > limit:
            self.truncated += 1
            return truncate(text, limit, total)
        return text

    def attribute(self, key: str, value: Any) -> Any:
        """An OTel attribute value as exported: redacted when its key looks secret, strings
        through :meth:`text`, integers beyond 64 bits as their decimal string."""
        if self.is_secret(key):
            self.redacted += 1
            return REDACTED
        return self._attribute_value(value)

    def _attribute_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, (list, tuple)):
            return [self._attribute_value(v) for v in value]
        cls = type(value)
        if cls is int:
            return _int(value)
        if cls is bool or value is None or (cls is float and value - value == 0.0):
            return value
        self.unplain += 1  # a non-finite float, or an object given as it is: the sink checks it
        return value

    # ------------------------------------------------------------------ the walk
    def _spend(self, n: int) -> None:
        self._left -= n
        if self._left < 0:
            raise _Budget

    def _convert(self, value: Any, depth: int) -> Any:
        # Every node costs one unit, every string character one: the walk stops once
        # max_chars are spent, whatever the shape of the value (shared sublists repeat).
        self._partial = "…"
        cls = type(value)
        # The exact types first (what the general path below does for them, in fewer steps)
        if cls is str:
            return self._str(value)
        if cls is int or cls is float or cls is bool or value is None:
            self._spend(1)
            if cls is int:
                return value if -_INT_LIMIT < value < _INT_LIMIT else self._int(value)
            if cls is float and value - value != 0.0:
                self.unplain += 1
            return value
        if (cls is dict or cls is list) and depth < _MAX_DEPTH:
            self._spend(1)
            return self._mapping(value.items(), depth) if cls is dict else self._list(value, depth)
        if cls is str or isinstance(value, str):
            return self._str(str.__str__(value))
        if cls is bool or value is None:
            self._spend(1)
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            self._spend(1)
            return self._int(int(value))
        if isinstance(value, float):
            self._spend(1)
            value = float(value)
            if value - value != 0.0:
                self.unplain += 1
            return value
        if isinstance(value, bool):
            return bool(value)
        self._spend(1)
        if depth >= _MAX_DEPTH:
            self._measure = True
            return f"<{cls.__name__} nested deeper than {_MAX_DEPTH}>"
        value = unsnap(value)
        if isinstance(value, dict):
            return self._mapping(value.items(), depth)
        if isinstance(value, (list, tuple)):
            return self._list(value, depth)
        if isinstance(value, (set, frozenset)):
            return self._sequence(sorted(value, key=repr) if len(value) <= self._left else list(value), depth)
        if isinstance(value, (bytes, bytearray, memoryview)):
            self._measure = True
            return f"<bytes: {len(value)}>"
        if is_array(value):  # numpy arrays, torch tensors
            return self._array(value, depth)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._mapping(((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)), depth)
        dump = getattr(type(value), "model_dump", None)  # pydantic v2 models (tool call objects ...)
        if callable(dump):
            return self._convert(dump(value), depth + 1)
        if cls.__repr__ is object.__repr__:
            # object's default repr holds the address: '<m.C object at 0x7f..>' differs run to
            # run (and call to call), so traces of the same rollout would not compare equal
            return self._str(f"<{cls.__module__}.{cls.__qualname__} object>")
        return self._str(repr(value))

    def _list(self, value: list | tuple, depth: int) -> list[Any]:
        # token ids and other lists of plain ints (an agent loop's prompt_ids): what the
        # walk returns, one unit per element, without a call per element
        n = len(value)
        if 0 < n < self._left and _plain_ints(value):
            self._spend(n)
            return list(value)
        return self._sequence(value, depth)

    def _str(self, text: str) -> str:
        if not text.isascii():
            text = clean_text(text)  # lone surrogates: no sink can write them
        n = len(text)
        if n < self._left:  # the usual case: spent, and a short text is not redacted
            self._left -= n + 1
            return text if n < 12 else self._redact(text)
        if n > self._left:
            # Redact before cutting: a token cut in half would no longer be recognised.
            keep = min(self.max_chars, max(0, self._left))
            head, n = _redact_text(text[:keep + _REDACT_WINDOW], self._assignment, self.redact_keys)
            self.redacted += n
            self._partial = truncate(head, keep, len(text))
            self._left = -1
            raise _Budget
        self._spend(len(text) + 1)
        return self._redact(text)

    def _mapping(self, items: Iterable[tuple[Any, Any]], depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        secret, texts = self._secret_keys, self._texts
        try:
            for k, v in items:
                # a short ASCII key or value is what _str / _convert return for it, spent here
                # without their calls (most keys and many values of RL captures); so is a
                # longer ASCII key that the redaction memo holds as clean (``finish_reason``)
                if type(k) is str and len(k) < self._left and k.isascii() and (
                        len(k) < 12 or texts.get(k) == (k, 0)):
                    self._left -= len(k) + 1
                    key = k
                else:
                    key = self._str(k) if type(k) is str else self._key(k)  # bounded, encodable, token shapes redacted
                hit = secret.get(key)
                if hit if hit is not None else self.is_secret(key):
                    self.redacted += 1
                    out[key] = REDACTED
                elif type(v) is str and len(v) < 12 and len(v) < self._left and v.isascii():
                    self._left -= len(v) + 1
                    out[key] = v
                else:
                    out[key] = self._scalar(v) if type(v) in _SCALARS else self._element(v, depth)
        except _Budget:
            out["…"] = self._partial
            self._partial = out
            raise
        return out

    def _scalar(self, value: int | bool | None) -> Any:
        """What _convert returns for a 64-bit int, a bool or None (one unit spent)."""
        self._left -= 1
        if self._left < 0:
            self._partial = "…"
            raise _Budget
        return value if type(value) is not int or -_INT_LIMIT < value < _INT_LIMIT else self._int(value)

    def _sequence(self, items: Iterable[Any], depth: int) -> list[Any]:
        out: list[Any] = []
        try:
            for v in items:
                if type(v) is str and len(v) < 12 and len(v) < self._left and v.isascii():
                    self._left -= len(v) + 1  # as in _mapping
                    out.append(v)
                else:
                    out.append(self._element(v, depth))
        except _Budget:
            out.append(self._partial)
            self._partial = out
            raise
        return out

    def _element(self, value: Any, depth: int) -> Any:
        """One element: a failure loses this element only."""
        try:
            return self._convert(value, depth + 1)
        except _Budget:
            raise
        except Exception as exc:
            self.errors += 1
            self._measure = True
            return _unserialisable(value, exc)

    def _int(self, value: int) -> int | str:
        out = _int(value)
        if type(out) is str:  # beyond 64 bits: its digits were not spent
            self._measure = True
        return out

    def _key(self, key: Any) -> str:
        try:
            if not isinstance(key, int):
                return self._str(str(key))
            return str(self._int(key))
        except _Budget:
            raise
        except Exception:
            self.errors += 1
            self._measure = True
            return f"<{type(key).__name__}>"

    def _array(self, value: Any, depth: int) -> Any:
        n = _numel(value)
        if n <= ARRAY_INLINE:
            return self._convert(array_to_python(value), depth + 1)
        flat = value.reshape(-1)[:_PREVIEW]  # a view: the tensor is not copied
        self._measure = True
        return {"shape": list(getattr(value, "shape", ())), "dtype": str(getattr(value, "dtype", "")),
                "numel": n, "preview": self._convert(array_to_python(flat), depth + 1)}


def _unserialisable(value: Any, exc: BaseException) -> str:
    return f"<unserialisable {type(value).__name__}: {type(exc).__name__}>"


def _norm_key(key: str) -> str:
    return key.lower().replace("-", "_")


def _int(value: int) -> int | str:
    if -_INT_LIMIT < value < _INT_LIMIT:
        return value
    try:
        return str(value)
    except ValueError:  # beyond sys.get_int_max_str_digits()
        return f"<int of {value.bit_length()} bits>"


def json_safe(data: Any, depth: int = 0) -> Any:
    """``data`` made encodable as strict UTF-8 JSON whatever it holds: lone surrogates
    escaped, integers past Python's digit limit as ``"<int of N bits>"``, non-finite
    floats as strings, other objects as their ``str()``. A sink's fallback for a
    trajectory that did not encode as it was; each bad value degrades alone."""
    if isinstance(data, str):
        return clean_text(data)
    if isinstance(data, bool) or data is None:
        return data
    if isinstance(data, int):
        try:
            str(data)
        except ValueError:
            return f"<int of {data.bit_length()} bits>"
        return int(data)
    if isinstance(data, float):
        return finite_or_str(data)
    if depth >= 2 * _MAX_DEPTH + 8:
        return f"<{type(data).__name__} nested too deep>"
    if isinstance(data, dict):
        return {clean_text(k) if isinstance(k, str) else str(json_safe(k, depth + 1)): json_safe(v, depth + 1)
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v, depth + 1) for v in data]
    try:
        return clean_text(str(data))
    except Exception as exc:
        return _unserialisable(data, exc)


_PLAIN = frozenset((str, int, bool, type(None)))
try:  # the json module's C encoder, made per call as JSONEncoder.encode does, without the Python layers
    from json.encoder import c_make_encoder as _c_make_encoder
    from json.encoder import encode_basestring as _encode_basestring
except ImportError:  # pragma: no cover
    _c_make_encoder = None


def json_text(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, default=str)``, in 0.4 instead of 1.3 µs for a
    small dict: the C encoder without the Python layers around it, made once and without
    the circular-reference check (what it is given is converted data, a tree); a cycle
    it meets anyway (RecursionError) goes to a checked encoder, which says so as
    ``json.dumps`` does (ValueError)."""
    if _text_encoder is None or type(value) is str:  # pragma: no cover
        return _json_text(value)
    try:
        return "".join(_text_encoder(value, 0))
    except RecursionError:
        return "".join(_c_make_encoder({}, str, _encode_basestring, None, ": ", ", ", False, False, True)(value, 0))


_json_text = json.JSONEncoder(ensure_ascii=False, default=str).encode
#: json_text's encoder: stateless without the markers of a circular check, so one serves
#: every call and thread
_text_encoder = (_c_make_encoder(None, str, _encode_basestring, None, ": ", ", ", False, False, True)
                 if _c_make_encoder is not None else None)


def _plain_ints(values: Any) -> bool:
    """A non-empty list of exact ints, each within 64 bits: what the walk keeps as it is
    (each step in C)."""
    return only_ints(values) and -_INT_LIMIT < min(values) and max(values) < _INT_LIMIT


def only_ints(values: Any) -> bool:
    """Every element is exactly an ``int`` (no bool, no numpy integer); True when empty.
    The types are checked in C (token id lists are long)."""
    if type(values) is list or type(values) is tuple:
        # counting the types that are int is a fifth faster than a set's lookups (token id
        # lists are the summary path's largest cost: benchmarks/bench_summaries.py)
        return _count_of(map(type, values), int) == len(values)
    return _INT_SET.issuperset(map(type, values))


def is_plain_json(data: Any) -> bool:
    """True when ``data`` holds only dicts, lists, strings, ints, bools, None and finite
    floats (exact types, no subclasses): data every JSON encoder writes as the same
    values. Keys, int sizes and string contents are not checked (an encoder refuses
    those). False, not an error, for data nested past Python's recursion limit."""
    try:
        return _plain(data)
    except RecursionError:  # a cycle, or absurd nesting
        return False


def _plain(data: Any) -> bool:
    kind = type(data)
    if kind is dict:
        data = data.values()
    elif kind is not list:
        return kind in _PLAIN or (kind is float and math.isfinite(data))
    if len(data) > 16 and _PLAIN.issuperset(map(type, data)):
        return True  # token ids, texts: the types of a long list checked in C, not one by one
    for value in data:
        kind = type(value)
        if kind in _PLAIN:
            continue
        if kind is float:
            if not math.isfinite(value):
                return False
        elif not _plain(value):
            return False
    return True


try:  # installed with trackio and the otlp extra; the json module writes the same values
    from orjson import OPT_APPEND_NEWLINE as _NEWLINE
    from orjson import OPT_PASSTHROUGH_DATACLASS, OPT_PASSTHROUGH_DATETIME, OPT_PASSTHROUGH_SUBCLASS
    from orjson import dumps as _orjson_dumps

    _PASSTHROUGH = OPT_PASSTHROUGH_SUBCLASS | OPT_PASSTHROUGH_DATACLASS | OPT_PASSTHROUGH_DATETIME
except ImportError:  # pragma: no cover
    _orjson_dumps = None


#: Set on a Trajectory the one-process worker built from converted values only, none of
#: them unplain (``Converter.unplain``): a sink may encode it without :func:`is_plain_json`.
_VOUCHED = "_rtrace_plain_json"


def vouch(traj: Any) -> None:
    """Mark ``traj`` as holding plain JSON data only (see :func:`vouched`)."""
    traj.__dict__[_VOUCHED] = True


def vouched(traj: Any) -> bool:
    """True when the worker vouched that ``traj`` holds plain JSON data only: no NaN or
    infinity, no object kept as it was. Its ``to_dict()`` may then go to orjson without the
    walk of :func:`is_plain_json` (a third of a JSONL line's time). A copy
    (``dataclasses.replace``) or a trajectory read back is not vouched for."""
    return getattr(traj, "__dict__", {}).get(_VOUCHED, False) is True


def fast_json(data: Any, newline: bool = False) -> bytes | None:
    """``data`` as compact UTF-8 JSON written by orjson (about a third of the json
    module's time), or None when orjson is not installed or ``data`` is not plain
    (:func:`is_plain_json`: NaN, objects given as they are) or not what orjson takes (a
    non-string key, an int beyond 64 bits, a lone surrogate, nesting past 254): then
    encode it with the json module. Where orjson writes, the values are those the json
    module writes; only a float's exponent may be spelt differently (``1e-7``)."""
    if _orjson_dumps is None or not is_plain_json(data):
        return None
    try:
        return _orjson_dumps(data, option=_NEWLINE) if newline else _orjson_dumps(data)
    except TypeError:
        return None


def plain_json(data: Any, newline: bool = False) -> bytes | None:
    """:func:`fast_json` for data known to be plain (:func:`vouched`), without the check.
    orjson still refuses, and this returns None for, subclasses, dataclasses, datetimes,
    non-string keys, ints beyond 64 bits and lone surrogates: a broken promise costs the
    json module's time, never a different line."""
    if _orjson_dumps is None:
        return None
    try:
        return _orjson_dumps(data, option=_PASSTHROUGH | _NEWLINE if newline else _PASSTHROUGH)
    except TypeError:
        return None


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
