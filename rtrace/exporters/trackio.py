"""trackio sink: every trajectory becomes one ``trackio.Trace`` at its RL step.

Each trajectory is logged as ``trackio.Trace(messages, metadata, spans)`` under
``settings.trackio_trace_key`` (``rollout/traces``) or, for validation trajectories,
``settings.trackio_eval_trace_key`` (``eval/traces``), with ``step`` = its RL step.
The schema and the defined forms of odd values are in docs/trackio.md.

Run handling. trackio keeps its current run in a ContextVar, which the sink thread
cannot see, so the sink looks for the application's run process-wide: the run current
in the thread that called ``rtrace.configure()``, and every open ``Run`` whose writer
thread is alive (trackio starts one per run). If there is one, traces go to it and
rtrace never finishes it. Otherwise the sink opens its own run on the first export
(project = ``RTRACE_PROJECT``, name = ``RTRACE_EXPERIMENT``, ``space_id`` =
``TRACKIO_SPACE_ID``) and finishes it at ``rtrace.shutdown()``. Everything is logged
through the ``Run`` object: ``trackio.log`` only sees the ContextVar of its own thread.

Batching. trackio stores a list of Traces logged under one key as one log entry with
one row per trace, so each export batch costs one ``run.log`` per (run, key, step).

Per-step metrics (``rollout/trajectories``, ``rollout/reward_mean`` ... and the same
under ``eval/``, docs/metrics.md) are computed by the pipeline (job-wide in collector
mode) and logged here by :meth:`TrackioSink.export_step_metrics`, once per step, at that
step.

Logging uses trackio's public API only (``trackio.init``, ``Run.log``, ``Run.finish``,
``trackio.Trace``). Finding the application's run, telling whether a run is finished and
flushing a run without finishing it have no public API in trackio 0.43 (pinned in
pyproject): those go through :mod:`rtrace.exporters._trackio_private`, the one module
that touches trackio's private names (each listed there, with the reason).
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .. import _stats
from .._serialize import bidi_visible_messages, finite_or_str
from ..config import ConfigError, Settings
from ..trajectory import SpanRecord, StepMetrics, Trajectory, chat_argument, response_text, token_field
from . import _trackio_private
from .base import PartialExport, Sink

__all__ = ["TrackioSink", "trace_payload", "trace_metadata", "span_dict", "normalize",
           "VAL_MARK"]

_SPAN_KINDS = {"generation": "generation", "tool": "tool"}  # everything else is "span"
_STATUS = {"ok": "success", "error": "error"}  # trackio's dashboard vocabulary
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson (trackio's encoder) accepts


# ----------------------------------------------------------------------------- values
def normalize(value: Any) -> Any:
    """The form in which ``value`` round-trips through trackio's storage.

    Non-finite floats become ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``; tuples and
    sets become lists; dict keys become ``str(key)``; integers outside the 64-bit range
    and unknown objects become their ``str()``; lone surrogates in strings become
    ``\\udXXX`` escapes (trackio's JSON encoder would drop the whole key otherwise).
    """
    cls = type(value)
    if cls is str:
        # orjson rejects lone surrogates; ASCII (the common case) cannot contain any.
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if value is None or cls is bool:
        return value
    if cls is int:
        return value if _INT_MIN <= value <= _INT_MAX else str(value)
    if cls is float:
        return finite_or_str(value)
    if cls is dict:
        return {k if type(k) is str else str(k): normalize(v) for k, v in value.items()}
    if cls is list or cls is tuple:
        return [normalize(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [normalize(v) for v in sorted(value, key=repr)]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return normalize(int(value))
    if isinstance(value, float):
        return normalize(float(value))
    if isinstance(value, str):
        return normalize(str(value))
    if isinstance(value, dict):
        return normalize(dict(value))
    if isinstance(value, (list, tuple)):
        return normalize(list(value))
    return str(value)


_iso_cache: list[Any] = [None, ""]


def iso_time(ns: int) -> str:
    """Epoch nanoseconds as the ISO-8601 UTC string trackio parses (microseconds, ``Z``)."""
    sec, rem = divmod(ns, 1_000_000_000)
    if _iso_cache[0] != sec:  # spans of a trajectory mostly share their second
        _iso_cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _iso_cache[0] = sec
    return f"{_iso_cache[1]}.{rem // 1000:06d}Z"


def _usage(attrs: dict[str, Any]) -> dict[str, int] | None:
    inp = attrs.get("gen_ai.usage.input_tokens")
    out = attrs.get("gen_ai.usage.output_tokens")
    if inp is None and out is None:
        return None
    usage = {}
    if inp is not None:
        usage["input_tokens"] = inp
    if out is not None:
        usage["output_tokens"] = out
    if isinstance(inp, int) and isinstance(out, int):
        usage["total_tokens"] = inp + out
    return usage


# ----------------------------------------------------------------------------- conversion
def _generation_io(traj: Trajectory | None, span: SpanRecord, meta: dict[str, Any]) -> tuple[Any, Any]:
    """What trackio's INPUT / OUTPUT panes show for a generation: the prompt as chat
    messages (a ``messages`` / ``raw_prompt`` / ``prompt`` / ``conversation`` argument) or
    as decoded text; the response as text, or as the
    assistant message with its tool calls. The rest of what the call captured (sampling
    arguments, finish reason...) goes to the span's metadata as ``rtrace.input`` /
    ``rtrace.output``."""
    inputs, outputs = span.input, span.output
    attrs = span.attributes
    chat = chat_argument(inputs)
    prompt = chat[1] if chat is not None else attrs.get("rtrace.prompt_text")
    if prompt is not None:
        shown = chat[0] if chat is not None else None
        rest = {k: v for k, v in inputs.items() if k != shown} if isinstance(inputs, dict) else inputs
        if rest:
            meta["rtrace.input"] = rest
        inputs = prompt
    # the text the model produced (decoded), else the turn's content; with the tool calls
    # that followed it, the assistant message (the agent's own may hold the text without
    # its tool-call markup)
    text = response_text(span)
    turn = traj.turn_of(span) if traj is not None else None
    response: Any = text if text is not None else turn.get("content") if turn is not None else None
    if turn is not None and turn.get("tool_calls"):
        response = {**turn, "content": response}
    if response is not None:
        if outputs is not None:
            meta["rtrace.output"] = outputs
        outputs = response
    return inputs, outputs


def _root_io(traj: Trajectory, span: SpanRecord) -> tuple[Any, Any]:
    """The root (the span a trace opens on): the task (system prompt and question) in, the
    final answer, the reward and the outcome out — unless its call captured its own (the
    task's and the answer's bidirectional controls written visibly, as in the conversation)."""
    inputs, outputs = span.input, span.output
    if inputs is None and traj.messages:
        inputs = bidi_visible_messages(traj.task_messages())
    if outputs is None:
        result: dict[str, Any] = {}
        final = traj.final_answer()
        if final is not None:
            result["answer"] = bidi_visible_messages([final])[0].get("content")
        if traj.reward is not None or traj.outcome:
            result["reward"] = traj.reward
        if traj.outcome:
            result["outcome"] = traj.outcome
        if traj.annotations:
            result["annotations"] = traj.annotations
        outputs = result or None
    return inputs, outputs


def span_dict(span: SpanRecord, traj: Trajectory | None = None) -> dict[str, Any]:
    """One rtrace span as a trackio span dict (normalised, see :func:`normalize`).

    With its trajectory, the root shows the task and the result, and a generation its
    prompt and response (:func:`_root_io`, :func:`_generation_io`); other spans show what
    their call captured.
    """
    attrs = span.attributes
    meta: dict[str, Any] = {"rtrace.kind": span.kind}
    meta.update(attrs)
    if span.events:
        meta["rtrace.events"] = span.events
    if span.prompt_ids is not None:
        meta["rtrace.prompt_ids"] = span.prompt_ids
    if span.response_ids is not None:
        meta["rtrace.response_ids"] = span.response_ids
    if span.token_values:  # compact (base64 float32), not a number per token in SQLite's JSON
        meta["rtrace.token_values"] = token_field(span.token_values)
    if traj is not None and span is traj.spans[0]:
        inputs, outputs = _root_io(traj, span)
    elif span.kind == "generation":
        inputs, outputs = _generation_io(traj, span, meta)
    else:
        inputs, outputs = span.input, span.output
    return {
        "id": span.span_id,
        "parent_id": span.parent_id,
        "name": normalize(span.name),
        "kind": _SPAN_KINDS.get(span.kind, "span"),
        "start_time": iso_time(span.start_ns),
        "end_time": iso_time(span.end_ns),
        "duration_ms": span.duration_ms,
        "status": _STATUS.get(span.status, span.status),
        "error": normalize(span.error),
        "input": normalize(inputs),
        "output": normalize(outputs),
        "model": normalize(attrs.get("gen_ai.request.model", attrs.get("gen_ai.response.model"))),
        "usage": normalize(_usage(attrs)),
        "metadata": normalize(meta),
    }


def _token_sum(gens: list[SpanRecord], key: str) -> int | None:
    values = [s.attributes.get(key) for s in gens]
    values = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return sum(values) if values else None


#: Always in the header, first, in this order (``None`` shown as such), after rtrace's trace
#: id (trackio's own TRACE ID column is the id of a log batch, not of the trajectory).
_HEADER_FIRST = ("step", "sample_index", "rollout_n", "reward", "group_id", "policy_version")
#: Keys written after the annotations (an annotation of such a name goes under ``annotations.<key>``).
_LATER = frozenset({"kept", "trace_id", "validate", "health", "duration_ms", "generation_ms", "tool_ms", "num_turns", "num_tool_calls",
                    "finish_reason", "prompt_tokens", "response_tokens", "experiment", "status", "name", "partial",
                    "error", "dropped_spans"})
#: Starts the ``status`` of a validation trajectory: trackio's trace list shows each trace's status.
VAL_MARK = "[val]"


#: A mark before each verdict: trackio colours a status pill red only when it is exactly
#: ``error`` (every other status is green), so a wrong answer is told apart by its mark.
VERDICT_MARKS = {"correct": "✓", "wrong": "✗", "truncated": "⚠", "partial": "⚠", "error": "✗"}


def status_text(traj: Trajectory) -> str:
    """What trackio's Status column shows (and its search matches): :data:`VAL_MARK` for a
    validation trajectory, the verdict (``correct``, ``wrong``, ``truncated``, ``error``,
    ``partial``, ``ok``; :meth:`Trajectory.verdict`) after its mark (:data:`VERDICT_MARKS`)
    and the reward, e.g. ``✗ wrong reward=0.0`` or ``[val] ✓ correct reward=1.0``."""
    parts = [VAL_MARK] if traj.validate else []
    verdict = traj.verdict()
    if verdict in VERDICT_MARKS:
        parts.append(VERDICT_MARKS[verdict])
    parts.append(verdict)
    if traj.reward is not None:
        parts.append(f"reward={traj.reward!r}")
    return " ".join(parts)


def _ms(value: float) -> float:
    return round(value, 1)  # 2697.3, not 2697.282937


def trace_metadata(traj: Trajectory) -> dict[str, Any]:
    """The trace-level metadata of a trajectory (normalised), in the order trackio's trace
    header shows it: rtrace's trace id; the RL coordinates and the reward; the outcome
    (``outcome.<k>``), the annotations (``advantage`` ...) and why it was kept; durations
    (ms, one decimal), turns and tokens; the rest. Keys at their default (``validate:
    false``, ``partial: false``, no error, no dropped span, ``None``) are left out, so a
    search for ``false`` finds an outcome, not every training trace; ``status`` is
    :func:`status_text`."""
    gens = traj.spans_of_kind("generation")
    finish = traj.finish_reason
    meta: dict[str, Any] = {"trace_id": traj.trace_id}
    meta.update((name, getattr(traj, name)) for name in _HEADER_FIRST)
    if traj.validate:
        meta["validate"] = True
    rest: dict[str, Any] = {f"outcome.{key}": value for key, value in traj.outcome.items()}
    for key, value in traj.annotations.items():  # advantage, returns ...: under their own name
        rest[f"annotations.{key}" if key in meta or key in _LATER else key] = value
    if traj.kept:
        rest["kept"] = ",".join(map(str, traj.kept))
    rest.update({
        "duration_ms": _ms(traj.duration_ms),
        "generation_ms": _ms(sum(s.duration_ms for s in gens)),
        "tool_ms": _ms(sum(s.duration_ms for s in traj.spans_of_kind("tool"))),
        "num_turns": traj.num_turns,
        "num_tool_calls": traj.num_tool_calls,
        "finish_reason": finish,
        "prompt_tokens": _token_sum(gens, "gen_ai.usage.input_tokens"),
        "response_tokens": _token_sum(gens, "gen_ai.usage.output_tokens"),
        "experiment": traj.experiment,
    })
    rest.update((f"extra.{key}", value) for key, value in traj.extra.items())
    rest["status"] = status_text(traj)
    if traj.health:  # searchable: "token_continuity" finds the trajectories that failed it
        rest["health"] = "; ".join(f"{f['check']}: {f['detail']}" for f in traj.health)
    if traj.name != "rollout":
        rest["name"] = traj.name
    if traj.partial:
        rest["partial"] = True
    rest["error"] = traj.error
    if traj.dropped_spans:
        rest["dropped_spans"] = traj.dropped_spans
    meta.update((k, v) for k, v in rest.items() if v is not None)
    return normalize(meta)


def call_text(tool_calls: Any) -> str:
    """Tool calls as a person reads them: ``calculator(expression="33 - 14 * 5")``, one per
    line (arguments as JSON values; arguments that are not an object as they are)."""
    lines = []
    for call in tool_calls if isinstance(tool_calls, list) else ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if isinstance(args, dict):
            shown = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in args.items())
        else:
            shown = "" if args is None else str(args)
        lines.append(f"{name or '?'}({shown})")
    return "\n".join(lines)


def readable_messages(messages: list[Any]) -> list[Any]:
    """The conversation as trackio's trace list should preview it: an assistant turn that
    only called tools (content ``""``) shows its calls as its content (trackio previews the
    first assistant message, "(no assistant response)" otherwise). The tool calls stay.
    Bidirectional controls in what trackio shows are written as ``⟨U+202E⟩``
    (:func:`rtrace._serialize.bidi_visible`): ``\\u202egnp.exe`` is not shown as ``exe.png``."""
    out = []
    for msg in messages:
        if (isinstance(msg, dict) and msg.get("role") == "assistant" and not msg.get("content")
                and msg.get("tool_calls")):
            text = call_text(msg["tool_calls"])
            if text:
                msg = {**msg, "content": text}
        out.append(msg)
    return bidi_visible_messages(out)


def trace_payload(traj: Trajectory) -> tuple[list[dict], dict[str, Any], list[dict]]:
    """``(messages, metadata, spans)`` of the trackio Trace for one trajectory."""
    return normalize(readable_messages(traj.messages)), trace_metadata(traj), [span_dict(s, traj) for s in traj.spans]


# ----------------------------------------------------------------------------- summaries
def _int_step(step: Any) -> int | None:
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# ----------------------------------------------------------------------------- the sink
class TrackioSink(Sink):
    """Logs one ``trackio.Trace`` per trajectory, plus per-step summary metrics."""

    name = "trackio"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        if importlib.util.find_spec("trackio") is None:
            raise ConfigError("RTRACE_EXPORTER=trackio needs trackio, which is not installed; "
                              "install it with: pip install 'rtrace[trackio]'")
        # configure() runs on the application's thread: the only place where trackio's
        # ContextVar shows a run the application opened before (if trackio is imported).
        self._configure_run = None
        try:
            self._configure_run = _trackio_private.current_run()
        except Exception:
            _stats.warn_once("trackio-current-run", "rtrace could not look up the current trackio run",
                             exc_info=True)
        self._trackio: Any = None
        self._own_run: Any = None
        self._lock = threading.Lock()
        self._touched: list[Any] = []  # runs logged to since the last flush
        #: run id -> traces its local store held after the last verified export
        self._stored: dict[str, int] = {}

    # ------------------------------------------------------------------ runs
    def _import(self) -> Any:
        if self._trackio is None:
            import trackio  # imported at configure() on the application thread (exporters.APP_THREAD_IMPORTS)

            self._trackio = trackio
        return self._trackio

    @staticmethod
    def _is_open(run: Any) -> bool:
        if run is None:
            return False
        try:
            return not _trackio_private.run_is_finished(run)
        except Exception:  # trackio moved the flag: take the run as open (the canary test names it)
            _stats.warn_once("trackio-finished", "rtrace could not tell whether a trackio run is finished",
                             exc_info=True)
            return True

    def _app_run(self) -> Any:
        """The newest open run of this process that rtrace did not open, if any."""
        trackio = self._trackio
        run_cls = trackio.Run
        found: list[Any] = []
        try:
            found.append(_trackio_private.current_run(trackio))
            found.extend(_trackio_private.runs_with_writer_threads(run_cls))
        except Exception:
            _stats.warn_once("trackio-app-run", "rtrace could not look for the application's trackio run",
                             exc_info=True)
        found.append(self._configure_run)
        found = [r for r in found if isinstance(r, run_cls) and r is not self._own_run and self._is_open(r)]
        if not found:
            return None
        return max(found, key=_trackio_private.run_created_at)

    def _run(self) -> Any:
        self._import()
        app = self._app_run()
        if app is not None:
            return app
        if not self._is_open(self._own_run):
            s = self.settings
            self._own_run = self._trackio.init(project=s.project, name=s.experiment, space_id=s.space_id,
                                               auto_log_cpu=False, auto_log_gpu=False, embed=False)
        return self._own_run

    # ------------------------------------------------------------------ export
    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Log the batch and, for a local run, make it durable and count what was stored.

        trackio never raises on a failed write: it warns and drops the batch (a read-only
        ``TRACKIO_DIR``, a full disk). So the batch is written now (the writer thread's
        own inline flush) and the run's stored traces are counted before and after;
        what is missing is raised as :class:`PartialExport` (counted as failed), so
        ``exported`` means stored. A Space or remote server is written by trackio's
        sender thread and is not read back here.

        Raises:
            PartialExport: some traces of the batch are not in the store.
        """
        with self._lock:
            run = self._run()
            Trace = self._trackio.Trace
            s = self.settings
            groups: dict[tuple[str, Any], list[Any]] = {}
            for traj in trajectories:
                key = s.trackio_eval_trace_key if traj.validate else s.trackio_trace_key
                messages, metadata, spans = trace_payload(traj)
                groups.setdefault((key, _int_step(traj.step)), []).append(Trace(messages, metadata, spans))
            local = _trackio_private.is_local(run)
            before = self._stored_before(run) if local else None
            for (key, step), traces in groups.items():
                run.log({key: traces}, step=step)
            if run not in self._touched:
                self._touched.append(run)
            if local:
                self._verify(run, before, len(trajectories))

    def _stored_before(self, run: Any) -> int | None:
        """Traces the run's store held before this batch: known from the last verified
        batch, else read now (None: the store cannot be read)."""
        known = self._stored.get(run.id)
        if known is None:
            deadline = time.monotonic() + self.settings.sink_timeout_s
            _trackio_private.flush_run(run, deadline)
            try:
                known = self._stored[run.id] = _count(run, deadline)
            except Exception:
                return None
        return known

    def _verify(self, run: Any, before: int | None, n: int) -> None:
        """Write the run's queue now and check that ``n`` more traces are stored. A store
        that cannot be read (a read-only ``TRACKIO_DIR`` refuses trackio's lock file to
        readers too) is read again until ``sink_timeout_s``; one that stays unreadable
        cannot show the batch is durable: it counts as failed."""
        deadline = time.monotonic() + self.settings.sink_timeout_s
        durable = _trackio_private.flush_run(run, deadline)
        try:
            if before is None:
                raise OSError("no count before the batch")
            after = _count(run, deadline)
        except Exception as exc:
            self._stored.pop(run.id, None)  # read again before the next batch
            raise PartialExport(n, f"trackio's store could not be read back ({exc})") from None
        self._stored[run.id] = after
        # more than n: the application logged traces of its own to the same run meanwhile
        lost = max(0, n - (after - before))
        if lost:
            why = "" if durable else " (trackio's writer held the run past the sink timeout)"
            raise PartialExport(lost, f"{lost} of {n} traces are not in trackio's store{why}; trackio warns "
                                      "of its failed writes and drops them")

    def export_step_metrics(self, metrics: Sequence[StepMetrics]) -> None:
        """Log each step's metrics (computed job-wide by the pipeline) at that step."""
        with self._lock:
            run = self._run()
            for m in metrics:
                # the step's rollouts table beside its metrics (Media & Tables page), the
                # slowest trajectory marked in it: trackio plots no string metric
                values: dict[str, Any] = dict(m.values)
                if m.rows:
                    key = ("eval" if m.validate else "rollout") + "/rollouts"
                    values[key] = self._trackio.Table(data=normalize(m.rows))
                run.log(values, step=_int_step(m.step))
            if run not in self._touched:
                self._touched.append(run)

    # ------------------------------------------------------------------ flush / shutdown
    def flush(self, timeout_s: float) -> None:
        """Write every queued log to storage."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            runs, self._touched = self._touched, []
        for run in runs:
            _drain(run, deadline)

    def shutdown(self) -> None:
        """Flush; finish the run only if rtrace opened it (never the application's)."""
        self.flush(self.settings.sink_timeout_s)
        with self._lock:
            run, self._own_run = self._own_run, None
        if run is not None and self._is_open(run):
            run.finish()


def _count(run: Any, deadline: float) -> int:
    """The run's stored traces, read again every 0.1 s until ``deadline`` while the store
    cannot be read (the last error is raised then)."""
    while True:
        try:
            return _trackio_private.stored_trace_count(run)
        except Exception:
            if time.monotonic() + 0.1 > deadline:
                raise
            time.sleep(0.1)


def _drain(run: Any, deadline: float) -> None:
    """Make a run's queued logs durable: write them inline for a local run (trackio's
    writer thread would do it within 0.5 s), wait for the sender for a remote one."""
    try:
        done = _trackio_private.flush_run(run, deadline)
    except Exception:
        _stats.warn_once("trackio-flush-api", "rtrace could not flush trackio's queued logs", exc_info=True)
        return
    if not done:
        _stats.warn_once("trackio-flush", "rtrace: trackio did not write its queued logs in time")
