"""Placement (rtrace/placement.py): the OpenTelemetry Collector loadbalancing exporter's ring,
reimplemented, and the key rtrace routes a rollout by.

The expected values come from the Go code and its own tests (opentelemetry-collector-contrib,
exporter/loadbalancingexporter), not from rtrace's implementation:

* ``consistent_hashing_test.go`` ``TestPositionsForEndpoints``: the ring points of
  ``endpoint-1`` / ``endpoint-2`` at 5 points each ("first calculated by running the
  algorithm"); ``TestEndpointFor``: four identifiers and their endpoint on the 100-point ring of
  the same two; ``TestBinarySearch``: a ring of 11 positions and the point each lookup finds.
* ``bsearch`` in ``consistent_hashing.go`` (the "binary search-like" lookup with its
  wrap-around), transcribed below line by line and compared at every one of the 36,000
  positions with rtrace's ``bisect``.
* The table of rtrace keys: positions computed by hand from the algorithm's description
  (crc32 IEEE of ``rtrace.route=<key>|`` mod 36,000; ``attribute_routing.go`` writes an
  attribute as ``name=value|``), owners by a linear scan (the first point at or after the
  position, else the first point), written down here as literals.
"""

from __future__ import annotations

import random
import zlib

import pytest

from rtrace.placement import POSITIONS, Ring, endpoint_name, owner_at, route_key, routing_id

COLLECTORS = ["rtrace-collector:4317", "rtrace-collector-2:4317", "rtrace-collector-3:4317"]


