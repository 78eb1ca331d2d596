"""The ``rtrace`` command (also ``python -m rtrace``).

``rtrace demo`` runs a small traced agentic rollout on CPU (see :mod:`rtrace.demo.run`).
This module only parses arguments: torch and transformers are imported by the demo,
when it runs, so ``rtrace --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

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
                      help="comma list of trackio, mlflow, jsonl, otlp, console "
                           "(default: $RTRACE_EXPORTER, else trackio in a local folder)")
    demo.add_argument("--project", default=None,
                      help="trackio project / MLflow experiment (default: $RTRACE_PROJECT, else rtrace-demo)")
    demo.add_argument("--out-dir", default="rtrace-demo",
                      help="folder for the local trackio data, MLflow database and JSONL file (default ./rtrace-demo)")
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
                         help="comma list of trackio, mlflow, jsonl, otlp, console (default: $RTRACE_EXPORTER)")
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
    collect.add_argument("--env-file", default=None, metavar="PATH",
                         help="also write the worker environment here, mode 0600 (with a token: default "
                              "rtrace-collector.env; the token is never printed)")
    report = sub.add_parser(
        "report", help="a step at a glance from JSONL trajectory files: a table, a static HTML page, a health check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print the per-step table (reward, turns, tokens, errors, latency...) of one or more JSONL "
                    "files written by rtrace's jsonl sink (several workers' files merge exactly). --html writes "
                    "one self-contained page that shows a step: metrics and histograms, GRPO groups side by side, "
                    "failures, a prompt across steps, latency ranking, rollout health, conversations "
                    "(docs/report.md).",
        epilog="--check exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in _exit_codes()))
    report.add_argument("paths", nargs="+", help="JSONL files")
    report.add_argument("--html", default=None, metavar="PAGE", help="also write the step viewer page here")
    report.add_argument("--check", action="store_true",
                        help="check the rollout health rates (health/<check>_rate per step) instead of printing "
                             "the table; exit 1 when one is above its threshold")
    report.add_argument("--max-rate", action="append", default=[], metavar="[CHECK=]RATE",
                        help="threshold of --check: RATE for every check (default 0: any finding fails) or "
                             "CHECK=RATE for one, e.g. --max-rate token_continuity=0.01; repeatable")
    report.add_argument("--max-chars", type=_positive, default=None,
                        help="the page cuts message contents to this many characters (default 4000)")
    return parser


def _collect(args: argparse.Namespace) -> int:
    import signal
    import threading

    from . import _setup

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    collector = _setup.start_collector(host=args.host, port=args.port, http_port=args.http_port,
                                       exporter=args.exporter, project=args.project, experiment=args.experiment,
                                       max_traces_per_step=args.max_traces_per_step, flush_on_sigterm=False,
                                       collector_tls_cert=args.tls_cert, collector_tls_key=args.tls_key,
                                       collector_tls_client_ca=args.tls_client_ca, collector_tls_ca=args.tls_ca)
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
    print(f"rtrace collector listening on {collector.endpoint}; worker environment:", flush=True)
    for key, value in env.items():
        if key == "RTRACE_COLLECTOR_TOKEN":  # never printed: logs are read by others
            print(f"# {key}: in {env_file} (mode 0600)", flush=True)
            continue
        print(f"export {key}={value}", flush=True)
    if env_file:
        print(f"# the whole worker environment: source {env_file}", flush=True)
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
    if args.command == "report":
        from .report import MAX_CHARS, run

        if args.max_rate and not args.check:
            parser.error("--max-rate is a threshold of --check: add --check")
        return run(args.paths, sys.stdout, args.html, health_check=args.check, max_rates=args.max_rate,
                   max_chars=args.max_chars or MAX_CHARS)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
