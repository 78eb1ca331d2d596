"""The ``rtrace`` command (also ``python -m rtrace``).

``rtrace demo`` runs a small traced agentic rollout on CPU (see :mod:`rtrace.demo.run`).
This module only parses arguments: torch and transformers are imported by the demo,
when it runs, so ``rtrace --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

__all__ = ["main", "build_parser"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def config_error(command: str, exc: Exception, flags: dict[str, tuple[str, object]]) -> str:
    """The message of a bad setting for ``rtrace COMMAND``: a flag the user gave is named as
    the flag (``--exporter``), not as the environment variable behind it. ``flags`` maps a
    setting's name to ``(flag, the value given or None)``."""
    setting = getattr(exc, "setting", None)
    flag, given = flags.get(setting, (None, None)) if setting else (None, None)
    if flag is not None and given is not None:
        named = f"{flag} {given}" if flag.startswith("--") else f"{flag}={given}"
        return f"rtrace {command}: {named}: {exc.problem}; accepted values: {exc.accepted}"  # type: ignore[attr-defined]
    return f"rtrace {command}: {exc}"


def _exit_codes() -> list[tuple[int, str]]:
    from .report.health import EXIT_CODES

    return sorted(EXIT_CODES.items())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rtrace`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="rtrace", description="OpenTelemetry tracing for agentic RL rollouts.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="run a small traced GRPO-style tool-agent rollout on CPU (offline)",
        description=(
            "Run steps x prompts x rollouts of an async tool-calling agent loop with a tiny "
            "Qwen2 policy trained in this repository (python -m rtrace.demo.train; shipped "
            "weights, offline, sampling on CPU), with a GRPO-style policy-gradient step after "
            "each training step, traced with rtrace, then print a per-step table and the "
            "command that opens the traces. The policy writes real tool calls and is "
            "sometimes wrong, so rewards vary within a prompt's group."))
    demo.add_argument("--steps", type=_positive, default=3, help="RL steps (default 3)")
    demo.add_argument("--prompts", type=_positive, default=4, help="prompts per step (default 4)")
    demo.add_argument("--rollouts", type=_positive, default=4, help="rollouts per prompt, a GRPO group (default 4)")
    demo.add_argument("--max-turns", type=_positive, default=3, help="assistant turns per episode (default 3)")
    demo.add_argument("--max-new-tokens", type=_positive, default=48,
                      help="tokens generated per turn (default 48; a tool call takes 20-45)")
    demo.add_argument("--exporter", default=None,
                      help="comma list of trackio, mlflow, jsonl, parquet, otlp, console "
                           "(default: $RTRACE_EXPORTER, else trackio,parquet in a local folder: the trackio "
                           "dashboard and the dataset rtrace serve opens)")
    demo.add_argument("--project", default=None,
                      help="trackio project / MLflow experiment (default: $RTRACE_PROJECT, else rtrace-demo)")
    demo.add_argument("--out-dir", default="rtrace-demo",
                      help="folder for the local trackio data, the dataset, MLflow database and JSONL file "
                           "(default ./rtrace-demo)")
    demo.add_argument("--max-traces-per-step", type=_non_negative, default=None,
                      help="keep at most this many training trajectories per step (default: all)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompts and sampling (default 0)")
    demo.add_argument("--lr", type=_non_negative_float, default=None,
                      help="Adam learning rate of the policy-gradient step after each training step (default 3e-4; "
                           "0: no updates)")
    demo.add_argument("--no-validation", dest="validation", action="store_false",
                      help="skip the validation pass after the last step")
    collect = sub.add_parser(
        "collect", help="run an rtrace collector: OTLP in from every rollout worker, trajectories to the sinks",
        description=("Run the job's rtrace collector as a process (SLURM, Kubernetes). It prints the environment "
                     "for workers (RTRACE_EXPORTER=collector, RTRACE_COLLECTOR_ENDPOINT, ...) and runs until "
                     "SIGINT/SIGTERM, then writes what it holds. Other settings come from RTRACE_* variables."))
    collect.add_argument("--exporter", default=None,
                         help="comma list of trackio, mlflow, jsonl, parquet, otlp, console (default: $RTRACE_EXPORTER)")
    collect.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    collect.add_argument("--port", type=_non_negative, default=4317, help="OTLP/gRPC port (default 4317; 0: any)")
    collect.add_argument("--http-port", type=_non_negative, default=None, help="also serve OTLP/HTTP on this port")
    collect.add_argument("--project", default=None, help="trackio project / MLflow experiment")
    collect.add_argument("--experiment", default=None, help="run name")
    collect.add_argument("--max-traces-per-step", type=_non_negative, default=None,
                         help="trajectories kept per step, job-wide (default: all)")
    collect.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS only "
                         "(default: $RTRACE_COLLECTOR_TLS_CERT)")
    collect.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert "
                         "(default: $RTRACE_COLLECTOR_TLS_KEY)")
    collect.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certificates it signed "
                         "(mutual TLS; default: $RTRACE_COLLECTOR_TLS_CLIENT_CA)")
    collect.add_argument("--tls-ca", default=None, help="PEM CA workers verify the collector with, handed to them as "
                         "OTEL_EXPORTER_OTLP_CERTIFICATE (default: $RTRACE_COLLECTOR_TLS_CA)")
    collect.add_argument("--serve-port", type=_non_negative, default=None, metavar="PORT",
                         help="also serve the live viewer (rtrace serve) over what the collector writes (its parquet "
                              "or jsonl exporter) on this port (0: any); bound like the collector (--host), its token "
                              "beyond loopback (docs/serve.md)")
    collect.add_argument("--env-file", default=None, metavar="PATH",
                         help="also write the worker environment here, mode 0600 (with a token: default "
                              "rtrace-collector.env; the token is never printed)")
    collect.add_argument("--gateway-upstream", default=None, metavar="URL",
                         help="also serve the capture gateway in front of this OpenAI-compatible server "
                              "(default: $RTRACE_GATEWAY_UPSTREAM; docs/gateway.md)")
    collect.add_argument("--gateway-port", type=_non_negative, default=0, help="the gateway's port (default: any)")
    gateway = sub.add_parser(
        "gateway", help="run the capture gateway: an OpenAI-compatible endpoint whose calls are recorded as "
                        "generation spans of the trainer's trajectories",
        description=("Serve POST /v1/chat/completions, /v1/completions, /v1/responses and GET /v1/models in front "
                     "of an OpenAI-compatible server (vLLM, SGLang, a hosted API), and the session API "
                     "(/rtrace/sessions). Each call is recorded as a generation span of the rollout it names "
                     "(a rollout key from rtrace.gateway_access(), a session key, or a traceparent), with its "
                     "token ids, logprobs and weight version, and written by the sinks of RTRACE_EXPORTER "
                     "(`collector`: the job's collector). Prints the environment trainers need, runs until "
                     "SIGINT/SIGTERM. Other settings come from RTRACE_* variables (docs/gateway.md)."))
    gateway.add_argument("--upstream", default=None, metavar="URL",
                         help="the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
                              "(default: $RTRACE_GATEWAY_UPSTREAM)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    gateway.add_argument("--port", type=_positive, default=8100, help="port (default 8100)")
    gateway.add_argument("--exporter", default=None,
                         help="comma list of collector, jsonl, trackio, mlflow, otlp, console (default: "
                              "$RTRACE_EXPORTER)")
    gateway.add_argument("--project", default=None, help="trackio project / MLflow experiment")
    gateway.add_argument("--experiment", default=None, help="run name")
    gateway.add_argument("--untraced", choices=("refuse", "record", "forward"), default=None,
                         help="a call that names no rollout: refuse (default), record it as its own trajectory, "
                              "or forward it unrecorded")
    gateway.add_argument("--env-file", default=None, metavar="PATH",
                         help="write the trainers' environment here, mode 0600 (default rtrace-gateway.env; it "
                              "holds the signing secret, which is never printed)")
    report = sub.add_parser(
        "report", help="a step at a glance from JSONL trajectory files or a run's dataset: a table, a static HTML "
                       "page, a health check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print the per-step table (reward, turns, tokens, errors, latency...) of one or more JSONL "
                    "files written by rtrace's jsonl sink (several workers' files merge exactly), or of a run's "
                    "dataset written by the parquet sink (a folder or URL; computed by DuckDB). --html writes "
                    "one self-contained page that shows a step: metrics and histograms, GRPO groups side by side, "
                    "failures, a prompt across steps, latency ranking, rollout health, conversations "
                    "(docs/report.md).",
        epilog="--check exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in _exit_codes()))
    report.add_argument("paths", nargs="+", help="JSONL files, or one run's dataset (a folder or URL)")
    report.add_argument("--html", default=None, metavar="PAGE", help="also write the step viewer page here")
    report.add_argument("--check", action="store_true",
                        help="check the rollout health rates (health/<check>_rate per step) instead of printing "
                             "the table; exit 1 when one is above its threshold")
    report.add_argument("--max-rate", action="append", default=[], metavar="[CHECK=]RATE",
                        help="threshold of --check: RATE for every check (default 0: any finding fails) or "
                             "CHECK=RATE for one, e.g. --max-rate token_continuity=0.01; repeatable")
    report.add_argument("--require-reward", action="store_true",
                        help="with --check: fail when no rollout of the run recorded a reward (by default a note: "
                             "a job that computes rewards elsewhere, as veRL's agent loops by default)")
    report.add_argument("--max-chars", type=_positive, default=None,
                        help="the page cuts message contents to this many characters (default 4000)")
    timeline = sub.add_parser(
        "timeline", help="a step's fleet in time as a Chrome trace-event file (Perfetto UI, chrome://tracing, "
                         "speedscope): rollouts on their workers' lanes, generations on their servers, weight updates",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write one step (or a range) of a run as a Chrome trace-event JSON file (docs/timeline.md): a "
                    "process per inference server and per worker, each rollout a slice on a lane of its worker with "
                    "its generations, tool calls, reward and waits nested in it, counters of rollouts in flight and "
                    "tokens per second, weight updates as markers. Open it in https://ui.perfetto.dev, "
                    "chrome://tracing or speedscope.",
        epilog="examples:\n"
               "  rtrace timeline rtrace_dataset/run-7 --step 40 -o step40.json\n"
               "  rtrace timeline worker0.jsonl worker1.jsonl --steps 10:12 -o steps.json")
    timeline.add_argument("paths", nargs="+", metavar="PATH", help="a run's dataset (a folder or URL), or JSONL files")
    which = timeline.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, default=None, help="the step to draw")
    which.add_argument("--steps", default=None, metavar="A:B", help="the steps A to B (inclusive)")
    timeline.add_argument("-o", "--output", required=True, metavar="FILE", help="the trace-event JSON file to write")
    timeline.add_argument("--validate", action="store_true", help="validation rollouts (default: training)")
    timeline.add_argument("--max-rollouts", type=_positive, default=None,
                          help="rollouts drawn (default 200000; the others only counted)")
    timeline.add_argument("--max-detailed", type=_positive, default=None,
                          help="rollouts drawn with their calls (default 20000; the others as bare slices)")
    timeline.add_argument("--max-lanes", type=_positive, default=None,
                          help="lanes per worker and per server (default 512)")
    serve = sub.add_parser(
        "serve", help="a live view of whole runs in the browser: every step in one table, filters, histograms, "
                      "curves, prompts, failures, tokens, runs compared",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a read-only web app over runs (docs/serve.md), refreshed while they are written: a run's "
                    "dataset written by the parquet exporter (a folder or URL; a folder of runs: each), or JSONL "
                    "files written by the jsonl exporter (together: one run; NAME=PATH names a run). Binds "
                    "127.0.0.1 unless --host says otherwise; beyond loopback it requires RTRACE_COLLECTOR_TOKEN.",
        epilog="examples:\n"
               "  rtrace serve rtrace_dataset/run-7\n"
               "  rtrace serve rtrace_dataset                      # every run under it; compare any two\n"
               "  rtrace serve worker0.jsonl worker1.jsonl\n"
               "  rtrace serve base=runs/a new=runs/b\n"
               "  RTRACE_COLLECTOR_TOKEN=... rtrace serve --host 0.0.0.0 --tls-cert c.pem --tls-key k.pem runs")
    serve.add_argument("paths", nargs="+", metavar="PATH", help="a run's dataset, a folder of runs, JSONL files; "
                                                               "NAME=PATH to name a run")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_non_negative, default=None, help="port (default 8765; 0: any)")
    serve.add_argument("--time-limit-ms", type=_positive, default=None,
                       help="a query running longer is stopped and its page says so (default 3000)")
    serve.add_argument("--refresh-s", type=float, default=1.0,
                       help="how often the runs are read again while they are written (default 1)")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve HTTPS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    publish = sub.add_parser(
        "publish", help="write one trackio / MLflow run from a run's dataset (the collectors of a job write it)",
        description=("Read a run's dataset, written by one or many rtrace collectors (RTRACE_EXPORTER=parquet), and "
                     "write each finished step's kept trajectories and its step metrics over every rollout to the "
                     "sinks: one trackio run, one MLflow run for the whole job (docs/collector.md, section 7). "
                     "Follows the dataset until SIGINT/SIGTERM, then publishes what is left; --once publishes "
                     "everything now and exits. Other settings come from RTRACE_* variables."))
    publish.add_argument("path", help="the run's dataset: <RTRACE_PARQUET_PATH>/<run> (a folder or a URL)")
    publish.add_argument("--exporter", default=None,
                         help="comma list of trackio, mlflow, jsonl, otlp, console (default: $RTRACE_EXPORTER)")
    publish.add_argument("--project", default=None, help="trackio project / MLflow experiment")
    publish.add_argument("--experiment", default=None, help="run name (default: the dataset's run)")
    publish.add_argument("--once", action="store_true", help="publish every step now and exit (after the job)")
    publish.add_argument("--linger", type=_non_negative_float, default=30.0, metavar="SECONDS",
                         help="a step is published once a later step exists and its files did not change for this "
                              "long (default 30)")
    publish.add_argument("--interval", type=_non_negative_float, default=5.0, metavar="SECONDS",
                         help="how often the dataset is read again (default 5)")
    query = sub.add_parser(
        "query", help="run SQL (DuckDB) over a run's dataset written by the parquet exporter",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one SQL query over the views `trajectories` and `spans` of a run's dataset "
                    "(RTRACE_EXPORTER=parquet; docs/dataset.md) and print the result.",
        epilog="examples:\n"
               "  rtrace query rtrace_dataset/run-7 \"SELECT step, avg(reward) FROM trajectories WHERE NOT validate "
               "GROUP BY step "
               "ORDER BY step\"\n"
               "  rtrace query rtrace_dataset/run-7 \"SELECT trace_id, reward FROM trajectories WHERE step = $step "
               "ORDER BY reward LIMIT 5\" --param step=3")
    query.add_argument("path", help="the run's dataset: a folder or a URL (s3://bucket/prefix/run)")
    query.add_argument("sql", help="the query; views: trajectories, spans")
    query.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                       help="a $NAME parameter (a number when it parses as one, else text); repeatable")
    query.add_argument("--format", choices=("table", "csv", "jsonl"), default="table",
                       help="output: an aligned table (default), CSV, or one JSON object per row")
    query.add_argument("--max-rows", type=_positive, default=200,
                       help="rows the table shows (default 200; csv and jsonl print every row)")
    return parser


def _param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--param {text!r}: expected NAME=VALUE")
    for kind in (int, float):
        try:
            return name.strip(), kind(value)
        except ValueError:
            pass
    return name.strip(), value


def _query(args: argparse.Namespace) -> int:
    import csv
    import json

    from .dataset.reader import DatasetError, open_run

    try:
        params = dict(_param(p) for p in args.param) or None
        run = open_run(args.path)
        rel = run.sql(args.sql, params)
    except (DatasetError, ValueError, OSError, ImportError) as exc:
        sys.stderr.write(f"rtrace query: {exc}\n")
        return 2
    except Exception as exc:  # a DuckDB error: the SQL is wrong
        sys.stderr.write(f"rtrace query: {type(exc).__name__}: {exc}\n")
        return 2
    if rel is None:  # a statement without a result (SET ...)
        return 0
    try:  # the query runs here (a damaged file's data, a division by zero ...): said, never a traceback
        if args.format == "table":
            rel.show(max_rows=args.max_rows, max_width=10_000)
            return 0
        columns = rel.columns
        rows = rel.fetchall()
    except Exception as exc:
        sys.stderr.write(f"rtrace query: {type(exc).__name__}: {exc}\n")
        return 2
    if args.format == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        for row in rows:
            sys.stdout.write(json.dumps(dict(zip(columns, row)), default=str, ensure_ascii=False) + "\n")
    return 0


def _collect(args: argparse.Namespace) -> int:
    import signal
    import threading

    from .config import ConfigError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        collector = _start(args)
    except ConfigError as exc:
        flags = {"exporter": ("--exporter", args.exporter), "max_traces_per_step": ("--max-traces-per-step",
                                                                                     args.max_traces_per_step),
                 "project": ("--project", args.project), "experiment": ("--experiment", args.experiment),
                 "collector_tls_cert": ("--tls-cert", args.tls_cert), "collector_tls_key": ("--tls-key", args.tls_key),
                 "collector_tls_client_ca": ("--tls-client-ca", args.tls_client_ca),
                 "collector_tls_ca": ("--tls-ca", args.tls_ca),
                 "gateway_upstream": ("--gateway-upstream", args.gateway_upstream)}
        sys.stderr.write(config_error("collect", exc, flags) + "\n")
        return 2
    return _serve_collector(collector, args, stop)


def _start(args: argparse.Namespace):
    from . import _setup

    return _setup.start_collector(host=args.host, port=args.port, http_port=args.http_port,
                                  serve_port=args.serve_port,
                                  exporter=args.exporter, project=args.project, experiment=args.experiment,
                                  max_traces_per_step=args.max_traces_per_step, flush_on_sigterm=False,
                                  collector_tls_cert=args.tls_cert, collector_tls_key=args.tls_key,
                                  collector_tls_client_ca=args.tls_client_ca, collector_tls_ca=args.tls_ca,
                                  gateway_upstream=args.gateway_upstream, gateway_port=args.gateway_port)


def _serve_collector(collector, args: argparse.Namespace, stop) -> int:
    import json

    from .pipeline.collector import release_memory, tune_gc, tune_malloc

    tune_gc()  # this process is the collector's alone
    tune_malloc()
    env = dict(collector.env)
    if args.host in ("0.0.0.0", "::"):  # workers need an address they can reach
        scheme = "https://" if env["RTRACE_COLLECTOR_ENDPOINT"].startswith("https://") else ""
        env["RTRACE_COLLECTOR_ENDPOINT"] = f"{scheme}<this host's address>:{collector.endpoint.rsplit(':', 1)[1]}"
    env_file = args.env_file or ("rtrace-collector.env" if collector.token else None)
    if env_file:
        env_file = collector.write_env(env_file)
        if args.host in ("0.0.0.0", "::"):  # the file gets the address placeholder too
            import shlex

            with open(env_file, "w") as f:
                f.writelines(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    if collector.gateway is not None and not env_file:  # the signing secret goes to a file, never to the log
        env_file = collector.write_env("rtrace-collector.env")
    print(f"rtrace collector listening on {collector.endpoint}; worker environment:", flush=True)
    if collector.gateway is not None:
        from .gateway.upstream import shown_url

        print(f"# capture gateway: {collector.gateway.url}/v1 -> {shown_url(collector.settings.gateway_upstream)}",
              flush=True)
    viewer = getattr(collector, "viewer", None)
    for key, value in env.items():
        if key in ("RTRACE_COLLECTOR_TOKEN", "RTRACE_GATEWAY_SECRET"):  # never printed: logs are read by others
            print(f"# {key}: in {env_file} (mode 0600)", flush=True)
            continue
        print(f"export {key}={value}", flush=True)
    if env_file:
        print(f"# the whole worker environment: source {env_file}", flush=True)
    if viewer is not None:
        print(f"# the live viewer: {viewer.url}" + ("  (sign in with the token)" if collector.token else ""), flush=True)
    requests, idle = -1, 0
    while not stop.wait(1.0):
        # once no request came for a second, and for the next few while the sinks finish,
        # the free pages of the threads' heaps go back to the system: after a burst the
        # collector's memory returns near where it was
        now = collector.receiver.stats()["requests"]
        idle, requests = (idle + 1 if now == requests else 0), now
        if 1 <= idle <= 10:
            release_memory()
    collector.stop()
    print("rtrace collector stopped", flush=True)
    # what it wrote, dropped and refused, as one JSON line: the end of a job's log says what it lost
    print("# rtrace stats: " + json.dumps(collector.stats(), sort_keys=True, default=str), flush=True)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    import os

    from . import _setup
    from .config import ConfigError, load_settings
    from .gateway.app import Gateway
    from .gateway.server import _token, check_upstream, serve_forever

    overrides = {"exporter": args.exporter, "project": args.project, "experiment": args.experiment,
                 "gateway_upstream": args.upstream, "gateway_untraced": args.untraced, "flush_on_sigterm": False}
    try:
        settings = load_settings(overrides)
        check_upstream(settings.gateway_upstream)
        if not settings.enabled:
            raise ConfigError("rtrace gateway records into the sinks of RTRACE_EXPORTER (or --exporter), and none is "
                              "set; accepted values: comma list of collector, jsonl, trackio, mlflow, otlp, console")
        _setup.configure(**{k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        sys.stderr.write(f"rtrace gateway: {exc}\n")
        return 2
    gateway = Gateway(settings, token=_token(settings, args.host))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    gateway.url = f"http://{host}:{args.port}"
    env = {"RTRACE_GATEWAY_URL": gateway.url, "RTRACE_GATEWAY_SECRET": gateway.secret}
    if gateway.token:
        env["RTRACE_COLLECTOR_TOKEN"] = gateway.token
    env_file = os.path.abspath(args.env_file or "rtrace-gateway.env")
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        import shlex

        os.fchmod(f.fileno(), 0o600)
        f.writelines(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    print(f"rtrace gateway listening on {gateway.url}/v1 -> {gateway.upstream_shown}; trainer environment:",
          flush=True)
    print(f"export RTRACE_GATEWAY_URL={gateway.url}", flush=True)
    print(f"# RTRACE_GATEWAY_SECRET{' and RTRACE_COLLECTOR_TOKEN' if gateway.token else ''}: in {env_file} "
          "(mode 0600)", flush=True)
    print(f"# the whole trainer environment: source {env_file}", flush=True)
    # The event loop and rtrace's worker thread share the GIL: a loop that wakes up for a call
    # waits for the worker's switch interval (5 ms by default) before it runs; 1 ms keeps
    # that wait off the calls' latency
    sys.setswitchinterval(0.001)
    try:
        serve_forever(gateway, args.host, args.port)
    finally:
        _setup.shutdown()  # open sessions are written partial
    print("rtrace gateway stopped", flush=True)
    return 0


def _publish(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from .config import ConfigError, load_settings
    from .dataset.reader import DatasetError
    from .publish import Publisher

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    experiment = args.experiment or os.path.basename(os.path.normpath(args.path))
    try:
        settings = load_settings({k: v for k, v in (("exporter", args.exporter), ("project", args.project),
                                                     ("experiment", experiment)) if v is not None})
        publisher = Publisher(args.path, settings, linger_s=args.linger)
        publisher.run  # noqa: B018 - a path that holds no run fails here, with its message
    except ConfigError as exc:
        sys.stderr.write(config_error("publish", exc, {"exporter": ("--exporter", args.exporter)}) + "\n")
        return 2
    except DatasetError as exc:
        sys.stderr.write(f"rtrace publish: {exc}\n")
        return 2
    try:
        if args.once:
            publisher.poll(final=True)
        else:
            print(f"rtrace publish: following {args.path} (Ctrl-C to publish the rest and stop)", flush=True)
            publisher.follow(args.interval, stop.is_set)
        ok = publisher.flush()
    finally:
        publisher.close()
    steps = sorted(publisher.published)
    print(f"rtrace publish: {len(steps)} steps, {sum(publisher.published.values())} rollouts published", flush=True)
    return 0 if ok else 1


def _timeline(args: Any, parser: argparse.ArgumentParser) -> int:
    import time

    from .report.timeline import Limits, load_timeline
    from .report.trace_json import write_trace

    if args.step is not None:
        steps = (args.step, args.step)
    else:
        first, sep, last = args.steps.partition(":")
        try:
            steps = (int(first), int(last if sep else first))
        except ValueError:
            parser.error(f"--steps {args.steps!r}: expected A:B (two integers)")
        if steps[0] > steps[1]:
            parser.error(f"--steps {args.steps!r}: A must not be after B")
    limits = Limits()
    for name in ("max_rollouts", "max_detailed", "max_lanes"):
        if getattr(args, name) is not None:
            setattr(limits, name, getattr(args, name))
    import gc

    # a large step is a million small objects, none in a cycle: the cyclic GC would walk them
    # all several times over (~10% of the command's time) for nothing
    gc.disable()
    began = time.perf_counter()
    try:
        tl = load_timeline(args.paths, steps, validate=args.validate, limits=limits)
    except (ValueError, OSError) as exc:
        print(f"rtrace timeline: {exc}", file=sys.stderr)
        return 1
    try:
        with open(args.output, "wb") as out:
            info = write_trace(tl, out)
    except OSError as exc:
        print(f"rtrace timeline: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    took = time.perf_counter() - began
    lanes = sum(tl.workers.values())
    print(f"rtrace timeline: wrote {args.output}: {info['rollouts']} rollouts ({info['rollouts_drawn']} drawn, "
          f"{info['rollouts_with_children']} with their calls) on {len(tl.workers)} workers ({lanes} lanes), "
          f"{len(tl.servers)} servers, {info['weight_updates']} weight updates; {info['events']} events, "
          f"{info['bytes'] / 1e6:.1f} MB in {took:.2f} s", flush=True)
    for note in tl.notes:
        print(f"note: {note}")
    print("open it in https://ui.perfetto.dev (or chrome://tracing, speedscope); docs/timeline.md")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rtrace`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo.run import DemoOptions, run_demo

        opts = DemoOptions(steps=args.steps, prompts=args.prompts, rollouts=args.rollouts,
                           max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                           exporter=args.exporter, project=args.project, out_dir=args.out_dir,
                           max_traces_per_step=args.max_traces_per_step, seed=args.seed,
                           validation=args.validation)
        if args.lr is not None:
            opts.learning_rate = args.lr
        try:
            return run_demo(opts)
        except KeyboardInterrupt:
            sys.stderr.write("rtrace demo: interrupted\n")
            return 130
    if args.command == "collect":
        return _collect(args)
    if args.command == "query":
        return _query(args)
    if args.command == "publish":
        return _publish(args)
    if args.command == "serve":
        from .serve import DEFAULT_PORT, serve_paths
        from .serve.app import TIME_LIMIT_MS

        if not args.refresh_s > 0:
            parser.error("--refresh-s must be > 0")
        return serve_paths(args.paths, args.host, DEFAULT_PORT if args.port is None else args.port,
                           float(args.time_limit_ms or TIME_LIMIT_MS), args.refresh_s, args.tls_cert, args.tls_key,
                           sys.stdout)
    if args.command == "gateway":
        return _gateway(args)
    if args.command == "timeline":
        return _timeline(args, parser)
    if args.command == "report":
        from .report import MAX_CHARS, run

        if (args.max_rate or args.require_reward) and not args.check:
            parser.error("--max-rate and --require-reward are options of --check: add --check")
        return run(args.paths, sys.stdout, args.html, health_check=args.check, max_rates=args.max_rate,
                   max_chars=args.max_chars or MAX_CHARS, require_reward=args.require_reward)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
