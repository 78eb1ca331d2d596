"""Per-token values: the sampler's logprobs and the trainer's arrays, aligned with a
generation's response tokens, and the train-inference mismatch they show.

Where the values come from:

* **the sampler**: a ``@traced_generation`` whose output carries per-token logprobs
  (``logprobs``, ``log_probs``, ``rollout_log_probs``: a list aligned with the response
  ids, or the OpenAI ``{"content": [{"logprob": ...}, ...]}`` form vLLM returns), and the
  gateway. They become the generation's ``logprob`` array at conversion.
* **the trainer**: 2-D columns of ``rtrace.annotate_batch`` (``old_logprob=``,
  ``advantage=``, ``loss_mask=``, ``entropy=``, any name) with ``token_mask=`` (which
  positions are real) or ``token_lengths=``. The trainer's thread keeps references only
  (:class:`TokenBatch`); this module converts a batch to float32 once, on rtrace's worker
  thread, and each trajectory picks its row (:class:`TokenRow`, an annotation value like
  any other: ``RTRACE_AWAIT_ANNOTATIONS=old_logprob`` waits for it).

A trainer's row covers the trajectory's *response*: every token after the first prompt,
the model's and the tools' between them, as veRL, SkyRL and TRL lay their batches out.
:func:`attach` cuts it into the generations (turn k's tokens start at
``len(prompt_k) - len(prompt_1)``, or after the turns before it for a trajectory built
from a batch), onto each generation's :attr:`~rtrace.trajectory.SpanRecord.token_values`
(float32 arrays, the same length as its ``response_ids``). A row of another length, values
that are not finite, a mask that selects nothing, a tensor that cannot be read: a
``token_arrays`` finding, never a misaligned overlay.

:func:`mismatch` compares the sampler's ``logprob`` with the trainer's ``old_logprob`` over
the loss-masked tokens (``loss_mask`` when given): k1 = mean(sampler - trainer) and
k3 = mean(r - 1 - log r) with r = exp(trainer - sampler) (estimators of KL(sampler ||
trainer) from the sampler's tokens), the largest |Δ| and the share of tokens whose
probability ratio leaves [1/ratio, ratio] (NeMo-RL's ``token_mult_prob_error`` idea). A
trained token whose logprob is not finite (NaN, ±inf: a bf16 overflow, a bad kernel) is the
worst mismatch there is, not a token to leave out: the values are then missing and the
check says how many tokens were not finite.

numpy is needed for per-token values (every trainer has it); without it they are left out
and counted (``token_arrays_no_numpy``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .. import _stats
from ..trajectory import SpanRecord

__all__ = ["TokenBatch", "TokenRow", "TOKENS_KEY", "wire_values", "LOGPROB_KEYS", "TOKEN_PROBLEM", "has_rows",
           "SAMPLER", "TRAINER", "LOSS_MASK", "sampler_logprobs", "attach", "mismatch", "Mismatch", "MISMATCH_KEYS",
           "as_float32", "merge", "ROW_ASIDE"]

#: Keys of a generation's output read as the sampler's per-token logprobs.
LOGPROB_KEYS = ("logprobs", "log_probs", "rollout_log_probs", "rollout_logprobs")
#: The array names the mismatch check compares, and its mask.
SAMPLER, TRAINER, LOSS_MASK = "logprob", "old_logprob", "loss_mask"
#: A generation's attribute saying why its sampler logprobs were left out (a list of
#: another length than its response ids, values that are not numbers).
TOKEN_PROBLEM = "rtrace.token_values.problem"
#: The per-rollout values the check adds to a trajectory's annotations (``rl.<name>`` on
#: the root, step metrics, the rollouts table, ``keep_mismatch``).
MISMATCH_KEYS = ("logprob_mismatch_k1", "logprob_mismatch_k3", "logprob_mismatch_max", "logprob_mismatch_frac")


def _np() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with every trainer
        _stats.incr("token_arrays_no_numpy")
        _stats.warn_once("tokens-numpy", "rtrace: per-token values need numpy; they are left out")
        return None
    return numpy


def as_float32(values: Any) -> Any:
    """``values`` (a list of numbers, an array, a CPU tensor) as a 1-D float32 numpy array,
    or None when they are not that (counted by the caller)."""
    np = _np()
    if np is None:
        return None
    try:
        if hasattr(values, "detach"):
            values = values.detach().to("cpu").float().numpy()
        arr = np.asarray(values, dtype=np.float32)
    except Exception:
        return None
    return arr if arr.ndim == 1 else None


def sampler_logprobs(output: dict[str, Any]) -> tuple[str | None, Any]:
    """``(key, float32 array)`` of the per-token logprobs in a generation's output dict,
    or ``(None, None)``. Reads a list of numbers, or OpenAI's ``{"content": [{"logprob":
    ...}, ...]}`` (what vLLM returns with ``logprobs=true``)."""
    for key in LOGPROB_KEYS:
        value = output.get(key)
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(value.get("content"), list):
            value = [item.get("logprob") if isinstance(item, dict) else None for item in value["content"]]
            if any(v is None for v in value):
                return key, None
        return key, as_float32(value)
    return None, None


# ----------------------------------------------------------------------------- the trainer's rows
class TokenBatch:
    """One ``annotate_batch`` call's 2-D columns, as the trainer gave them (references).

    A CUDA tensor gets its copy to the CPU queued on the trainer's stream at the call
    (``non_blocking``, with an event): the values are those of that moment and the
    trainer's thread never waits for the device; the worker waits on the event before it
    reads. Everything else is kept as given and read on rtrace's worker thread (a CPU
    tensor or array must not be changed in place before it is exported)."""

    __slots__ = ("columns", "mask", "lengths", "_rows", "_events", "_error")

    def __init__(self, columns: dict[str, Any], mask: Any = None, lengths: Any = None) -> None:
        self._events: list[Any] = []
        self.columns = {name: self._hold(value) for name, value in columns.items()}
        self.mask = self._hold(mask) if mask is not None else None
        self.lengths = lengths
        #: name -> list of 1-D float32 rows (compacted by the mask), made on first use
        self._rows: dict[str, list[Any]] | None = None
        self._error: str | None = None

    def _hold(self, value: Any) -> Any:
        if getattr(value, "is_cuda", False):
            try:
                import torch

                value = value.detach().to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._events.append(event)
            except Exception:  # left as it is: the worker's read says why
                pass
        return value

    def rows(self) -> tuple[dict[str, list[Any]] | None, str | None]:
        """``({name: rows}, None)``, or ``(None, why)`` when the batch cannot be read."""
        if self._rows is None and self._error is None:
            try:
                self._rows = self._convert()
            except Exception as exc:  # a tensor on a device that cannot be read, ragged garbage ...
                self._error = f"{type(exc).__name__}: {exc}"[:200]
                _stats.incr("token_arrays_unreadable")
            self.columns = {}  # the trainer's objects are let go once read
            self.mask = None
        return self._rows, self._error

    def _convert(self) -> dict[str, list[Any]]:
        np = _np()
        if np is None:
            raise RuntimeError("numpy is not installed")
        for event in self._events:
            event.synchronize()
        mask = _matrix(np, self.mask) if self.mask is not None else None
        lengths = [int(n) for n in _matrix(np, self.lengths).reshape(-1)] if self.lengths is not None else None
        out: dict[str, list[Any]] = {}
        for name, value in self.columns.items():
            rows = _rows(np, value)
            if mask is not None:
                if len(mask) != len(rows):
                    raise ValueError(f"token_mask has {len(mask)} rows, {name} {len(rows)}")
                rows = [row[m[:len(row)] != 0] if len(m) >= len(row) else _short_mask(name, len(m), len(row))
                        for row, m in zip(rows, mask)]
            elif lengths is not None:
                if len(lengths) != len(rows):
                    raise ValueError(f"token_lengths has {len(lengths)} entries, {name} {len(rows)} rows")
                rows = [row[:n] for row, n in zip(rows, lengths)]
            out[name] = rows
        return out


def _short_mask(name: str, n_mask: int, n_row: int) -> Any:
    raise ValueError(f"token_mask rows have {n_mask} positions, {name} rows {n_row}")


def _matrix(np: Any, value: Any) -> Any:
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").numpy()
    return np.asarray(value)


def _rows(np: Any, value: Any) -> list[Any]:
    """A 2-D column as a list of 1-D float32 rows (a padded matrix, or ragged lists)."""
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").float().numpy()
    if isinstance(value, (list, tuple)) and value and not all(len(r) == len(value[0]) for r in value):
        return [np.asarray(r, dtype=np.float32) for r in value]  # ragged
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"a per-token column has shape {arr.shape}, not [batch, tokens]")
    return list(arr)


#: How a per-token row travels in an annotation span to a collector in another process:
#: ``{TOKENS_KEY: field}``, the row exactly as float32 (:func:`rtrace.trajectory.token_field`).
TOKENS_KEY = "rtrace.tokens"


class TokenRow:
    """One trajectory's row of a :class:`TokenBatch`: the value of each of its per-token
    annotations (one object for all of the batch's names: the annotation's key names the
    column)."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: TokenBatch, index: int) -> None:
        self.batch, self.index = batch, index

    def values(self, name: str) -> tuple[Any, str | None]:
        """``(float32 row of column name, None)`` or ``(None, why)``."""
        rows, error = self.batch.rows()
        if rows is None:
            return None, error
        return rows[name][self.index], None

    def __repr__(self) -> str:  # what a sink that does not know per-token values shows
        return "<per-token values>"


