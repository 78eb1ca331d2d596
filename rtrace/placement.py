"""Placement: which of N rtrace collectors owns a rollout, as a pure function of its key.

Workers, the trainer's ``annotate`` / ``annotate_batch`` and an OpenTelemetry Collector's
``loadbalancing`` exporter in front of the collectors must send each rollout to the same
collector: its spans, its summary and the trainer's annotations meet there. They agree
because they compute the same thing from the same two inputs:

* **The key** (:func:`route_key`): ``run|validate|step|sample_index`` — the run is the
  experiment name (``RTRACE_EXPERIMENT``; ``""`` when unset), ``validate`` is ``0`` or
  ``1``. Not ``group_id``: the trainer addresses a rollout by (validate, step,
  sample_index, rollout_n) and does not know group ids, while every rtrace adapter and the
  documented convention give a GRPO group's members one ``sample_index`` (``rollout_n``
  numbers the members). So routing by ``sample_index`` keeps groups whole *and* lets
  annotations route without group ids. A span or segment without a step or a sample index
  routes by its trace id (32 hex digits) instead. The job-wide sample stays exact even if a
  group were split (``priority()`` ranks by group in every collector); only in-group tail
  rules need whole groups.
* **The ring** (:class:`Ring`): the consistent-hash ring of the OpenTelemetry Collector's
  ``loadbalancing`` exporter, reimplemented exactly (opentelemetry-collector-contrib,
  ``exporter/loadbalancingexporter``):

  - ``consistent_hashing.go`` ``positionsFor``: each endpoint gets 100 points
    (``defaultWeight``); point ``i`` is ``crc32_ieee(endpoint bytes + one byte i) % 36000``
    (``maxPositions``: 360 degrees, two decimals). ``positionsForEndpoints``: endpoints in
    order, a position already taken is skipped (the first endpoint keeps it), then the
    points are sorted. The endpoints come sorted: ``resolver_static.go`` sorts the
    configured hostnames (``sort.Strings``), so the order they are listed in never matters.
  - ``endpointFor`` / ``findEndpoint`` / ``bsearch``: a key's position is
    ``crc32_ieee(key bytes) % 36000``; its owner is the first point at or after it, the
    ring's first point past the last (wrap-around). :func:`owner_at` is that search
    (``bisect``; ``tests/test_placement.py`` checks it against a transcription of
    ``bsearch`` at all 36,000 positions).
  - ``trace_exporter.go`` ``routingIdentifiersFromTraces`` with ``routing_key:
    attributes``: the string hashed is, for each attribute in ``routing_attributes``,
    ``name=value|`` (``attribute_routing.go``; a missing one is ``name=|``), the value read
    from the resource first, then the scope, then the trace's first span. rtrace sends one
    attribute, :data:`ROUTE_ATTR`, on each request's resource (one resource per key), so
    the exporter hashes ``rtrace.route=<key>|``: :func:`routing_id`. rtrace hashes that same
    string, so the same endpoint list and the same key give the same collector whether the
    worker routes itself (``RTRACE_COLLECTOR_ENDPOINT=host1:4317,host2:4317``) or an
    OpenTelemetry Collector routes for it (deploy/otel-collector-loadbalancing.yaml).

Adding or removing one of N endpoints moves about 1/N of the keys (the moved arcs of the
ring; ``tests/test_placement.py`` measures it). Nothing here has state: a ring is built once
from the endpoint list and only read.
"""

from __future__ import annotations

import bisect
import zlib
from typing import Any, Sequence
from urllib.parse import urlsplit

__all__ = ["ROUTE_ATTR", "POSITIONS", "POINTS", "Ring", "route_key", "routing_id", "positions", "owner_at",
           "endpoint_name"]

#: The one attribute an OpenTelemetry Collector's loadbalancing exporter routes rtrace's
#: spans by (``routing_key: attributes``, ``routing_attributes: [rtrace.route]``).
ROUTE_ATTR = "rtrace.route"
#: Positions on the ring (``maxPositions`` in consistent_hashing.go).
POSITIONS = 36_000
#: Points per endpoint (``defaultWeight`` in consistent_hashing.go).
POINTS = 100


def route_key(run: Any, validate: Any, step: Any, sample_index: Any, trace_id: str | None = None) -> str:
    """The key a rollout is placed by: ``run|validate|step|sample_index``, or ``trace_id``
    (32 hex digits) when the step or the sample index is unknown.

    ``run`` is the experiment name (None: ``""``); ``validate`` is written ``0`` / ``1``;
    an integral step or index in decimal (``3.0`` as ``3``), anything else as ``str()``.
    """
    if step is None or sample_index is None:
        if trace_id is None:
            raise ValueError("route_key: no step and sample_index, and no trace id to route by")
        return trace_id
    return f"{'' if run is None else run}|{1 if validate else 0}|{_text(step)}|{_text(sample_index)}"


def _text(value: Any) -> str:
    if type(value) is int:
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def routing_id(key: str) -> bytes:
    """The bytes the loadbalancing exporter hashes for a span whose resource carries
    ``rtrace.route=key``: ``rtrace.route=<key>|`` (attribute_routing.go)."""
    return f"{ROUTE_ATTR}={key}|".encode()


def _crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF  # Go's crc32.ChecksumIEEE: the same polynomial and result


def positions(endpoint: str, points: int = POINTS) -> list[int]:
    """An endpoint's points on the ring, in the order made (``positionsFor``): point ``i``
    hashes the endpoint's bytes followed by the byte ``i``."""
    name = endpoint.encode()
    return [_crc32(name + bytes((i & 0xFF,))) % POSITIONS for i in range(points)]


def owner_at(ring: Sequence[tuple[int, str]], position: int) -> str:
    """The endpoint of the first ring point at or after ``position``, wrapping around to the
    first point (``findEndpoint``); ``ring`` is sorted by position."""
    i = bisect.bisect_left(ring, (position, ""))
    return ring[i if i < len(ring) else 0][1]


def endpoint_name(endpoint: str) -> str:
    """An endpoint as the ring names it: ``host:port``, as an OpenTelemetry Collector's
    static resolver lists it (``https://host:4317`` and ``host:4317`` are one endpoint)."""
    value = endpoint.strip()
    if "://" not in value:
        return value
    return urlsplit(value).netloc


class Ring:
    """The ring of ``endpoints`` (built once; read only). :meth:`owner` is the placement."""

    __slots__ = ("endpoints", "_points")

    def __init__(self, endpoints: Sequence[str], points: int = POINTS) -> None:
        names = sorted({endpoint_name(e) for e in endpoints})  # resolver_static.go sorts them
        if not names:
            raise ValueError("a ring needs at least one endpoint")
        #: the endpoints as the ring names them, sorted
        self.endpoints: tuple[str, ...] = tuple(names)
        taken: dict[int, str] = {}
        for name in names:
            for pos in positions(name, points):
                taken.setdefault(pos, name)  # a taken position stays with the first endpoint
        self._points = sorted(taken.items())

    def owner(self, key: str) -> str:
        """The endpoint (as :func:`endpoint_name` names it) that owns ``key``."""
        return owner_at(self._points, _crc32(routing_id(key)) % POSITIONS)

    @property
    def points(self) -> list[tuple[int, str]]:
        """The ring's points ``(position, endpoint)``, sorted (a copy)."""
        return list(self._points)
