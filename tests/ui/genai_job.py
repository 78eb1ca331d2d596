"""The feature trajectories (tests/semconv_job.py) written to one backend with the GenAI
conventions on (``RTRACE_SEMCONV=both``), for the browser tests.

``python tests/ui/genai_job.py otlp URL [HEADER=VALUE ...]`` sends them with the OTLP sink to
``URL`` (an OTLP/HTTP traces endpoint: MLflow's or Phoenix's ``/v1/traces``);
``python tests/ui/genai_job.py mlflow TRACKING_URI PROJECT`` writes them with the MLflow
sink. Prints the trace ids (JSON) on its last line.
"""

from __future__ import annotations

import json
import sys

import rtrace
from tests import semconv_job


def main(argv: list[str]) -> dict:
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    kind = argv[0]
    common = dict(token2text=True, tokenizer=tok, experiment="ui-genai", export_interval_s=0.05, semconv="both",
                  await_annotations="advantage", annotation_timeout_s=2.0)
    if kind == "otlp":
        headers = dict(h.split("=", 1) for h in argv[2:])
        rtrace.configure(exporter="otlp", otlp_traces_endpoint=argv[1], otlp_headers=headers, **common)
    else:
        # a server: assessments are one request each, written only when asked (docs/mlflow.md)
        rtrace.configure(exporter="mlflow", mlflow_tracking_uri=argv[1], project=argv[2], mlflow_assessments=True,
                         **common)
    ids = semconv_job.run(tok)
    assert rtrace.flush(120)
    stats = rtrace.stats()
    rtrace.shutdown()
    failed = {k: v for k, v in stats.items() if "failed" in k and v}
    assert not failed, stats
    return ids


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
