"""What the collector takes from a request, decided before it answers.

The OTLP receiver calls :meth:`Admission.admit` with each decoded request, on one of its
threads, before the sender gets an answer; what is decided here is what the sender is
told (the OpenTelemetry Collector's receiver and memory limiter work the same way:
refuse early, say so, never hold what was refused):

* **Spans refused for good** — ids OTLP does not allow (a trace id that is not 16
  bytes, a span id that is not 8, either all zero; a parent id that is neither empty
  nor 8 bytes), a span larger than ``RTRACE_COLLECTOR_MAX_SPAN_BYTES`` on the wire, more
  attributes than ``RTRACE_COLLECTOR_MAX_ATTRIBUTES``: counted (``collector_spans_refused``,
  ``collector_refused.<why>``) and answered ``partial_success.rejected_spans`` with an
  ``error_message`` (gRPC OK / HTTP 200, never resent). The rest of the request is taken.
* **Push-back** — what the request would add to the table once every request queued
  before it is assembled (open trajectories + those queued requests' new trace ids +
  this request's; bytes likewise) is compared with ``max_open_trajectories`` and
  ``RTRACE_COLLECTOR_MAX_HELD_BYTES``, and the queue's spans with ``max_queue_size``.
  Over a limit: :class:`~rtrace.pipeline.otlp_receiver.Backpressure` (gRPC
  RESOURCE_EXHAUSTED with ``RetryInfo``, HTTP 429 with ``Retry-After``); the sender keeps
  the request and sends all of it again. Taken: its new trajectories and bytes are
  *reserved* until the worker has assembled it, so the worker always has room for what
  was answered OK (before, admission looked at the table alone, and a burst answered OK
  was dropped in the worker: ``spans_dropped_open_limit``).
* **A request larger than the whole table** (more new trajectories than
  ``max_open_trajectories``, more bytes than the held-bytes bound, more spans than the
  queue) can never be taken whole. Once the collector is at most half full, its first
  trajectories that fit are taken and the others refused whole, answered as a partial
  success (``collector_refused.capacity``; each such trajectory counted once in
  ``trajectories_dropped_open_limit``); until then, push-back.

What only the worker can check (the JSON record, the coordinates, annotations) is still
refused there, after the answer (docs/collector.md, "Limits").
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any, Callable

from .. import _stats
from .otlp_receiver import Backpressure, PartialSuccess, count_spans
from .registry import TrajectoryRegistry
from .stream import ANNOTATION_SPAN

__all__ = ["Admission", "Ticket", "REFUSED", "RETRY_AFTER_S"]

#: the delay the sender is asked to wait before it sends a pushed-back request again
#: (the worker drains ~30,000 spans/s; trajectories settle ``settle_s``, 2 s by default)
RETRY_AFTER_S = 1.0

#: what each refusal means, for the sender's ``error_message``
REFUSED = {
    "trace_id": "trace id not 16 bytes or all zero",
    "span_id": "span id not 8 bytes or all zero",
    "parent_span_id": "parent span id neither empty nor 8 bytes, or all zero",
    "size": "span larger than RTRACE_COLLECTOR_MAX_SPAN_BYTES",
    "attributes": "more attributes than RTRACE_COLLECTOR_MAX_ATTRIBUTES",
    "capacity": "the request holds more than the collector can hold at once (max_open_trajectories, "
                "RTRACE_COLLECTOR_MAX_HELD_BYTES or max_queue_size): send smaller requests",
}

_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


class Ticket:
    """A request taken into the queue, with what it reserved until the worker assembled it."""

    __slots__ = ("request", "sizes", "spans", "opens", "nbytes")

    def __init__(self, request: Any, sizes: list[int], spans: int, opens: int, nbytes: int) -> None:
        self.request = request
        #: each span's wire bytes, in request order; -1: refused at the request (skip it)
        self.sizes = sizes
        #: spans taken (the queue's room), new trajectories and bytes reserved
        self.spans, self.opens, self.nbytes = spans, opens, nbytes


class Admission:
    """The collector's queue of requests and what they reserve (see the module docstring).

    Args:
        registry: the open-trajectory table (read here; the worker writes it).
        max_queue: spans queued at most.
        max_span_bytes / max_attributes: a span beyond either is refused.
        max_held_bytes: wire bytes the open trajectories may hold.
        on_pressure: called (outside the lock) when the table pushed a request back; the
            worker then makes room (eviction).
    """

    def __init__(self, registry: TrajectoryRegistry, max_queue: int, max_span_bytes: int, max_attributes: int,
                 max_held_bytes: int, on_pressure: Callable[[], None] = lambda: None) -> None:
        self.registry = registry
        self.max_queue = max_queue
        self.max_span_bytes = max_span_bytes
        self.max_attributes = max_attributes
        self.max_held_bytes = max_held_bytes
        self._on_pressure = on_pressure
        self._lock = threading.Lock()
        self._tickets: deque[Ticket] = deque()
        #: spans queued; new trajectories and bytes the queued requests reserved
        self.queued = 0
        self.reserved_open = 0
        self.reserved_bytes = 0

    # ------------------------------------------------------------------ receiver threads
    def admit(self, request: Any) -> PartialSuccess | None:
        """Take ``request`` (queued for the worker) or raise ``Backpressure``; returns the
        spans refused for good, if any, as a :class:`PartialSuccess`."""
        if self.queued >= self.max_queue:  # no room for a single span: not worth walking it
            with self._lock:
                if self.queued >= self.max_queue:
                    raise self._push_back(f"queue full ({self.max_queue} spans)", count_spans(request))
        sizes, traces, refused, nbytes = self._check(request)
        spans = len(sizes) - sum(refused.values())
        registry = self.registry
        # trace ids neither open nor finished open a trajectory each in the worker. Read
        # without the registry's lock: a trace that opens or finishes meanwhile only makes
        # this count one too many (room reserved and not used until the request is done)
        opens = sum(1 for tid in traces
                    if registry.lookup(tid) is None and not registry.was_finished(tid))
        dropped_trajs = 0
        with self._lock:
            over = self._over(spans, opens, nbytes) if spans else None
            if over is not None:
                if not self._never_fits(spans, opens, nbytes) or not self._half_empty():
                    raise self._push_back(over, spans)
                # larger than the whole table, and room for at least half of it now: its
                # first trajectories that fit are taken, the others refused whole
                spans, opens, nbytes, dropped_trajs, capacity = self._fit(request, sizes, traces)
                refused["capacity"] = capacity
            if spans:
                self._tickets.append(Ticket(request, sizes, spans, opens, nbytes))
                self.queued += spans
                self.reserved_open += opens
                self.reserved_bytes += nbytes
        if dropped_trajs:
            _stats.incr("trajectories_dropped_open_limit", dropped_trajs)
            _stats.warn_once("collector-capacity", "rtrace collector: a request held more than the collector can "
                             "hold at once; the trajectories beyond it were refused (the sender is told)")
        return _answer(refused)

    def _check(self, request: Any) -> tuple[list[int], dict[int, None], Counter, int]:
        """Every span's size (-1: refused), the trace ids of the others (in order), the
        refusals by reason, and the bytes taken."""
        sizes: list[int] = []
        traces: dict[int, None] = {}
        refused: Counter = Counter()
        nbytes = 0
        max_bytes, max_attrs = self.max_span_bytes, self.max_attributes
        last = None
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    why = _refusal(span)
                    if why is None:
                        size = span.ByteSize()
                        if size > max_bytes:
                            why = "size"
                        elif len(span.attributes) > max_attrs:
                            why = "attributes"
                    if why is not None:
                        refused[why] += 1
                        sizes.append(-1)
                        continue
                    sizes.append(size)
                    nbytes += size
                    trace_id = span.trace_id
                    if trace_id != last and span.name != ANNOTATION_SPAN:  # an annotation opens nothing
                        last = trace_id  # a worker sends a trace's spans together
                        traces[int.from_bytes(trace_id, "big")] = None
        return sizes, traces, refused, nbytes

    def _over(self, spans: int, opens: int, nbytes: int) -> str | None:
        """Under the lock: which limit taking this would pass, if any."""
        registry = self.registry
        if self.queued + spans > self.max_queue:
            return f"queue full ({self.max_queue} spans)"
        if len(registry) + self.reserved_open + opens > registry.max_open:
            return (f"{len(registry)} open trajectories and {self.reserved_open} on their way "
                    f"(max_open_trajectories={registry.max_open})")
        if registry.held_bytes + self.reserved_bytes + nbytes > self.max_held_bytes:
            return (f"{registry.held_bytes + self.reserved_bytes} bytes held or on their way "
                    f"(RTRACE_COLLECTOR_MAX_HELD_BYTES={self.max_held_bytes})")
        return None

    def _never_fits(self, spans: int, opens: int, nbytes: int) -> bool:
        return spans > self.max_queue or opens > self.registry.max_open or nbytes > self.max_held_bytes

    def _half_empty(self) -> bool:
        registry = self.registry
        return (2 * self.queued <= self.max_queue and 2 * (len(registry) + self.reserved_open) <= registry.max_open
                and 2 * (registry.held_bytes + self.reserved_bytes) <= self.max_held_bytes)

    def _push_back(self, over: str, spans: int) -> Backpressure:
        _stats.incr("collector_backpressure_spans", spans)
        if not over.startswith("queue"):
            self._on_pressure()  # the worker evicts what waits for its root (least recently active first)
        return Backpressure(f"rtrace collector: {over}; retry", retry_after_s=RETRY_AFTER_S)

    def _fit(self, request: Any, sizes: list[int], traces: dict[int, None]) -> tuple[int, int, int, int, int]:
        """Under the lock, for a request larger than the whole table: keep its first
        trajectories (in order of their first span) whose spans, new trajectories and
        bytes fit the room left; mark the others' spans refused (``sizes`` -1). Returns
        what is taken (spans, new trajectories, bytes), the trajectories refused and
        their spans."""
        registry = self.registry
        per_trace: dict[int, list[int]] = {}  # spans, bytes (annotations: opening nothing, by their trace)
        k = 0
        for span in _spans(request):
            if sizes[k] >= 0:
                entry = per_trace.setdefault(int.from_bytes(span.trace_id, "big"), [0, 0])
                entry[0] += 1
                entry[1] += sizes[k]
            k += 1
        room_spans = self.max_queue - self.queued
        room_open = registry.max_open - len(registry) - self.reserved_open
        room_bytes = self.max_held_bytes - registry.held_bytes - self.reserved_bytes
        spans = opens = nbytes = 0
        refused_traces: set[int] = set()
        for tid, (n, b) in per_trace.items():
            new = tid in traces and registry.lookup(tid) is None and not registry.was_finished(tid)
            if not refused_traces and spans + n <= room_spans and opens + new <= room_open and nbytes + b <= room_bytes:
                spans, opens, nbytes = spans + n, opens + new, nbytes + b
            else:
                refused_traces.add(tid)
        capacity = 0
        k = 0
        for span in _spans(request):
            if sizes[k] >= 0 and int.from_bytes(span.trace_id, "big") in refused_traces:
                sizes[k] = -1
                capacity += 1
            k += 1
        return spans, opens, nbytes, len(refused_traces), capacity

    # ------------------------------------------------------------------ worker thread
    def take(self) -> list[Ticket]:
        """The requests queued now, oldest first (they stay reserved until :meth:`done`)."""
        out = []
        tickets = self._tickets
        for _ in range(len(tickets)):
            out.append(tickets.popleft())
        return out

    def done(self, ticket: Ticket) -> None:
        """``ticket``'s spans are in the table: what it reserved is free."""
        with self._lock:
            self.queued -= ticket.spans
            self.reserved_open -= ticket.opens
            self.reserved_bytes -= ticket.nbytes
        ticket.request = None


def _spans(request: Any) -> Any:
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            yield from scope_spans.spans


def _refusal(span: Any) -> str | None:
    """OTLP's id rules: a 16-byte trace id and an 8-byte span id, neither all zero; a
    parent id empty (a root) or 8 bytes, not all zero. The reason, or None."""
    trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(trace_id) != 16 or trace_id == _ZERO_TRACE:
        return "trace_id"
    if len(span_id) != 8 or span_id == _ZERO_SPAN:
        return "span_id"
    if parent and (len(parent) != 8 or parent == _ZERO_SPAN):
        return "parent_span_id"
    return None


def _answer(refused: Counter) -> PartialSuccess | None:
    """Count the refusals; the sender's partial success (None: nothing refused)."""
    total = sum(refused.values())
    if not total:
        return None
    _stats.incr("collector_spans_refused", total)
    for why, n in refused.items():
        if n:
            _stats.incr(f"collector_refused.{why}", n)
    detail = "; ".join(f"{n} {REFUSED[why]} ({why})" for why, n in sorted(refused.items()) if n)
    return PartialSuccess(total, f"rtrace collector refused {total} span(s): {detail}")
