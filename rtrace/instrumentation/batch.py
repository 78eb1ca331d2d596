"""Tensor-batch trajectories: ``rtrace.log_rollout_batch`` for trainers holding a padded batch.

AReaL, SkyRL, open-instruct and veRL's trainer side do not call a decorated agent loop:
they hold the finished rollouts as padded tensors (``input_ids``, ``attention_mask``,
``loss_mask``, rewards, per-token versions). ``log_rollout_batch`` turns each sample
into a :class:`~rtrace.trajectory.Trajectory` and sends it through the same per-step
sampler and the same sinks as decorated trajectories.

The call does only the cheap part, on the trainer's thread: each tensor is moved to the
CPU once (``.detach().cpu()`` once per tensor, never per sample) and turned into Python
lists, each admitted sample is cut into id lists, and the trajectories are queued.
Decoding the ids to text (token2text) and writing happen in rtrace's worker thread.

Layout (per sample ``b``; see docs/tensor-batches.md):

* the sample's tokens are the real ones (``attention_mask == 1``), in order;
* the prompt is: the ``prompt_mask == 1`` tokens if given; else the first
  ``prompt_lengths[b]`` real tokens; else, when ``loss_mask`` only covers the response
  part (narrower than ``input_ids``), the real tokens left of it; else the real tokens
  before the first ``loss_mask == 1``;
* the tokens after the prompt are cut into runs of equal ``assistant_mask`` (who wrote
  each token; default: ``loss_mask``): a run of 1s is an assistant turn (a ``generation``
  span), a run of 0s a tool/user turn (a ``tool`` span with ``rtrace.role`` =
  ``observation_role``). ``loss_mask`` says what the trainer trains on: each turn's
  ``rl.loss_tokens`` (the root's: their sum);
* sample ``b`` answers prompt ``b // n_samples_per_prompt`` (``sample_index``, offset by
  ``prompt_offset``) as rollout ``b % n_samples_per_prompt`` (``rollout_n``), unless
  ``sample_indices`` / ``rollout_ns`` give them per sample (no divisibility rule then).

Times in these trajectories are synthetic (the batch carries none): the root starts at
the call, each segment lasts 1 µs, in order. The root has ``rtrace.synthetic_times``.
The sample-to-trajectory core is :mod:`rtrace.instrumentation.turns`, shared with the
trainer adapters (``rtrace.compat``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from .. import _stats
from .._serialize import array_to_python
from ..pipeline.records import TrajectoryState
from . import _state
from .turns import Turn, sample_state, submit

__all__ = ["log_rollout_batch"]


def log_rollout_batch(
    input_ids: Any,
    *,
    attention_mask: Any = None,
    loss_mask: Any = None,
    assistant_mask: Any = None,
    prompt_lengths: Any = None,
    prompt_mask: Any = None,
    rewards: Any = None,
    versions: Any = None,
    finish_reasons: Sequence[Any] | None = None,
    messages: Sequence[Any] | None = None,
    n_samples_per_prompt: int = 1,
    step: int | None = None,
    validate: bool = False,
    prompt_uids: Sequence[Any] | None = None,
    sample_ids: Sequence[Any] | None = None,
    sample_indices: Sequence[Any] | None = None,
    rollout_ns: Sequence[Any] | None = None,
    prompt_offset: int = 0,
    observation_role: str = "tool",
    name: str = "rollout",
    extra: dict[str, Any] | None = None,
) -> int:
    """Log a padded batch of finished rollouts as one trajectory per sample.

    Every tensor argument may be a torch tensor (any device, any dtype), a numpy array
    or nested lists; per-sample rows may be ragged lists.

    Args:
        input_ids: ``[B, T]`` token ids, prompt and response, padded.
        attention_mask: ``[B, T]``; 1 = real token. Default: every token is real.
        loss_mask: ``[B, T]``, or ``[B, R]`` for the response part only (the last ``R``
            columns of ``input_ids``, as veRL's ``response_mask``); 1 = trained on. Without
            ``assistant_mask`` it also says who wrote each token (1 = the policy, 0 = tool
            output / user text), as most trainers' masks do. Default: all 1.
        assistant_mask: ``[B, T]`` or ``[B, R]``; 1 = written by the policy. Give it when the
            loss mask is not that (SkyRL's ``apply_overlong_filtering`` zeroes the loss mask
            of a truncated response): turns are cut by it, and ``loss_mask`` only counts
            the trained-on tokens (``rl.loss_tokens``).
        prompt_lengths: real prompt tokens per sample ``[B]``, per prompt
            ``[B // n_samples_per_prompt]``, or one int.
        prompt_mask: ``[B, T]``; 1 = prompt token (AReaL). Overrides ``prompt_lengths``.
        rewards: ``[B]`` scalars, or token-level ``[B, T]`` / ``[B, R]`` (summed).
        finish_reasons: why each sample's last generation stopped ``[B]`` (``stop``,
            ``length``...; SkyRL's ``stop_reasons``): truncations count, and tail keeping
            (``keep_errors``) keeps them.
        versions: policy version per token (``[B, T]`` or ``[B, R]``, negative = none,
            e.g. AReaL's -1 on prompt tokens), per sample ``[B]``, or one int. A
            trajectory's ``policy_version`` is the oldest version among its generated
            tokens; each generation span carries its own.
        messages: optional structured conversation per sample (``[B]`` lists of chat
            dicts); used as the trajectory's ``messages`` instead of the decoded turns.
        n_samples_per_prompt: consecutive samples sharing a prompt (GRPO group size).
        step: the RL step (sampling cap per step applies).
        validate: validation rollouts (their own cap).
        prompt_uids: a group id per prompt ``[B // n]`` or per sample ``[B]``; default
            ``str(sample_index)``.
        sample_ids: an id per sample, exported as ``rl.extra.sample_id``.
        sample_indices, rollout_ns: each sample's exact ``sample_index`` / ``rollout_n``
            ``[B]`` (e.g. from a trainer's trajectory ids); with them,
            ``n_samples_per_prompt`` need not divide the batch.
        prompt_offset: added to ``sample_index`` (e.g. a data-parallel rank's first prompt).
        observation_role: the chat role of ``loss_mask == 0`` turns: "tool" or "user".
        name: the root span name.
        extra: more coordinates for every sample (``rl.extra.<key>``).

    Returns:
        How many trajectories were queued (after sampling). 0 when tracing is off.

    Raises:
        ValueError: an argument whose shape does not match ``input_ids`` (the message
            names it), or ``n_samples_per_prompt`` that does not divide the batch.
    """
    rt = _state.get_runtime()
    if rt is None:
        return 0
    ids = _rows(input_ids, "input_ids")
    batch = len(ids)
    n = n_samples_per_prompt
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"log_rollout_batch: n_samples_per_prompt must be an int >= 1, got {n!r}")
    explicit = sample_indices is not None
    if batch % n and not explicit:
        raise ValueError(f"log_rollout_batch: n_samples_per_prompt={n} does not divide the batch size {batch} "
                         "(input_ids rows); give sample_indices (and rollout_ns) per sample instead")
    if explicit:
        n = 1  # per-sample coordinates: every per-prompt argument is per sample
    if observation_role not in ("tool", "user"):
        raise ValueError(f"log_rollout_batch: observation_role must be 'tool' or 'user', got {observation_role!r}")
    attn = _per_token(attention_mask, "attention_mask", ids, full_only=True)
    loss = _per_token(loss_mask, "loss_mask", ids)
    who = _per_token(assistant_mask, "assistant_mask", ids)
    pmask = _per_token(prompt_mask, "prompt_mask", ids, full_only=True)
    vers_tok, vers_sample = _per_token_or_sample(versions, "versions", ids, n)
    rew_tok, rew_sample = _per_token_or_sample(rewards, "rewards", ids, n)
    plens = _per_sample(prompt_lengths, "prompt_lengths", batch, n)
    uids = _per_sample(prompt_uids, "prompt_uids", batch, n)
    sids = _per_sample(sample_ids, "sample_ids", batch, 1)
    indices = _per_sample(sample_indices, "sample_indices", batch, 1)
    rollouts = _per_sample(rollout_ns, "rollout_ns", batch, 1)
    finishes = _per_sample(finish_reasons, "finish_reasons", batch, 1)
    if messages is not None and len(messages) != batch:
        raise ValueError(f"log_rollout_batch: messages has {len(messages)} entries, input_ids has {batch} rows")

    out: list[TrajectoryState] = []
    now = time.time_ns()
    for b in range(batch):
        if explicit:
            prompt_index = prompt_offset + _int(indices[b]) if _int(indices[b]) is not None else None
            rollout_n = _int(rollouts[b]) if rollouts is not None else 0
        else:
            prompt_index, rollout_n = prompt_offset + b // n, b % n
        coords: dict[str, Any] = {"step": step, "sample_index": prompt_index, "rollout_n": rollout_n,
                                  "validate": bool(validate),
                                  "group_id": str(uids[b]) if uids is not None else str(prompt_index)}
        if rt.experiment is not None:
            coords["experiment"] = rt.experiment
        sample_extra = {str(k): _plain(v) for k, v in (extra or {}).items()}
        if sids is not None:
            sample_extra["sample_id"] = _plain(sids[b])
        coords["extra"] = sample_extra
        if vers_sample is not None:
            coords["policy_version"] = _int(vers_sample[b])
        # Sampling first: a sampled-out sample costs nothing more.
        if not rt.sampler.admit(coords):
            continue
        row = ids[b]
        width = len(row)
        real = [(0, width)] if attn is None else [(lo, hi) for v, lo, hi in _runs(attn[b]) if v]
        n_prompt = _prompt_len(b, width, real, pmask, plens, who if who is not None else loss)
        prompt_iv, response_iv = _split(real, n_prompt)
        turns = _turns(row, response_iv, (who if who is not None else loss)[b] if (who or loss) is not None else None,
                       vers_tok[b] if vers_tok is not None else None, observation_role,
                       loss[b] if who is not None and loss is not None else None)
        if finishes is not None and finishes[b] is not None:
            _finish_last(turns, str(finishes[b]))
        reward = _reward(rew_sample, rew_tok, b)
        state = sample_state(coords, _gather(row, prompt_iv), turns, reward, name=name, start_ns=now,
                             capture=rt.capture)
        if messages is not None and messages[b]:
            state.messages = [dict(m) for m in messages[b]]
        # else the worker builds them from the segments, after token2text decoded them
        out.append(state)
    return submit(out)


# ---------------------------------------------------------------------- inputs
def _rows(value: Any, name: str) -> list[list[int]]:
    rows = array_to_python(value)
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in rows):
        raise ValueError(f"log_rollout_batch: {name} must be 2-D ([batch, tokens]), got {type(value).__name__}")
    # tolist() gives fresh lists already: copy only tuples / foreign sequences
    return rows if type(rows) is list and all(type(r) is list for r in rows) else [list(r) for r in rows]


def _per_token(value: Any, name: str, ids: list[list[int]], full_only: bool = False) -> list[list[Any]] | None:
    """Per-token rows aligned with ``ids``: same width, or (unless ``full_only``) the last
    columns (the response part)."""
    if value is None:
        return None
    rows = _rows(value, name)
    if len(rows) != len(ids):
        raise ValueError(f"log_rollout_batch: {name} has {len(rows)} rows, input_ids has {len(ids)}")
    for b, (row, ref) in enumerate(zip(rows, ids)):
        if len(row) > len(ref) or (full_only and len(row) != len(ref)):
            raise ValueError(f"log_rollout_batch: {name} row {b} has {len(row)} tokens, input_ids row {b} has "
                             f"{len(ref)}" + ("" if full_only else " (a narrower one must be the response part)"))
    return rows


def _per_token_or_sample(value: Any, name: str, ids: list[list[int]], n: int) -> tuple[Any, Any]:
    """(per-token rows, None) or (None, per-sample values) for rewards / versions."""
    if value is None:
        return None, None
    lists = array_to_python(value)
    if isinstance(lists, (list, tuple)) and lists and isinstance(lists[0], (list, tuple)):
        return _per_token(lists, name, ids), None  # already on the CPU: no second copy
    return None, _per_sample(lists, name, len(ids), n)


def _per_sample(value: Any, name: str, batch: int, n: int) -> list[Any] | None:
    """One value per sample, from a scalar, ``[batch]`` or ``[batch // n]`` (per prompt)."""
    if value is None:
        return None
    value = array_to_python(value)
    if not isinstance(value, (list, tuple)):
        return [value] * batch
    if len(value) == batch:
        return list(value)
    if n > 1 and len(value) == batch // n:
        return [value[b // n] for b in range(batch)]
    per_prompt = f" or {batch // n} (one per prompt)" if n > 1 else ""
    raise ValueError(f"log_rollout_batch: {name} has {len(value)} entries; expected {batch} (one per sample)"
                     f"{per_prompt}")


# The per-sample work below scans 0/1 masks run by run with list.index (C speed) and cuts
# ids with list slices: a sample of a few thousand tokens costs a few dozen Python steps,
# not one per token. Columns are half-open intervals (lo, hi).
Interval = tuple[int, int]


def _runs(mask: list[Any]) -> list[tuple[int, int, int]]:
    """Runs of equal truthiness in a mask row: (value 0/1, lo, hi)."""
    if not set(mask) <= {0, 1}:  # True/False and 0.0/1.0 compare equal to 0/1
        mask = [1 if v else 0 for v in mask]
    out: list[tuple[int, int, int]] = []
    lo, width = 0, len(mask)
    while lo < width:
        v = 1 if mask[lo] else 0
        try:
            hi = mask.index(1 - v, lo)
        except ValueError:
            hi = width
        out.append((v, lo, hi))
        lo = hi
    return out


def _split(intervals: list[Interval], k: int) -> tuple[list[Interval], list[Interval]]:
    """The first ``k`` columns of ``intervals``, and the rest."""
    head: list[Interval] = []
    for i, (lo, hi) in enumerate(intervals):
        if k <= 0:
            return head, intervals[i:]
        if hi - lo <= k:
            head.append((lo, hi))
            k -= hi - lo
        else:
            head.append((lo, lo + k))
            return head, [(lo + k, hi)] + intervals[i + 1:]
    return head, []


def _gather(row: list[Any], intervals: list[Interval]) -> list[Any]:
    if len(intervals) == 1:
        lo, hi = intervals[0]
        return row[lo:hi]
    out: list[Any] = []
    for lo, hi in intervals:
        out += row[lo:hi]
    return out


def _prompt_len(b: int, width: int, real: list[Interval], pmask: Any, plens: Any, loss: Any) -> int:
    """How many of the sample's real tokens are prompt (see the module docstring)."""
    n_real = sum(hi - lo for lo, hi in real)
    if pmask is not None:
        return sum(sum(map(bool, pmask[b][lo:hi])) for lo, hi in real)
    if plens is not None:
        p = _int(plens[b])
        if p is None or not 0 <= p <= n_real:
            raise ValueError(f"log_rollout_batch: prompt_lengths[{b}]={plens[b]!r} but sample {b} has "
                             f"{n_real} real tokens")
        return p
    if loss is not None:
        first = width - len(loss[b])  # column of loss_mask[b][0]
        if first > 0:  # a response-part mask: everything left of it is prompt
            return sum(max(0, min(hi, first) - lo) for lo, hi in real)
        before = 0
        for lo, hi in real:
            for t, v in _iter_runs(loss[b], lo, hi):
                if v:
                    return before + t - lo
            before += hi - lo
        return n_real
    return n_real


def _iter_runs(mask: list[Any], lo: int, hi: int) -> list[tuple[int, int]]:
    """(start column, value) of each run of ``mask[lo:hi]``."""
    return [(lo + r_lo, v) for v, r_lo, _ in _runs(mask[lo:hi])]


def _turns(row: list[int], response: list[Interval], loss_row: Any, vers_row: Any, observation_role: str = "tool",
           trained_row: Any = None) -> list[Turn]:
    """The response cut into turns (:class:`~rtrace.instrumentation.turns.Turn`), with the
    oldest version of each assistant turn and, given ``trained_row`` (a loss mask apart
    from the who-wrote-it mask ``loss_row``), how many of each turn's tokens are trained on.

    Runs of equal flag over the real response columns; columns left of a response-part
    ``loss_row`` count as 0. Adjacent runs with the same flag (split by padding) are one
    turn.
    """
    width = len(row)
    if loss_row is None:
        flags = [(1, 0, width)]
    else:
        offset = width - len(loss_row)
        flags = ([(0, 0, offset)] if offset else []) + [(v, lo + offset, hi + offset) for v, lo, hi in _runs(loss_row)]
    pieces: list[tuple[bool, list[Interval]]] = []
    i = 0
    for lo, hi in response:  # intersect the real response columns with the flag runs
        while i < len(flags) and flags[i][2] <= lo:
            i += 1
        j = i
        while j < len(flags) and flags[j][1] < hi:
            v, f_lo, f_hi = flags[j]
            piece = (max(lo, f_lo), min(hi, f_hi))
            if pieces and pieces[-1][0] == bool(v):
                pieces[-1][1].append(piece)
            else:
                pieces.append((bool(v), [piece]))
            j += 1
    v_off = width - len(vers_row) if vers_row is not None else 0
    t_off = width - len(trained_row) if trained_row is not None else 0
    turns: list[Turn] = []
    for assistant, ivs in pieces:
        version = None
        if assistant and vers_row is not None:
            vs = _gather(vers_row, [(max(lo - v_off, 0), max(hi - v_off, 0)) for lo, hi in ivs])
            if vs:
                low = min(vs)
                if low < 0:  # AReaL marks non-generated tokens -1: ignore them
                    vs = [v for v in vs if v >= 0]
                    low = min(vs) if vs else None
                version = int(low) if low is not None else None
        trained = None
        if trained_row is not None:
            trained = sum(1 for v in _gather(trained_row, [(max(lo - t_off, 0), max(hi - t_off, 0)) for lo, hi in ivs])
                          if v)
        turns.append(Turn("assistant" if assistant else observation_role, _gather(row, ivs), version,
                          loss_tokens=trained))
    return turns


def _finish_last(turns: list[Turn], reason: str) -> None:
    """Set the finish reason of the last assistant turn (the sample's stop reason)."""
    for k in range(len(turns) - 1, -1, -1):
        if turns[k].role == "assistant":
            turns[k] = turns[k]._replace(finish_reason=reason)
            return


def _reward(per_sample: Any, per_token: Any, b: int) -> float | None:
    if per_sample is not None:
        value = per_sample[b]
    elif per_token is not None:
        value = sum(v for v in per_token[b] if v)  # token-level rewards (zeros elsewhere)
    else:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        _stats.incr("reward_errors")
        return None


def _plain(value: Any) -> Any:
    """A JSON-safe coordinate value (sinks receive trajectories as they are built here)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()  # a numpy / torch scalar
    return str(value)[:200]


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