def wire_values(values: dict[str, Any]) -> dict[str, Any]:
    """An annotation's values for the hop to a collector in another process: a per-token
    row as ``{TOKENS_KEY: field}`` (float32 exactly; read on the worker's stream thread), an unreadable
    one as None (counted)."""
    if not has_rows(values):
        return values
    from ..trajectory import token_field

    out = {}
    for key, value in values.items():
        if type(value) is TokenRow:
            row, _ = value.values(key)  # float32 exactly, as the compact field (base64)
            value = {TOKENS_KEY: token_field({key: row})} if row is not None else None
        out[key] = value
    return out


# ----------------------------------------------------------------------------- alignment
def _layout(records: Sequence[SpanRecord]) -> tuple[list[tuple[SpanRecord, int]], int] | None:
    """Each generation with the offset of its response in the trajectory's response, and
    the response's length; None when the spans do not say (no ids, or turns that do not
    continue each other)."""
    gens = sorted((r for r in records if r.kind == "generation" and r.response_ids is not None),
                  key=lambda r: (r.start_ns, r.end_ns))
    if not gens:
        return None
    if all(g.prompt_ids is not None for g in gens):  # a token-in-token-out loop
        base = len(gens[0].prompt_ids)
        out, end = [], 0
        for g in gens:
            off = len(g.prompt_ids) - base
            if off < end:
                return None
            out.append((g, off))
            end = off + len(g.response_ids)
        return out, end
    # a trajectory built from a batch (log_rollout_batch, the adapters): its turns, in order
    turns = sorted((r for r in records if r.kind in ("generation", "tool") and r.response_ids is not None),
                   key=lambda r: (r.start_ns, r.end_ns))
    out, pos = [], 0
    for t in turns:
        if t.kind == "generation":
            out.append((t, pos))
        pos += len(t.response_ids)
    return out, pos


