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
    import grpc

    export = grpc.insecure_channel(endpoint).unary_unary(EXPORT)
    ready.set()
    go.wait()
    retries = 0
    c0 = time.process_time()
    for body in requests:
        while True:
            try:
                export(body, timeout=60)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                retries += 1
                time.sleep(0.05)
    return retries, time.process_time() - c0
