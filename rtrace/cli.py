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
    return parser


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
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