def has_rows(annotations: dict[str, Any]) -> bool:
    """True when some annotation value is a trainer's per-token row."""
    return any(type(v) is TokenRow for v in annotations.values())


#: The key prefix a per-token row waits under, in a trajectory's annotations, while a
#: per-trajectory value of the same name holds the name itself (TRL's advantage: one number
#: per completion, and that number on each of its tokens). :func:`attach` takes it from there.
ROW_ASIDE = "\x00tokens:"


def merge(annotations: dict[str, Any], values: dict[str, Any]) -> None:
    """``annotations.update(values)``, except that a per-token row and a per-trajectory value
    of one name are both kept (whichever comes first): the value under the name, the row
    aside (:data:`ROW_ASIDE`) until :func:`attach` lays it on the tokens. Without this, the
    later of ``annotate(advantage=0.4)`` and ``annotate_batch(advantage=[B, T])`` would
    silently replace the other."""
    if not (has_rows(values) or has_rows(annotations)):
        annotations.update(values)
        return
    for key, value in values.items():
        old = annotations.get(key)
        row = type(value) is TokenRow
        if old is not None and value is not None and (type(old) is TokenRow) is not row:
            if row:
                annotations[ROW_ASIDE + key] = value
                continue
            annotations[ROW_ASIDE + key] = old  # the row steps aside for the value
        annotations[key] = value


def attach(records: Sequence[SpanRecord], annotations: dict[str, Any]) -> list[str]:
    """Move the trainer's rows out of ``annotations`` onto the generations of ``records``
    (cut by :func:`_layout`); returns the problems found (``token_arrays`` findings)."""
    found = {k: v for k, v in annotations.items() if isinstance(v, TokenRow)}
    if not found:
        return []
    for k in found:
        del annotations[k]
    # a row set aside for a per-trajectory value of its name (merge) goes by that name
    rows = {k[len(ROW_ASIDE):] if k.startswith(ROW_ASIDE) else k: v for k, v in found.items()}
    problems: list[str] = []
    layout = _layout(records)
    if layout is None:
        return [f"{', '.join(sorted(rows))}: the generations' token ids do not lay out one response (ids not "
                "captured, or turns that do not continue each other): not attached"]
    gens, total = layout
    for name, row in sorted(rows.items()):
        values, error = row.values(name)
        if values is None:
            problems.append(f"{name}: not readable ({error})")
            continue
        if len(values) != total:
            problems.append(f"{name} has {len(values)} values for a response of {total} tokens: not attached")
            continue
        for gen, off in gens:
            if gen.token_values is None:
                gen.token_values = {}
            gen.token_values[name] = values[off:off + len(gen.response_ids)].copy()  # the batch can go
        bad = _not_finite(values)
        if bad:
            problems.append(f"{name}: {bad} of {total} values are NaN or infinite")
    return problems


