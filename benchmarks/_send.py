"""What the collector benchmarks' sender processes share: sending pre-encoded OTLP requests."""

from __future__ import annotations

import time

#: the collector's OTLP/gRPC export method
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def send_requests(endpoint: str, requests: list[bytes], ready, go) -> tuple[int, float]:
    """Sends ``requests`` (encoded OTLP bodies, as they are: no re-encoding, so the senders
    cost the shared cores as little as possible) once ``go`` is set, retrying on
    RESOURCE_EXHAUSTED (the collector's push-back) as rtrace's workers do. Returns the
    retries and the CPU seconds the sending took."""
    return send_routed([(endpoint, body) for body in requests], ready, go)


def send_routed(requests: list[tuple[str, bytes]], ready, go) -> tuple[int, float]:
    """:func:`send_requests` for requests to several collectors: ``(endpoint, body)`` pairs,
    sent in their order (each collector's own rollouts, as placement routes them)."""
    import grpc

    exports = {endpoint: grpc.insecure_channel(endpoint).unary_unary(EXPORT) for endpoint in {e for e, _ in requests}}
    ready.set()
    go.wait()
    retries = 0
    c0 = time.process_time()
    for endpoint, body in requests:
        while True:
            try:
                exports[endpoint](body, timeout=60)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                retries += 1
                time.sleep(0.05)
    return retries, time.process_time() - c0
