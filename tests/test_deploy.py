"""The deployment files, parsed with PyYAML (there is no container engine here): docker-compose.yml
with its rtrace collector services and profiles, deploy/Dockerfile.collector, and the scale-out
OpenTelemetry Collector config deploy/otel-collector-loadbalancing.yaml."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rtrace.config import ConfigError, load_settings
from rtrace.exporters.collector import route_of
from rtrace.exporters.otel import encode_compact
from rtrace.placement import POSITIONS, ROUTE_ATTR, Ring, route_key
from rtrace.trajectory import SpanRecord, Trajectory

ROOT = Path(__file__).resolve().parents[1]
LB_CONFIG = ROOT / "deploy" / "otel-collector-loadbalancing.yaml"
LB_TYPES = {"load_balancing", "loadbalancing"}
DEFAULT_SERVICES = {"otel-collector", "jaeger", "mlflow"}


def _yaml(path):
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def services():
    return _yaml(ROOT / "docker-compose.yml")["services"]


@pytest.fixture(scope="module")
def lb():
    return _yaml(LB_CONFIG)


def _command(svc) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _rtrace_collectors(services) -> dict[str, dict]:
    return {name: svc for name, svc in services.items() if _command(svc)[:2] == ["rtrace", "collect"]}


def _type(component_id: str) -> str:
    """`otlp/jaeger` -> `otlp` (the collector's type[/name] component ids)."""
    return component_id.split("/")[0]


# ----------------------------------------------------------------------------- compose
def test_published_ports_are_loopback_only_and_distinct(services):
    """Every published port of every service (all profiles) is 127.0.0.1:HOST:CONTAINER, no host port twice."""
    host_ports = []
    for name, svc in services.items():
        for port in svc.get("ports", []):
            m = re.fullmatch(r"127\.0\.0\.1:(\d+):(\d+)", str(port))
            assert m, (name, port)
            host_ports.append(int(m.group(1)))
    assert len(host_ports) == len(set(host_ports)), sorted(host_ports)


def test_rtrace_collector_service(services):
    """rtrace-collector runs `rtrace collect --exporter jsonl,mlflow,parquet --host 0.0.0.0 --port 4317`, built
    from deploy/Dockerfile.collector, healthy when its port answers, writing to a volume and to the mlflow service."""
    svc = services["rtrace-collector"]
    assert _command(svc) == ["rtrace", "collect", "--exporter", "jsonl,mlflow,parquet", "--host", "0.0.0.0",
                             "--port", "4317"]
    build = svc["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == ROOT / "deploy" / "Dockerfile.collector"
    assert "4317" in " ".join(svc["healthcheck"]["test"])
    assert "127.0.0.1:4327:4317" in svc["ports"]
    env = svc["environment"]
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000" and env["RTRACE_JSONL_PATH"].startswith("/data/")
    assert svc["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert any(str(v).endswith(":/data") for v in svc["volumes"])


def test_every_rtrace_collector_is_complete_and_writes_its_own_file(services):
    """Each rtrace collector (shards included) has the same command and image, a health check, and its own JSONL path."""
    collectors = _rtrace_collectors(services)
    assert len(collectors) >= 2
    paths = [svc["environment"]["RTRACE_JSONL_PATH"] for svc in collectors.values()]
    assert len(set(paths)) == len(paths)
    for name, svc in collectors.items():
        assert _command(svc) == _command(services["rtrace-collector"]), name
        assert svc["image"] == services["rtrace-collector"]["image"] and svc["healthcheck"]["test"], name


def test_scale_out_shards_write_one_dataset(services):
    """Every rtrace collector writes the parquet exporter's dataset to the same RTRACE_PARQUET_PATH on the
    same volume (one run's dataset, written by all shards), and the path is a valid setting."""
    collectors = _rtrace_collectors(services)
    paths = {svc["environment"]["RTRACE_PARQUET_PATH"] for svc in collectors.values()}
    assert paths == {"/data/dataset"}
    for name, svc in collectors.items():
        assert "parquet" in _option(_command(svc), "--exporter").split(","), name
        assert any(str(v) == "rtrace-data:/data" for v in svc["volumes"]), name
    assert load_settings({"parquet_path": "/tmp/rtrace-deploy-check"}).parquet_path == "/tmp/rtrace-deploy-check"


def test_profiles_keep_the_default_stack_and_close_over_dependencies(services):
    """`docker compose up` starts the three original services as before; every service a profile starts
    depends only on services started by the same profile (or by default)."""
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == DEFAULT_SERVICES
    profiles = {p for svc in services.values() for p in svc.get("profiles", [])}
    assert {"rtrace", "scale-out"} <= profiles
    for profile in profiles:
        active = default | {name for name, svc in services.items() if profile in svc.get("profiles", [])}
        for name in active:
            assert set(services[name].get("depends_on") or {}) <= active, (profile, name)


def test_dockerfile_installs_the_package_and_runs_the_collector():
    """The Dockerfile copies only paths that exist in the build context, installs rtrace[all] from it,
    and its default command is the one compose runs."""
    text = (ROOT / "deploy" / "Dockerfile.collector").read_text()
    for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), source
    assert re.search(r'pip install .*"\.\[all\]"', text)
    [cmd] = re.findall(r"^CMD\s+(\[.*\])$", text, flags=re.M)
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(cmd)[:2] == ["rtrace", "collect"]


# ----------------------------------------------------------------------------- scale-out config
def _lb_exporter(lb) -> dict:
    """The load-balancing exporter (`load_balancing`, called `loadbalancing` before otelcol-contrib
    renamed it)."""
    [lb_id] = [k for k in lb["exporters"] if _type(k) in LB_TYPES]
    return lb["exporters"][lb_id]


def test_loadbalancing_routes_by_rtrace_route_to_rtrace_collectors(services, lb):
    """The load-balancing exporter routes by the one attribute rtrace sends its key in
    (routing_key: attributes, routing_attributes: [rtrace.route]) to >= 2 backends, each an rtrace
    collector compose service at the port its `rtrace collect --port` listens on, over OTLP/gRPC."""
    exporter = _lb_exporter(lb)
    assert exporter["routing_key"] == "attributes"
    assert exporter["routing_attributes"] == [ROUTE_ATTR]
    otlp = exporter["protocol"]["otlp"]
    assert "endpoint" not in otlp and otlp["tls"]["insecure"] is True
    hostnames = exporter["resolver"]["static"]["hostnames"]
    assert len(hostnames) == len(set(hostnames)) >= 2
    collectors = _rtrace_collectors(services)
    for entry in hostnames:
        host, port = entry.rsplit(":", 1)
        assert host in collectors, entry
        assert _option(_command(collectors[host]), "--port") == port, entry
    # and every rtrace collector started with the scale-out profile is a backend
    scale_out = {n for n, s in collectors.items() if "scale-out" in s.get("profiles", [])}
    assert scale_out == {h.rsplit(":", 1)[0] for h in hostnames}


def test_pipeline_wiring_references_defined_components(lb):
    """Every pipeline names defined receivers, processors and exporters; nothing is defined and unused;
    the traces pipeline fans out to the rtrace collectors and to Jaeger."""
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in lb["service"]["pipelines"].items():
        for kind in used:
            names = pipeline.get(kind, [])
            assert set(names) <= set(lb.get(kind) or {}), (name, kind, names)
            used[kind] |= set(names)
    for kind, names in used.items():
        assert names == set(lb.get(kind) or {}), kind
    assert set(lb["service"]["extensions"]) == set(lb["extensions"])
    traces = lb["service"]["pipelines"]["traces"]
    assert traces["processors"][0] == "memory_limiter"  # first, as the collector docs require
    exporter_types = {_type(e): e for e in traces["exporters"]}
    assert set(exporter_types) & LB_TYPES
    jaeger = [e for e in traces["exporters"] if _type(e) == "otlp"]
    assert [lb["exporters"][e]["endpoint"] for e in jaeger] == ["jaeger:4317"]
    assert not {_type(k) for k in lb["exporters"]} & {"jaeger", "logging"}  # removed exporters


def test_lb_service_mounts_the_config_and_publishes_its_receivers(services, lb):
    """otel-collector-lb loads deploy/otel-collector-loadbalancing.yaml, its receivers bind 0.0.0.0 inside
    the container on the ports compose publishes (on 127.0.0.1), and it starts after its backends."""
    svc = services["otel-collector-lb"]
    config_path = _command(svc)[0].split("=", 1)[1]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in svc["volumes"]}
    assert (ROOT / mounts[config_path]).resolve() == LB_CONFIG
    protocols = lb["receivers"]["otlp"]["protocols"]
    bound = {p["endpoint"] for p in protocols.values()}
    assert bound == {"0.0.0.0:4317", "0.0.0.0:4318"}
    published = {str(p).rsplit(":", 1)[1] for p in svc["ports"]}
    assert {"4317", "4318", lb["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]} <= published
    hosts = {h.rsplit(":", 1)[0] for h in _lb_exporter(lb)["resolver"]["static"]["hostnames"]}
    assert hosts | {"jaeger"} <= set(svc["depends_on"])


def test_one_token_guards_every_hop(services, lb):
    """Every rtrace collector service and otel-collector-lb take the same RTRACE_COLLECTOR_TOKEN
    from the shell (empty when unset: an rtrace collector then refuses to start, while the
    default stack needs none); the lb checks it on both receivers (bearertokenauth) and
    sends it on to the rtrace collectors."""
    required = "${RTRACE_COLLECTOR_TOKEN:-}"
    for name, svc in _rtrace_collectors(services).items():
        assert svc["environment"]["RTRACE_COLLECTOR_TOKEN"] == required, name
    assert services["otel-collector-lb"]["environment"]["RTRACE_COLLECTOR_TOKEN"] == required
    with pytest.raises(ConfigError, match="RTRACE_COLLECTOR_TOKEN: empty value"):
        load_settings({}, environ={"RTRACE_COLLECTOR_TOKEN": ""})
    assert lb["extensions"]["bearertokenauth"]["token"] == "${env:RTRACE_COLLECTOR_TOKEN}"
    for protocol in lb["receivers"]["otlp"]["protocols"].values():
        assert protocol["auth"]["authenticator"] == "bearertokenauth"
    headers = _lb_exporter(lb)["protocol"]["otlp"]["headers"]
    assert headers == {"authorization": "Bearer ${env:RTRACE_COLLECTOR_TOKEN}"}


# ----------------------------------------------------------------------------- placement agrees
#: keys -> their owner among the compose collectors, computed by hand from the exporter's
#: algorithm (crc32 of "rtrace.route=<key>|" mod 36,000; the first of the 100 points per
#: hostname at or after it; tests/test_placement.py says how), written down as literals
OWNERS = [
    ("run-7|0|3|17", "rtrace-collector-2:4317"),
    ("run-7|0|3|18", "rtrace-collector:4317"),
    ("run-7|1|3|17", "rtrace-collector-2:4317"),
    ("|0|0|0", "rtrace-collector-2:4317"),
    ("|0|0|1", "rtrace-collector:4317"),
    ("|0|0|2", "rtrace-collector-2:4317"),
    ("gsm8k|0|12|4095", "rtrace-collector-2:4317"),
    ("0af7651916cd43dd8448eb211c80319c", "rtrace-collector:4317"),  # no coordinates: the trace id
]


def test_the_config_and_the_workers_place_a_table_of_keys_alike(lb):
    """The config's backend list gives each key the owner computed by hand, and so does the ring
    a worker builds from the same list given as RTRACE_COLLECTOR_ENDPOINT, in either order."""
    hostnames = _lb_exporter(lb)["resolver"]["static"]["hostnames"]
    assert sorted(hostnames) == sorted({owner for _, owner in OWNERS})
    for endpoints in (hostnames, list(reversed(hostnames))):
        settings = load_settings({"exporter": "collector", "collector_endpoint": ",".join(endpoints)})
        ring = Ring(settings.collector_endpoint.split(","))
        assert [(key, ring.owner(key)) for key, _ in OWNERS] == OWNERS


def _exporter_routing_ids(request, routing_attributes) -> list[str]:
    """routingIdentifiersFromTraces of trace_exporter.go for one trace's request (attribute
    routing): per resource, ``name=value|`` for each routing attribute, from the resource, else the
    first scope's attributes, else the first span's, else ``name=|``."""
    ids = []
    for rs in request.resource_spans:
        key = ""
        for name in routing_attributes:
            resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
            scope = {kv.key: kv.value.string_value for kv in request.resource_spans[0].scope_spans[0].scope.attributes}
            span = {kv.key: kv.value.string_value
                    for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes}
            value = resource.get(name, scope.get(name, span.get(name)))
            key += f"{name}={'' if value is None else value}|"
        ids.append(key)
    return ids


def test_the_exporter_routes_rtrace_requests_to_the_owner_rtrace_picks(lb):
    """What the worker sends, as the exporter reads it: rtrace's encoding of a batch of segments (a
    rollout's root, a later segment of it without the coordinates stamp, an annotation, a span with
    no coordinates), split per trace as the exporter does (SplitTraces), hashed from the configured
    routing attribute: each goes to the collector the worker's own ring picks for it."""
    import zlib

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    exporter = _lb_exporter(lb)
    hostnames = exporter["resolver"]["static"]["hostnames"]
    ring = Ring(hostnames)

    def segment(trace, span, **rl):
        attrs = {f"rl.{k}": v for k, v in rl.items()}
        return Trajectory(f"{trace:032x}", "rollout", [SpanRecord(f"{span:016x}", None, "rollout", "rollout", 1, 2,
                                                                  attributes=attrs)])

    batch = [segment(1, 1, experiment="run-7", validate=False, step=3, sample_index=17, rollout_n=0),
             segment(2, 2, experiment="run-7", validate=False, step=3, sample_index=18, rollout_n=1),
             segment(3, 3, validate=True, step=3, sample_index=17),  # an annotation: no rl.experiment on it
             segment(4, 4)]                                          # no coordinates
    routes = [route_of(t, "run-7") for t in batch]
    assert routes == ["run-7|0|3|17", "run-7|0|3|18", "run-7|1|3|17", f"{4:032x}"]
    order = sorted(range(len(batch)), key=lambda i: routes[i])  # the sink groups a request by key
    request = encode_compact([batch[i] for i in order], {"service.name": "w"}, 100, [routes[i] for i in order])
    for i in order:  # SplitTraces: one trace at a time, its resource copied
        one = ExportTraceServiceRequest()
        for rs in request.resource_spans:
            spans = [s for ss in rs.scope_spans for s in ss.spans if s.trace_id == bytes.fromhex(batch[i].trace_id)]
            if spans:
                new = one.resource_spans.add()
                new.resource.CopyFrom(rs.resource)
                new.scope_spans.add().spans.extend(spans)
        [rid] = _exporter_routing_ids(one, exporter["routing_attributes"])
        assert rid == f"{ROUTE_ATTR}={routes[i]}|"
        position = (zlib.crc32(rid.encode()) & 0xFFFFFFFF) % POSITIONS
        points = ring.points
        exporter_owner = next((e for p, e in points if p >= position), points[0][1])  # findEndpoint, by scan
        assert exporter_owner == ring.owner(routes[i]) == Ring(list(reversed(hostnames))).owner(routes[i])
    assert route_key("run-7", True, 3, 17) == routes[2]
