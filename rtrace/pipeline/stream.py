"""Collector mode in a rollout worker: spans leave the process as they end.

With ``RTRACE_EXPORTER=collector`` the worker does not assemble trajectories. Every
``export_interval_s`` (0.5 s) its worker thread converts the spans that ended (captured
values to JSON-safe data; no decoding, no sink work), stamps each with its
trajectory's ``rl.*`` coordinates, marks the trajectory root ``rtrace.root`` (with
``rl.reward`` and ``rl.outcome.*``), and hands them, grouped by trace, to the collector
sink. Annotations made here travel the same way, as ``rtrace.annotation`` spans. So a
worker that Ray ends without ``atexit``, or that is killed, loses at most the last
half second; its open trajectories are written by the collector as partial.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from .. import _ids, _stats
from .._serialize import attr_ok, json_safe, json_text, vouch
from ..trajectory import SpanRecord, Trajectory
from .annotations import Annotation
from .builder import SpanConverter, _reward, coordinates
from .fleet import event_shell, take_in
from .summaries import records_of_tally, state_of_tally, summary_of_tally
from .records import Tally, TrajectoryState, ids_of, record_of
from .tokens import wire_values
from .worker import _CHUNK, Pipeline

__all__ = ["StreamPipeline", "ANNOTATION_SPAN", "MESSAGES_ATTR", "ANNOTATIONS_ATTR", "TOKENIZER_ATTR",
           "SUMMARIES_SPAN", "SUMMARIES_ATTR", "summaries_shells"]

#: On the root of a rollout a worker recorded as a summary only and sends in full after all.
PROMOTED_ATTR = "rtrace.promoted"

#: Name of the span that carries an annotation to the collector.
ANNOTATION_SPAN = "rtrace.annotation"
#: Annotations turned into shells and handed to the sink at a time.
_ANNOTATION_PART = 4096


class StreamPipeline(Pipeline):
    """The worker's pipeline in collector mode (see the module docstring)."""

    #: the name or local path of the tokenizer a trainer adapter handed in (None: none);
    #: set by rtrace._setup, stamped on each root for the collector to load
    tokenizer_name: Any = staticmethod(lambda: None)
    #: (validate, step) -> rollouts promoted (sent in full after all); recent steps only
    _promoted: "OrderedDict[tuple[bool, Any], int] | None" = None
    #: the last round's summaries hold converted values only (they may be vouched for)
    _plain_summaries = False
    #: summaries made and not sent yet (wire dicts), since when, and whether all are plain
    _pending: Any = ()  # (a list of the instance's own once there is one)
    _pending_since = 0.0
    _pending_plain = True

    def _round(self, now: float, expire: bool, force: bool) -> None:
        """Everything queued when the round starts, :data:`~rtrace.pipeline.worker._CHUNK`
        spans at a time (each part is sent before the next is read, as in one process)."""
        left = len(self._queue)
        while left > _CHUNK:
            self._part(_CHUNK, now, False, False)
            left -= _CHUNK
        self._part(left, now, expire, force)

    def _part(self, n: int, now: float, expire: bool, force: bool) -> None:
        q, pre = self._queue, self._states
        spans = [q.popleft() for _ in range(n)]
        prebuilt = [pre.popleft() for _ in range(len(pre))]
        annotations = self._take_annotations()
        conv = SpanConverter(self.settings)
        if self._events:
            self._take_events(conv)
        values = conv.conv
        shells: dict[int, Trajectory] = {}
        stamps: dict[int, dict[str, Any]] = {}
        unplain: set[int] = set()  # traces with a record that is not plain JSON data
        for i, span in enumerate(spans):
            spans[i] = None  # let it go once converted (as Pipeline._assemble)
            trace_id, span_id = ids_of(span)
            state, is_root = self.registry.arrive(trace_id, span_id)
            if state is None:
                _stats.incr("spans_late")
                continue
            before = values.unplain
            try:
                record = conv.convert(span, record_of(span, state, span_id))
                self._stamp(state, record, is_root, stamps, conv)
            except Exception:
                _stats.incr("capture_errors")
                _stats.warn_once("convert", "rtrace could not convert a span; it is dropped", exc_info=True)
                continue
            if values.unplain != before:
                unplain.add(trace_id)
            if is_root:
                self.registry.remove(state)
            self._shell(shells, state).spans.append(record)
        for state in prebuilt:  # log_rollout_batch, the adapters: whole trajectories (not vouched for)
            root_id = format(state.root_span_id, "016x")
            for record in state.records:
                is_root = record.span_id == root_id
                self._stamp(state, record, is_root, stamps, conv)
                if is_root:
                    _carry(state, record)
            self._shell(shells, state).spans.extend(state.records)
            unplain.add(state.trace_id)
        for trace_id, shell in shells.items():
            if trace_id not in unplain:
                vouch(shell)  # converted values only: the sink may skip its NaN walk (encode_compact)
        if expire:
            # Open trajectories whose root was lost (or, at shutdown, never ended): what
            # arrived is already at the collector, which writes them as partial.
            for state in self.registry.expire(now, self.settings.orphan_timeout_s, force):
                _stats.incr("trajectories_left_to_collector")
        tallies = self._tallies
        parts: list[Trajectory] = []
        if tallies:
            summaries = self._summaries([tallies.popleft() for _ in range(len(tallies))], conv, parts)
            if summaries:
                if not self._pending:
                    self._pending, self._pending_since, self._pending_plain = [], now, True
                self._pending.extend(summaries)
                self._pending_plain = self._pending_plain and self._plain_summaries
        pending = self._pending
        # The worker reads tallies 64 at a time (their marks hold what the calls saw), but sends
        # their summaries a span of up to SUMMARIES_PER_SPAN at a time, at most export_interval_s
        # after the first: the collector pays per request (admission, decoding, a round).
        if pending and (len(pending) >= SUMMARIES_PER_SPAN or force or self._serving_flush
                        or now - self._pending_since >= self.settings.export_interval_s):
            self._pending = []
            carriers = summaries_shells(pending)
            if self._pending_plain:
                for shell in carriers:
                    vouch(shell)  # converted values only (a NaN reward is its text): the NaN walk is skipped
            parts += carriers
        if parts:
            _stats.incr("segments_streamed", len(parts))
            self.fanout.submit(parts)
        conv.count()
        if shells:
            _stats.incr("segments_streamed", len(shells))
            self.fanout.submit(list(shells.values()))
        # A trainer's annotate_batch for a step (10^5 rows) leaves in parts: the collector sink
        # encodes each part while the next is made, and the fanout waits for its room
        # (hold_back, rtrace._setup), so no part is dropped and never are all the shells alive at once.
        for i in range(0, len(annotations), _ANNOTATION_PART):
            part = [_annotation_shell(a) for a in annotations[i:i + _ANNOTATION_PART]]
            _stats.incr("segments_streamed", len(part))
            self.fanout.submit(part)

    def _take_events(self, conv: SpanConverter) -> None:
        """Run events leave for every collector (pipeline/fleet.py), each a segment of its own."""
        q = self._events
        events = take_in([q.popleft() for _ in range(len(q))], self.worker_name, conv.conv)
        if events:
            _stats.incr("segments_streamed", len(events))
            self.fanout.submit([event_shell(e) for e in events])

    def _summaries(self, tallies: list[Tally], conv: SpanConverter, out: list[Trajectory]) -> list[dict[str, Any]]:
        """Rollouts recorded as summaries only, as the collector reads them: the checks of
        their records here (the reward, staleness and coordinates are checked in the collector,
        where the annotations and the rest of the step are). One the collector's tail may keep
        is sent in full instead, appended to ``out`` (:meth:`_promote`)."""
        summaries = []
        health = self.health
        settings = self.settings
        values = conv.conv
        unplain = values.unplain
        for tally in tallies:
            try:
                summary = summary_of_tally(tally, settings, conv, health)
                summary.worker = self.worker_name
                # what the collector's tail keeps (tail_of): a failed root, a generation stopped at
                # length (keep_errors), a health finding (keep_unhealthy)
                if (summary.status == "error" or summary.truncated or summary.health) and self._promote(tally.coords):
                    out.append(self._promoted_shell(tally, state_of_tally(tally, settings, conv), conv))
                    continue
                summaries.append(summary.to_wire())
            except Exception:
                _stats.incr("summaries_build_failed")
                _stats.warn_once("summary", "rtrace could not summarize a rollout; it is not counted", exc_info=True)
        if summaries:
            _stats.incr("rollouts_summarized", len(summaries))
        self._plain_summaries = values.unplain == unplain
        return summaries

    def _promote(self, coords: dict[str, Any]) -> bool:
        """Is there room to send this rollout in full (RTRACE_PROMOTE_PER_STEP per (validate,
        step), in this worker)? Counted either way."""
        limit = self.settings.promote_per_step
        if limit <= 0:
            return False
        table = self._promoted
        if table is None:
            table = self._promoted = OrderedDict()
        key = (bool(coords.get("validate")), coords.get("step"))
        try:
            n = table.get(key, 0)
        except TypeError:  # a step that is no key (the collector refuses it anyway): a summary
            return False
        if n >= limit:
            _stats.incr("summaries_promotion_skipped")
            return False
        table[key] = n + 1
        table.move_to_end(key)
        if len(table) > _PROMOTED_STEPS:
            table.popitem(last=False)
        _stats.incr("summaries_promoted")
        return True

    def _promoted_shell(self, tally: Tally, state: TrajectoryState, conv: SpanConverter) -> Trajectory:
        """A tallied rollout as a recorded one's segment: its marks converted as spans, its
        root stamped as a root (coordinates, ``rtrace.root``, reward, outcome), so the collector
        assembles it like any trajectory and its selection decides. Not vouched for (rare)."""
        records = records_of_tally(tally, state, conv)
        stamps: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(records):
            self._stamp(state, record, i == 0, stamps, conv)
        records[0].attributes[PROMOTED_ATTR] = True  # the collector's tail may keep it, its sample never
        return Trajectory(trace_id=format(state.trace_id, "032x"), name=state.name, spans=records)

    def _stamp(self, state: TrajectoryState, record: SpanRecord, is_root: bool,
               stamps: dict[int, dict[str, Any]], conv: SpanConverter) -> None:
        # Coordinates go on the root and on the first span of each trace in a round (the
        # collector stamps every span; a partial trajectory gets them from any span that
        # arrived): the SDK's OTLP encoder costs per attribute.
        attrs = record.attributes
        first = state.trace_id not in stamps
        if first:
            stamps[state.trace_id] = coordinates(state, self.settings, conv.conv)[2]
        if first or is_root:
            for key, value in stamps[state.trace_id].items():
                attrs.setdefault(key, value)

        if is_root and state.kind != "segment":
            attrs["rtrace.root"] = True
            if record.kind == "span":
                record.kind = state.kind
            outcome = conv.conv.convert_named(state.outcome)
            reward = _reward(state.reward, outcome) if state.has_reward else None
            if reward is not None:
                attrs["rl.reward"] = reward
                if reward - reward != 0.0:  # NaN or an infinity: not plain JSON (see vouch())
                    conv.conv.unplain += 1
            attrs.update({f"rl.outcome.{k}": v for k, v in outcome.items() if attr_ok(v)})
            if self.settings.job_id:
                attrs["rtrace.job_id"] = self.settings.job_id
            name = self.tokenizer_name()
            if name is not None:
                attrs[TOKENIZER_ATTR] = name

    @staticmethod
    def _shell(shells: dict[int, Trajectory], state: TrajectoryState) -> Trajectory:
        shell = shells.get(state.trace_id)
        if shell is None:
            shell = shells[state.trace_id] = Trajectory(trace_id=format(state.trace_id, "032x"), name=state.name,
                                                        spans=[])
        return shell


