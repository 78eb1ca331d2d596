"""A generation's response tokens coloured by one of its per-token arrays (docs/token-values.md).

Each generation span may carry ``token_values`` (``logprob``, ``old_logprob``,
``advantage``, ``loss_mask``, ``entropy`` ... aligned with its response tokens) and, with
token2text, ``rtrace.response_tokens`` (each token's own text). The overlay draws each
token as its text on a colour from the chosen array; hovering a token shows at once its
position, id (when kept), exact text and every array's value there (its ``data-tip``,
shown by ``static/tokens.js``: a native ``title`` takes a second to appear). With both
``logprob`` (the sampler) and ``old_logprob`` (the trainer), ``mismatch`` is their
difference per token (trainer − sampler: Δ, the check's quantity).

Colours are classes, a few buckets per scale (the stylesheet holds them):

- diverging (``advantage``, ``mismatch``, any array with values of both signs):
  ``d0``..``d10``, white at 0, blue below, red above, symmetric around 0 over the
  trajectory's largest magnitude;
- log-probabilities (all ≤ 0): ``q0``..``q8`` by how unlikely (``q0``: probability ~1);
- non-negative values (``entropy`` ...): ``q0``..``q8`` from 0 to the trajectory's largest;
- ``loss_mask``: tokens not trained on (0) are hatched, the others plain.

The scale is the trajectory's (every turn on the same colours), and the legend says it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from .markup import Raw, h, join
from .plots import fmt_number

__all__ = ["arrays_of", "available", "default_color", "Scale", "scale_for", "overlay", "legend", "MISMATCH"]

#: the derived array: trainer − sampler log-probability per token
MISMATCH = "mismatch"
#: tokens drawn per generation at most (a page stays light; the rest is said)
MAX_TOKENS = 8192


def arrays_of(span: Any) -> dict[str, list[float | None]]:
    """A generation's per-token arrays (None where not finite), with ``mismatch`` added
    when it has ``logprob`` and ``old_logprob`` of the same length."""
    values = getattr(span, "token_values", None) or {}
    out: dict[str, list[float | None]] = {}
    for name, arr in values.items():
        out[str(name)] = [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)
                          for v in arr]
    lp, old = out.get("logprob"), out.get("old_logprob")
    if lp is not None and old is not None and len(lp) == len(old):
        out[MISMATCH] = [None if a is None or b is None else b - a for a, b in zip(lp, old)]
    return out


def available(spans: Sequence[Any]) -> list[str]:
    """Every array name of the generations, in a stable order (the known ones first)."""
    names: set[str] = set()
    for span in spans:
        names.update(arrays_of(span))
    known = [n for n in ("advantage", MISMATCH, "logprob", "old_logprob", "entropy", "loss_mask") if n in names]
    return known + sorted(names - set(known))


def default_color(names: Sequence[str]) -> str | None:
    for name in ("advantage", MISMATCH, "logprob"):
        if name in names:
            return name
    return names[0] if names else None


class Scale:
    """How values map to colour classes; ``kind`` is ``diverging``, ``unlikely``
    (log-probabilities), ``sequential`` or ``mask``."""

    def __init__(self, kind: str, top: float) -> None:
        self.kind, self.top = kind, top

    def css(self, value: float | None) -> str:
        if value is None:
            return "nv"
        if self.kind == "mask":
            return "m0" if value == 0 else "m1"
        if self.top <= 0:
            return "d5" if self.kind == "diverging" else "q0"
        if self.kind == "diverging":
            return f"d{5 + max(-5, min(5, round(value / self.top * 5)))}"
        x = -value if self.kind == "unlikely" else value
        return f"q{max(0, min(8, round(x / self.top * 8)))}"


def scale_for(name: str, values: Sequence[float | None]) -> Scale:
    """The scale of array ``name`` over ``values`` (all of a trajectory's generations)."""
    finite = [v for v in values if v is not None]
    if name == "loss_mask" or (finite and set(finite) <= {0.0, 1.0} and name.endswith("mask")):
        return Scale("mask", 1.0)
    if not finite:
        return Scale("sequential", 0.0)
    lo, hi = min(finite), max(finite)
    if name in ("advantage", MISMATCH) or (lo < 0 < hi):
        return Scale("diverging", max(abs(lo), abs(hi)))
    if hi <= 0:
        return Scale("unlikely", -lo)
    return Scale("sequential", hi)


def legend(name: str, scale: Scale) -> Raw:
    """The colours of ``scale`` with their values."""
    if scale.kind == "mask":
        items = [("m1", "trained on (1)"), ("m0", "not trained on (0)")]
        return h("div", {"class_": "tlegend", "data_color": name}, h("b", None, name), " ",
                 [h("span", {"class_": f"tk {c}"}, text) for c, text in items])
    top = scale.top
    if scale.kind == "diverging":
        swatches = [f"d{i}" for i in range(11)]
        ends = (fmt_number(-top), "0", "+" + fmt_number(top))
        what = "below 0 ← → above 0" + (" (trainer − sampler log-probability)" if name == MISMATCH else "")
    elif scale.kind == "unlikely":
        swatches = [f"q{i}" for i in range(9)]
        ends = ("0", "", fmt_number(-top))
        what = "log-probability: darker is less likely"
    else:
        swatches = [f"q{i}" for i in range(9)]
        ends = ("0", "", fmt_number(top))
        what = "from 0 to the largest"
    return h("div", {"class_": "tlegend", "data_color": name}, h("b", None, name), " ",
             h("span", {"class_": "end"}, ends[0]), h("span", {"class_": "ramp"}, [h("i", {"class_": s}) for s in swatches]),
             h("span", {"class_": "end"}, ends[2]), " ", h("span", {"class_": "muted"}, what),
             " ", h("span", {"class_": "tk nv"}, "no value"))


def _text(token: Any) -> str:
    text = str(token)
    if not text:
        return "∅"
    return text.replace("\n", "↵\n") if text.strip() else text.replace(" ", "·").replace("\n", "↵\n").replace("\t", "→")


def overlay(span: Any, color: str | None, scale: Scale | None) -> Raw:
    """The generation's response tokens, each on its colour from array ``color``, its
    position, id, text and values in its tooltip (``data-tip``, one per line). Tokens are the span's ``rtrace.response_tokens`` (token2text),
    else its response ids shown as ``⟨id⟩``."""
    arrays = arrays_of(span)
    tokens = span.attributes.get("rtrace.response_tokens")
    ids = span.response_ids or []
    n = max([len(tokens) if isinstance(tokens, list) else 0, len(ids)] + [len(a) for a in arrays.values()] or [0])
    if not n:
        return h("p", {"class_": "muted"}, "No response tokens recorded.")
    shown = min(n, MAX_TOKENS)
    chosen = arrays.get(color) if color else None
    spans = []
    for i in range(shown):
        if isinstance(tokens, list) and i < len(tokens):
            text = _text(tokens[i])
        elif i < len(ids):
            text = f"⟨{ids[i]}⟩"
        else:
            text = "·"
        tip = [f"token {i}" + (f" · id {ids[i]}" if i < len(ids) else "")]
        if isinstance(tokens, list) and i < len(tokens):
            tip.append(json.dumps(str(tokens[i]), ensure_ascii=False))  # its text exactly: quotes, \n, spaces
        for name, arr in arrays.items():
            if i < len(arr):
                tip.append(f"{name} {'–' if arr[i] is None else fmt_number(arr[i])}")
        value = chosen[i] if chosen is not None and i < len(chosen) else None
        cls = "tk " + (scale.css(value) if scale is not None and chosen is not None else "nc")
        spans.append(h("span", {"class_": cls, "data_tip": "\n".join(tip)}, text))
    notes = []
    if shown < n:
        notes.append(h("p", {"class_": "muted"}, f"the first {shown:,} of {n:,} tokens"))
    if not isinstance(tokens, list):
        notes.append(h("p", {"class_": "muted"}, "No token texts (token ids shown): the texts are recorded with "
                                                "token2text on (docs/token-values.md)."))
    for name, arr in arrays.items():
        if ids and len(arr) != len(ids):
            notes.append(h("p", {"class_": "note"}, f"{name} has {len(arr):,} values for {len(ids):,} tokens"))
    return join([h("div", {"class_": "tokens", "data_color": color or ""}, spans), notes])