def _not_finite(values: Any) -> int:
    np = _np()
    return int(values.size - np.isfinite(values).sum()) if np is not None and hasattr(values, "size") else 0


# ----------------------------------------------------------------------------- mismatch
class Mismatch:
    """The train-inference mismatch of one trajectory (see the module docstring). With
    ``nonfinite`` trained tokens whose logprob (either side's) is NaN or infinite, the
    values are missing (None) and ``worst`` is the first such token."""

    __slots__ = ("k1", "k3", "max_abs", "frac", "tokens", "worst", "nonfinite")

    def __init__(self, k1: float | None, k3: float | None, max_abs: float | None, frac: float | None, tokens: int,
                 worst: tuple[int, int, int | None, float, float], nonfinite: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.k1, self.k3, self.max_abs, self.frac, self.tokens = k1, k3, max_abs, frac, tokens
        #: (turn, position in its response, token id, sampler logprob, trainer logprob)
        self.worst = worst
        #: trained tokens whose logprob is not finite: (either side's, the sampler's, the trainer's)
        self.nonfinite = nonfinite

    def values(self) -> dict[str, float]:
        """The per-rollout values (MISMATCH_KEYS); none when a trained token's logprob is not finite."""
        if self.nonfinite[0]:
            return {}
        return dict(zip(MISMATCH_KEYS, (self.k1, self.k3, self.max_abs, self.frac)))  # type: ignore[arg-type]


def mismatch(records: Sequence[SpanRecord], ratio: float) -> Mismatch | None | str:
    """The mismatch over the loss-masked tokens of the generations that carry both arrays;
    None when none does, a string when the mask selects nothing."""
    np = _np()
    if np is None:
        return None
    gens = sorted((r for r in records if r.kind == "generation"), key=lambda r: (r.start_ns, r.end_ns))
    sampler, trainer, where = [], [], []
    trained = bad_n = bad_s = bad_t = 0
    first_bad: tuple[int, SpanRecord, int] | None = None
    for k, gen in enumerate(gens, 1):
        tv = gen.token_values
        if not tv or SAMPLER not in tv or TRAINER not in tv:
            continue
        s, t = tv[SAMPLER], tv[TRAINER]
        keep = tv[LOSS_MASK] != 0 if LOSS_MASK in tv else np.ones(s.shape, bool)
        finite_s, finite_t = np.isfinite(s), np.isfinite(t)
        bad = keep & ~(finite_s & finite_t)
        if bad.any():  # a trained token without a number: nothing about this trajectory can be measured
            bad_n += int(bad.sum())
            bad_s += int((keep & ~finite_s).sum())
            bad_t += int((keep & ~finite_t).sum())
            if first_bad is None:
                first_bad = (k, gen, int(np.argmax(bad)))
        trained += int(keep.sum())
        idx = np.nonzero(keep & finite_s & finite_t)[0]
        sampler.append(s[idx])
        trainer.append(t[idx])
        where.append((k, gen, idx))
    if not where:
        return None
    if first_bad is not None:
        k, gen, pos = first_bad
        return Mismatch(None, None, None, None, trained, _token(k, gen, pos), (bad_n, bad_s, bad_t))
    s = np.concatenate(sampler).astype(np.float64)
    t = np.concatenate(trainer).astype(np.float64)
    if s.size == 0:
        return "the loss mask selects no token with both logprobs"
    delta = t - s
    log_r = delta
    k1 = float(np.mean(s - t))
    k3 = float(np.mean(np.expm1(log_r) - log_r))
    absd = np.abs(delta)
    at = int(np.argmax(absd))
    bound = math.log(ratio)
    frac = float(np.mean(absd > bound))
    # where the worst token is: its turn and position in that turn's response
    for k, gen, idx in where:
        if at < idx.size:
            worst = _token(k, gen, int(idx[at]))
            break
        at -= idx.size
    return Mismatch(k1, k3, float(absd.max()), frac, int(s.size), worst)


def _token(k: int, gen: SpanRecord, pos: int) -> tuple[int, int, int | None, float, float]:
    """(turn, position, token id, sampler logprob, trainer logprob) of a generation's token."""
    ids = gen.response_ids
    token = ids[pos] if ids is not None and pos < len(ids) else None
    return k, pos, token, float(gen.token_values[SAMPLER][pos]), float(gen.token_values[TRAINER][pos])