#: Root attributes that carry what a prebuilt trajectory holds beside its spans (the
#: conversation an adapter or ``log_rollout_batch(messages=)`` gave, the annotations it
#: set): the collector puts them back on the trajectory and off the span (``unpack_carried``).
MESSAGES_ATTR = "rtrace.carried.messages"
ANNOTATIONS_ATTR = "rtrace.carried.annotations"
#: Root attribute naming the trainer's tokenizer (its ``name_or_path``; ``""`` for one made
#: in code) when a trainer adapter handed one in: the collector decodes then (token2text
#: unset), with a tokenizer of its own or else this one, loaded offline; it takes the
#: attribute off the span.
TOKENIZER_ATTR = "rtrace.carried.tokenizer"


def _carry(state: TrajectoryState, root: SpanRecord) -> None:
    """Put a prebuilt trajectory's conversation and annotations on its root (JSON text),
    so the collector writes what one process would have written."""
    if state.messages:
        root.attributes[MESSAGES_ATTR] = json_text(json_safe(state.messages))
    if state.annotations:
        root.attributes[ANNOTATIONS_ATTR] = json_text(json_safe(state.annotations))


#: Steps a worker remembers its promotions of (RTRACE_PROMOTE_PER_STEP): workers run a few at a time
_PROMOTED_STEPS = 64