class TestTheGoRing:
    def test_positions_for_endpoints_match_the_go_tests(self):
        """consistent_hashing_test.go TestPositionsForEndpoints, 5 points per endpoint: one endpoint,
        the same endpoint twice (no duplicates), two endpoints interleaved."""
        one = [(1401, "endpoint-1"), (4175, "endpoint-1"), (14133, "endpoint-1"), (17836, "endpoint-1"),
               (21667, "endpoint-1")]
        assert Ring(["endpoint-1"], points=5).points == one
        assert Ring(["endpoint-1", "endpoint-1"], points=5).points == one
        assert Ring(["endpoint-1", "endpoint-2"], points=5).points == [
            (1401, "endpoint-1"), (4175, "endpoint-1"), (10240, "endpoint-2"), (14133, "endpoint-1"),
            (15002, "endpoint-2"), (17836, "endpoint-1"), (21263, "endpoint-2"), (21667, "endpoint-1"),
            (26806, "endpoint-2"), (27020, "endpoint-2")]

    @pytest.mark.parametrize("identifier, expected", [
        (bytes([1, 2, 0, 0]), "endpoint-1"),       # TestEndpointFor: the endpoints alternate
        (bytes([128, 128, 0, 0]), "endpoint-2"),
        (b"ad-service-7", "endpoint-1"),
        (b"get-recommendations-1", "endpoint-2"),
    ])
    def test_endpoint_for_matches_the_go_tests(self, identifier, expected):
        ring = Ring(["endpoint-1", "endpoint-2"])
        assert len(ring.points) == 200  # TestNewHashRing: 2 * defaultWeight
        assert owner_at(ring.points, (zlib.crc32(identifier) & 0xFFFFFFFF) % POSITIONS) == expected

    @pytest.mark.parametrize("requested, expected", [
        (85, 121),   # between two points: the next one
        (14, 14),    # on a point: that point
        (351, 14),   # past the last point: the first (wrap-around)
        (270, 270),
        (271, 350),
    ])
    def test_binary_search_matches_the_go_tests(self, requested, expected):
        items = [14, 25, 33, 47, 56, 121, 134, 158, 240, 270, 350]
        ring = [(p, str(p)) for p in items]
        assert owner_at(ring, requested) == str(expected)

    def test_bisect_is_the_go_bsearch_at_every_position(self):
        """rtrace's lookup (bisect) finds what Go's bsearch finds, at all 36,000 positions of a
        ring of the three compose collectors."""
        ring = Ring(COLLECTORS).points
        left, right = ring[:len(ring) // 2], ring[len(ring) // 2:]
        assert all(go_bsearch(pos, left, right)[1] == owner_at(ring, pos) for pos in range(POSITIONS))

    def test_listed_order_does_not_matter(self):
        """resolver_static.go sorts the hostnames (sort.Strings): the ring is the same whatever the
        order they are listed in, although a position two endpoints hash to goes to the first."""
        assert Ring(COLLECTORS).points == Ring(list(reversed(COLLECTORS))).points
        assert Ring(COLLECTORS).endpoints == tuple(sorted(COLLECTORS))


def go_bsearch(pos, left, right):
    """bsearch of consistent_hashing.go, line by line (items are (pos, endpoint))."""
    if left[-1][0] == pos:  # the last item of the left side
        return left[-1]
    if right[0][0] == pos:  # the first item of the right side
        return right[0]
    if pos > right[-1][0]:  # higher than the highest angle: the first is the right one
        return left[0]
    if pos > left[-1][0]:  # higher than the highest on the left: on the right side
        if len(right) == 1:
            return right[0]
        return go_bsearch(pos, right[:len(right) // 2], right[len(right) // 2:])
    if len(left) == 1:  # not on the right side: on the left side
        return left[0]
    return go_bsearch(pos, left[:len(left) // 2], left[len(left) // 2:])


class TestRtraceKeys:
    @pytest.mark.parametrize("key, position, owner", [
        # key (route_key's form)          crc32("rtrace.route=<key>|") % 36000, its owner among COLLECTORS
        ("run-7|0|3|17", 24884, "rtrace-collector-2:4317"),
        ("run-7|0|3|18", 15579, "rtrace-collector:4317"),      # the next prompt: elsewhere
        ("run-7|1|3|17", 17184, "rtrace-collector-3:4317"),    # its validation twin: elsewhere
        ("|0|0|0", 17537, "rtrace-collector-2:4317"),          # no experiment set
        ("|0|1|0", 33252, "rtrace-collector-2:4317"),
        ("run-7|0|100000|99999", 32281, "rtrace-collector-2:4317"),
        ("gsm8k|0|12|4095", 11247, "rtrace-collector-2:4317"),
        ("0af7651916cd43dd8448eb211c80319c", 25645, "rtrace-collector:4317"),  # a trace id: no coordinates
    ])
    def test_owner_table(self, key, position, owner):
        assert routing_id(key) == f"rtrace.route={key}|".encode()
        assert (zlib.crc32(routing_id(key)) & 0xFFFFFFFF) % POSITIONS == position
        assert Ring(COLLECTORS).owner(key) == owner

    @pytest.mark.parametrize("args, key", [
        (("run-7", False, 3, 17), "run-7|0|3|17"),
        (("run-7", True, 3, 17), "run-7|1|3|17"),
        ((None, 0, 3.0, 17.0), "|0|3|17"),          # integral floats as ints; no run: ""
        (("r", 1, "warmup", "p-3"), "r|1|warmup|p-3"),  # other values as str()
        (("r", False, None, 17, "ab" * 16), "ab" * 16),  # no step: the trace id
        (("r", False, 3, None, "cd" * 16), "cd" * 16),   # no sample index: the trace id
    ])
    def test_route_key(self, args, key):
        assert route_key(*args) == key

    def test_a_route_key_needs_coordinates_or_a_trace_id(self):
        with pytest.raises(ValueError, match="no step and sample_index"):
            route_key("r", False, None, None)

    @pytest.mark.parametrize("entry, name", [
        ("host1:4317", "host1:4317"), ("http://host1:4317", "host1:4317"), ("https://host1:4317/", "host1:4317"),
        (" host1:4317 ", "host1:4317"),
    ])
    def test_endpoint_names(self, entry, name):
        assert endpoint_name(entry) == name


class TestMoves:
    """Adding or removing one of N endpoints moves about 1/N of the keys, and only those: keys
    move to the new endpoint, or away from the removed one, never between the others."""

    KEYS = [route_key("run-7", i % 7 == 0, i // 1000, i % 1000) for i in range(100_000)]

    @pytest.mark.parametrize("n", [2, 4, 8])
    def test_adding_an_endpoint(self, n):
        before = Ring([f"collector-{i}:4317" for i in range(n)])
        after = Ring([f"collector-{i}:4317" for i in range(n + 1)])
        new = f"collector-{n}:4317"
        moved = 0
        for key in self.KEYS:
            a, b = before.owner(key), after.owner(key)
            if a != b:
                assert b == new, (key, a, b)
                moved += 1
        fraction = moved / len(self.KEYS)
        print(f"\n{n} -> {n + 1} endpoints: {fraction:.3f} of 100,000 keys moved (1/{n + 1} = {1 / (n + 1):.3f})")
        assert 0.5 / (n + 1) < fraction < 2.0 / (n + 1)

    @pytest.mark.parametrize("n", [3, 5])
    def test_removing_an_endpoint(self, n):
        before = Ring([f"collector-{i}:4317" for i in range(n)])
        gone = f"collector-{n // 2}:4317"
        after = Ring([f"collector-{i}:4317" for i in range(n) if f"collector-{i}:4317" != gone])
        moved = [key for key in self.KEYS if before.owner(key) != after.owner(key)]
        assert all(before.owner(key) == gone for key in moved)
        assert sum(1 for key in self.KEYS if before.owner(key) == gone) == len(moved)
        fraction = len(moved) / len(self.KEYS)
        print(f"\n{n} -> {n - 1} endpoints: {fraction:.3f} of 100,000 keys moved (1/{n} = {1 / n:.3f})")
        assert 0.5 / n < fraction < 2.0 / n

    def test_the_load_is_spread(self):
        """Each of 4 endpoints owns between half and twice its share of the keys."""
        ring = Ring([f"collector-{i}:4317" for i in range(4)])
        counts: dict[str, int] = {}
        for key in random.Random(1).sample(self.KEYS, 20_000):
            owner = ring.owner(key)
            counts[owner] = counts.get(owner, 0) + 1
        assert len(counts) == 4 and all(2_500 < c < 10_000 for c in counts.values()), counts


class TestTheEndpointList:
    """RTRACE_COLLECTOR_ENDPOINT: one endpoint as before, or a comma list, each entry checked."""

    def test_one_endpoint_is_kept_as_it_was(self):
        from rtrace.config import load_settings

        s = load_settings({}, environ={"RTRACE_EXPORTER": "collector", "RTRACE_COLLECTOR_ENDPOINT": "127.0.0.1:4317"})
        assert s.collector_endpoint == "127.0.0.1:4317"

    def test_a_list_is_kept_in_order(self):
        from rtrace.config import load_settings

        s = load_settings({}, environ={"RTRACE_EXPORTER": "collector",
                                       "RTRACE_COLLECTOR_ENDPOINT": "h2:4317, https://h1:4317 ,h3:4318"})
        assert s.collector_endpoint == "h2:4317,https://h1:4317,h3:4318"
        assert Ring(s.collector_endpoint.split(",")).endpoints == ("h1:4317", "h2:4317", "h3:4318")

    @pytest.mark.parametrize("value, why", [
        ("h1:4317,h2", "entry 'h2': 'h2' has no port"),
        ("h1:4317,,h2:4317", "has an empty entry"),
        ("h1:4317,https://h1:4317", "'h1:4317' is listed twice"),
        ("h1:4317,ftp://h2:21", "entry 'ftp://h2:21'"),
    ])
    def test_a_bad_entry_is_named(self, value, why):
        from rtrace.config import ConfigError, load_settings

        with pytest.raises(ConfigError, match="RTRACE_COLLECTOR_ENDPOINT") as err:
            load_settings({}, environ={"RTRACE_EXPORTER": "collector", "RTRACE_COLLECTOR_ENDPOINT": value})
        assert why in str(err.value)
