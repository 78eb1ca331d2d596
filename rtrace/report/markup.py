"""HTML built by construction, so untrusted text cannot become markup.

Prompts, answers, tool output, group names, health details and even trace ids come from
the traced program: they are untrusted text. Every view of ``rtrace report --html`` and
``rtrace serve`` builds its HTML with :func:`h`, which escapes every text child and every
attribute value, and writes the bidirectional controls of what a person reads as
``⟨U+202E⟩`` (a file name ``\\u202egnp.exe`` would otherwise read ``exe.png``); the only
way to insert markup is :class:`Raw`, which is used for the SVG
that :mod:`rtrace.report.plots` built (and escaped) itself. The page's script follows the
same rule (``textContent`` only). An answer holding ``<script>`` or ``onerror=`` is shown as
those characters (tests/test_serve.py, tests/ui/test_serve_page.py).
"""

from __future__ import annotations

import html
import json
from typing import Any, Iterable
from urllib.parse import urlencode

from .._serialize import bidi_visible

__all__ = ["Raw", "h", "esc", "shown", "join", "json_script", "query_string"]


class Raw(str):
    """Markup that is already safe (made by this package): inserted as it is."""

    __slots__ = ()


def esc(text: Any) -> str:
    """``text`` escaped for HTML text and double- or single-quoted attribute values."""
    return html.escape(str(text), quote=True)


def shown(text: Any) -> str:
    """``text`` escaped as :func:`esc` does, its bidirectional controls made visible
    (:func:`rtrace._serialize.bidi_visible`: ``\\u202egnp.exe`` is not shown as ``exe.png``)."""
    return html.escape(bidi_visible(str(text)), quote=True)


#: attributes whose value a person reads (the rest, ``href``, ``value``, ``data-filter`` ...,
#: must keep the text as it is: a link or a form sends it back)
_SHOWN_ATTRS = frozenset({"title", "aria-label", "placeholder", "alt", "data-tip"})


#: elements without a closing tag
_VOID = frozenset({"br", "hr", "img", "input", "meta", "link", "col", "wbr"})


def _children(children: Iterable[Any], out: list[str]) -> None:
    for child in children:
        if child is None or child is False or child is True:
            continue
        if isinstance(child, Raw):
            out.append(child)
        elif isinstance(child, (list, tuple)) or (hasattr(child, "__iter__") and not isinstance(child, (str, bytes))):
            _children(child, out)
        else:
            out.append(shown(child))


def h(tag: str, attrs: dict[str, Any] | None = None, *children: Any) -> Raw:
    """``<tag attrs>children</tag>``: attribute values and text children escaped; a
    :class:`Raw` child inserted as is; lists flattened; ``None`` / ``False`` skipped (an
    attribute ``True`` is written bare). ``attrs`` keys ``class_`` / ``for_`` lose their ``_``."""
    out = ["<", tag]
    for key, value in (attrs or {}).items():
        if value is None or value is False:
            continue
        name = key[:-1] if key.endswith("_") else key  # class_, for_
        if name.startswith(("data_", "aria_")):
            name = name.replace("_", "-")
        out.append(f" {name}" if value is True else f' {name}="{shown(value) if name in _SHOWN_ATTRS else esc(value)}"')
    out.append(">")
    if tag in _VOID:
        return Raw("".join(out))
    _children(children, out)
    out.append(f"</{tag}>")
    return Raw("".join(out))


def join(parts: Iterable[Any]) -> Raw:
    """Parts concatenated, each escaped unless :class:`Raw`."""
    out: list[str] = []
    _children(parts, out)
    return Raw("".join(out))


def json_script(element_id: str, value: Any) -> Raw:
    """A ``<script type="application/json">`` block holding ``value``: ``<``, ``>`` and
    ``&`` are written as ``\\u003c`` ... so no text in it can close the element."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Raw(f'<script type="application/json" id="{esc(element_id)}">{text}</script>')


def query_string(params: Iterable[tuple[str, Any]]) -> str:
    """``?a=1&b=x`` of the pairs whose value is not None or ``""`` (``""`` when none)."""
    pairs = [(k, str(v)) for k, v in params if v is not None and v != ""]
    return "?" + urlencode(pairs) if pairs else ""