#: Name of the span that carries rollout summaries to the collector, and its attribute: a
#: list of :meth:`~rtrace.summary.RolloutSummary.to_wire` dicts (each with its coordinates:
#: a router splits the list by them).
SUMMARIES_SPAN = "rtrace.summaries"
SUMMARIES_ATTR = "rtrace.summaries"
#: Summaries per span (~0.5 kB each: well within the collector's span size bound)
SUMMARIES_PER_SPAN = 1024


def summaries_shells(summaries: list[dict[str, Any]]) -> list[Trajectory]:
    """Rollout summaries as one-span segments (each a trace of its own), one per placement
    key (a GRPO group's, :func:`rtrace.placement.route_key`): the span carries the key's
    ``rl.*`` coordinates, so each goes to the collector that owns its rollouts, and so do its
    annotations."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for s in summaries:
        key = (s.get("experiment"), s.get("validate") is True, s.get("step"), s.get("sample_index"))
        try:
            groups.setdefault(key, []).append(s)
        except TypeError:  # a coordinate that is no key (the collector refuses the summary): its own span
            groups[(None, False, None, id(s))] = [s]
    now = time.time_ns()
    out = []
    for (experiment, validate, step, index), group in groups.items():
        for i in range(0, len(group), SUMMARIES_PER_SPAN):
            attrs: dict[str, Any] = {"rl.validate": validate}
            for name, value in (("rl.experiment", experiment), ("rl.step", step), ("rl.sample_index", index)):
                if value is not None and attr_ok(value):
                    attrs[name] = value
            attrs[SUMMARIES_ATTR] = group[i:i + SUMMARIES_PER_SPAN]
            span = SpanRecord(span_id=format(_ids.span_id(), "016x"), parent_id=None, name=SUMMARIES_SPAN,
                              kind="summaries", start_ns=now, end_ns=now, attributes=attrs)
            out.append(Trajectory(trace_id=format(_ids.trace_id(), "032x"), name=SUMMARIES_SPAN, spans=[span]))
    return out


def _annotation_shell(ann: Annotation) -> Trajectory:
    """An annotation as a one-span segment (its own trace, or the target's when known)."""
    # json_text: json.dumps(default=str) without the Python layers (a third of the time: a
    # trainer's annotate_batch makes 10^5 of these on rtrace's thread, beside the trainer's)
    attrs: dict[str, Any] = {"rtrace.annotation.values": json_text(wire_values(ann.values))}
    if ann.key is not None:
        validate, step, index, rollout = ann.key
        attrs.update({"rl.validate": validate, "rl.step": step, "rl.sample_index": index})
        if rollout is not None:
            attrs["rl.rollout_n"] = rollout
    if ann.trace_id is not None:
        attrs["rtrace.annotation.trace_id"] = format(ann.trace_id, "032x")
    trace_id = ann.trace_id if ann.trace_id is not None else _ids.trace_id()
    now = time.time_ns()
    span = SpanRecord(span_id=format(_ids.span_id(), "016x"), parent_id=None, name=ANNOTATION_SPAN,
                      kind="annotation", start_ns=now, end_ns=now,
                      attributes={k: v for k, v in attrs.items() if attr_ok(v)})
    return Trajectory(trace_id=format(trace_id, "032x"), name=ANNOTATION_SPAN, spans=[span])
