"""``rtrace demo``: a small GRPO-style rollout, traced end to end, on CPU, offline.

Steps x prompts x rollouts: for each step a batch of prompts is drawn, each prompt is
rolled out ``--rollouts`` times (a GRPO group), every rollout runs concurrently on one
asyncio loop inside its own ``rtrace.rollout_context``, and the reward is recorded on
the trajectory. A greedy validation pass (``validate=True``) follows the last step.
Then the traces are flushed to the chosen sinks (by default trackio and the Parquet
dataset), a per-step table is printed, and the commands that open what was written, the
live viewer (``rtrace serve``) first.

The policy is a tiny Qwen2 trained by this repository (``python -m rtrace.demo.train``,
see :mod:`rtrace.demo.model`) to write ``<tool_call>`` blocks with the numbers or key
copied from the prompt and to answer with the tool's result. Training rollouts sample
at temperature 1, so the policy is sometimes wrong (a miscopied operand or result, a
wrong operator; lookups are easy, arithmetic is not) and the rollouts of one prompt can
get different rewards.

What makes the reward move from step to step: mostly which prompts were drawn
(arithmetic or lookup, easy or hard numbers) and what was sampled. After each training
step the policy does take one real policy-gradient step on that step's rollouts
(REINFORCE with GRPO's group-normalised advantage, Adam, ``--lr``; see
:meth:`rtrace.demo.model.Policy.update`), and the progress lines show it raising the
log-probability of the rewarded responses and lowering the others'. But a few
informative rollouts per step are far too little signal to improve the policy: at the
default rate the rewards of the default run are the same as with ``--lr 0``; at 1e-3
and above the held-out reward drops (measured; see docs/getting-started.md). The update
is there to show a real training loop's shape in the traces (``policy_version``), not
learning.

Nothing here seeds or draws from Python's global ``random`` or torch's global generator:
prompts come from ``random.Random(seed)`` and sampling from per-call
``torch.Generator``s, so the same ``--seed`` gives the same rollouts while trace ids
(drawn by OpenTelemetry from the global ``random``) differ between runs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shlex
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import rtrace
from rtrace.cli import config_error
from rtrace.config import load_settings

__all__ = ["DemoOptions", "RolloutResult", "run_demo", "DEFAULT_EXPORTER"]

#: The sinks used when neither ``--exporter`` nor ``RTRACE_EXPORTER`` is given: trackio's
#: dashboard, and the dataset ``rtrace serve`` opens (the demo ends with the commands for both)
DEFAULT_EXPORTER = "trackio,parquet"
DEFAULT_OUT_DIR = "rtrace-demo"
DEFAULT_PROJECT = "rtrace-demo"
#: Adam learning rate of the policy-gradient step after each training step (0: none).
DEFAULT_LEARNING_RATE = 3e-4


@dataclass
class DemoOptions:
    """The demo's knobs (the CLI flags of ``rtrace demo``)."""

    steps: int = 3
    prompts: int = 4
    rollouts: int = 4
    max_turns: int = 3
    max_new_tokens: int = 48
    exporter: str | None = None
    project: str | None = None
    out_dir: str = DEFAULT_OUT_DIR
    max_traces_per_step: int | None = None
    seed: int = 0
    validation: bool = True
    learning_rate: float = DEFAULT_LEARNING_RATE


@dataclass
class RolloutResult:
    """One finished rollout, as the table needs it."""

    step: int
    validate: bool
    traced: bool
    reward: float
    turns: int
    tool_calls: int
    latency_ms: float
    sample_index: int = 0
    rollout_n: int = 0
    policy_tool_calls: int = 0
    forced_tool_calls: int = 0
    #: ``(prompt_ids, response_ids)`` of each generation: the policy-gradient data.
    samples: list = field(default_factory=list, repr=False)


@dataclass
class _Row:
    step: int
    split: str
    results: list[RolloutResult] = field(default_factory=list)
    #: trajectories of the step that reached the sinks (the table's ``kept``)
    written: int = 0


# ----------------------------------------------------------------------------- wiring


class _Written(rtrace.Sink):
    """Counts the trajectories that reached the sinks, per (validate, step): the table's
    ``kept`` column (a cap keeps fewer than the rollouts traced)."""

    name = "demo-count"

    def __init__(self) -> None:
        super().__init__(None)
        self.counts: dict[tuple[bool, Any], int] = {}

    def export(self, trajectories: Sequence[Any]) -> None:
        for t in trajectories:
            key = (bool(t.validate), t.step)
            self.counts[key] = self.counts.get(key, 0) + 1


class _TrackioBanner:
    """The demo's stdout without trackio's own banner. trackio prints, when the sink opens
    its run, how to open the dashboard without the demo's TRACKIO_DIR: a command that shows
    "No projects" in another shell. The demo prints the one command that works."""

    DROPPED = ("* Trackio project initialized", "* Trackio metrics logged to", "* View dashboard by running",
               "trackio show --project", "* or by running in Python: trackio.show", "* Created new run",
               "* Resumed existing run", "* Run finished. Uploading logs", "* psutil detected")

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            if not any(mark in line for mark in self.DROPPED):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _resolve_exporter(opts: DemoOptions) -> str:
    chosen = opts.exporter or os.environ.get("RTRACE_EXPORTER")
    if chosen:
        return chosen
    if importlib.util.find_spec("pyarrow") is None:  # the dataset needs the parquet extra: trackio alone
        return "trackio"
    return DEFAULT_EXPORTER


def _configure(opts: DemoOptions, exporter: str, out_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """Configure rtrace for the demo; returns what the "open the traces" hint needs."""
    names = [n.strip().lower() for n in exporter.split(",") if n.strip()]
    kwargs: dict[str, Any] = {
        "exporter": exporter,
        "project": opts.project or os.environ.get("RTRACE_PROJECT") or DEFAULT_PROJECT,
        "experiment": os.environ.get("RTRACE_EXPERIMENT") or time.strftime("demo-%Y%m%d-%H%M%S"),
        "token2text": True,
        "tokenizer": tokenizer,
        "max_traces_per_step": opts.max_traces_per_step,
        "export_interval_s": 0.2,
        # the advantages come once the whole step is scored: training trajectories wait for them
        "await_annotations": "advantage",
        "annotation_timeout_s": 120.0,
        # under a cap, keep the same prompts at every step they are drawn (whole groups)
        "sample_prompts": opts.max_traces_per_step is not None,
    }
    where: dict[str, Any] = {"names": names, "project": kwargs["project"]}
    if "trackio" in names:
        # trackio reads TRACKIO_DIR when it is imported (in the sink's thread, later):
        # a local folder under --out-dir unless the user chose one. Nothing to start.
        where["trackio_dir"] = os.environ.setdefault("TRACKIO_DIR", str(out_dir / "trackio"))
    if "jsonl" in names:
        where["jsonl_path"] = os.environ.get("RTRACE_JSONL_PATH") or str(out_dir / "traces.jsonl")
        kwargs["jsonl_path"] = where["jsonl_path"]
    if "parquet" in names:
        kwargs["parquet_path"] = os.environ.get("RTRACE_PARQUET_PATH") or str(out_dir / "dataset")
        from ..dataset.layout import run_name

        where["parquet_run"] = os.path.join(kwargs["parquet_path"], run_name(kwargs["experiment"]))
    if "mlflow" in names:
        where["mlflow_uri"] = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out_dir / 'mlflow.db'}"
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # the run's artifacts (its tables) beside the database
            where["mlflow_artifacts"] = (out_dir / "mlflow-artifacts").as_uri()
        kwargs["mlflow_tracking_uri"] = where["mlflow_uri"]
    where["written"] = _Written()
    kwargs["sinks"] = [where["written"]]
    settings = rtrace.configure(**kwargs)
    where["otlp_endpoint"] = settings.otlp_traces_endpoint or settings.otlp_endpoint
    if "mlflow" in names:
        _start_mlflow_run(where, kwargs["experiment"])
    return where


def _start_mlflow_run(where: dict[str, Any], run_name: str) -> None:
    """Open an MLflow run, as a training job has one: rtrace links the traces to it and
    logs the step metrics on it. :func:`_end_mlflow_run` ends it."""
    import mlflow

    mlflow.set_tracking_uri(where["mlflow_uri"])
    if "mlflow_artifacts" in where and mlflow.get_experiment_by_name(where["project"]) is None:
        # else MLflow puts the artifacts (the rollouts tables) in ./mlruns of the current directory
        mlflow.create_experiment(where["project"], artifact_location=where["mlflow_artifacts"])
    mlflow.set_experiment(where["project"])
    run = mlflow.start_run(run_name=run_name)
    where["mlflow_run"] = (run.info.experiment_id, run.info.run_id)


def _end_mlflow_run(where: dict[str, Any]) -> None:
    if "mlflow_run" in where:
        import mlflow

        mlflow.end_run()


def _command(name: str) -> str:
    """``name`` if it is on PATH, else its path next to this Python (``make demo`` runs
    from .venv without activating it)."""
    if shutil.which(name):
        return name
    candidate = Path(sys.executable).parent / name
    return shlex.quote(str(candidate)) if candidate.exists() else name


def open_commands(where: dict[str, Any]) -> list[tuple[str, str]]:
    """``(command, what it opens)`` for what the sinks wrote, the live viewer first
    (``rtrace serve`` over the dataset, else over the JSONL file): each command is a line a
    person can paste as it is."""
    q = shlex.quote
    names = where["names"]
    rtrace_cmd = _command("rtrace")
    out: list[tuple[str, str]] = []
    if "parquet" in names:
        out.append((f"{rtrace_cmd} serve {q(where['parquet_run'])}",
                    "every rollout of every step in the browser: filters, curves, tokens (docs/serve.md)"))
    elif "jsonl" in names:
        out.append((f"{rtrace_cmd} serve {q(where['jsonl_path'])}",
                    "every rollout of every step in the browser: filters, curves, tokens (docs/serve.md)"))
    if "trackio" in names:
        out.append((f"TRACKIO_DIR={q(where['trackio_dir'])} {_command('trackio')} show --project {q(where['project'])}",
                    "trackio's dashboard: a trace per rollout, the step metrics"))
    if "mlflow" in names:
        page = f"http://127.0.0.1:5000 -> experiment {where['project']}"
        if "mlflow_run" in where:  # the run the traces are linked to
            page = "http://127.0.0.1:5000/#/experiments/{}/runs/{}".format(*where["mlflow_run"])
        out.append((f"{_command('mlflow')} ui --backend-store-uri {q(where['mlflow_uri'])}",
                    f"then {page} -> Traces (one step: Traces -> Filters -> Tag: step = 1; in Python: "
                    "mlflow.search_traces(filter_string=\"tags.step = '1'\")); Model metrics: the step metrics"))
    if "parquet" in names:
        out.append((f"{rtrace_cmd} query {q(where['parquet_run'])} \"SELECT step, avg(reward) FROM trajectories WHERE "
                    "NOT validate GROUP BY step ORDER BY step\"", "SQL over the dataset (docs/dataset.md)"))
    if "jsonl" in names:
        page = str(Path(where["jsonl_path"]).with_name("report.html"))
        out.append((f"{rtrace_cmd} report {q(where['jsonl_path'])} --html {q(page)}",
                    f"{where['jsonl_path']}: one trajectory per line (schema rtrace.trajectory/1); this writes the "
                    "step table and a page of GRPO groups side by side, failures, health"))
    if "otlp" in names:
        out.append((f"# sent to {where['otlp_endpoint'] or 'http://localhost:4318'}",
                    "open your collector's UI (Jaeger: http://localhost:16686, see docker-compose.yml)"))
    return out


# ----------------------------------------------------------------------------- rollouts


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + p) % (2**31 - 1)
    return value


async def _rollout(agent: Any, task: Any, step: int, sample_index: int, rollout_n: int, validate: bool,
                   seed: int, temperature: float) -> RolloutResult:
    from .agent import compute_reward
    from .model import recording

    start = time.perf_counter()
    # The prompt's dataset index is its sample_index and names its GRPO group at every step
    # it is drawn (as veRL's extra_info.index): a prompt can be followed across steps.
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=rollout_n, validate=validate,
                                group_id=f"prompt-{sample_index}", policy_version=step,
                                prompt_id=sample_index, task_kind=task.kind) as ctx:
        with recording() as samples:
            out = await agent.run(task.question, task.kind, seed=seed, temperature=temperature)
        reward = compute_reward(task, out["answer"])
        rtrace.record_reward(reward, correct=reward == 1.0, expected=task.answer,
                             forced_tool_calls=out["forced_tool_calls"],
                             policy_tool_calls=out["policy_tool_calls"])
    return RolloutResult(step, validate, ctx.traced, reward, out["turns"], out["tool_calls"],
                         (time.perf_counter() - start) * 1000, sample_index, rollout_n, out["policy_tool_calls"],
                         out["forced_tool_calls"], samples)


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, label: str, total: int, stream: TextIO) -> None:
        self.label, self.total, self.done, self.stream = label, total, 0, stream
        self.start = time.perf_counter()
        self.tty = stream.isatty()
        if self.tty:
            self._draw()

    def advance(self) -> None:
        self.done += 1
        if self.tty:
            self._draw()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        else:
            self._draw(newline=True)
        self.stream.flush()

    def _draw(self, newline: bool = False) -> None:
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        text = f"{self.label:<14} [{bar}] {self.done}/{self.total} rollouts  {time.perf_counter() - self.start:5.1f}s"
        self.stream.write(text + ("\n" if newline else "\r"))
        self.stream.flush()


async def _run_batch(agent: Any, tasks: Sequence[tuple[int, Any]], step: int, rollouts: int,
                     validate: bool, seed: int, label: str, stream: TextIO) -> list[RolloutResult]:
    """Roll out ``tasks`` (``(dataset index, task)`` pairs) ``rollouts`` times each."""
    progress = _Progress(label, len(tasks) * rollouts, stream)
    temperature = 0.0 if validate else 1.0  # validation is greedy, as in veRL's val_kwargs

    async def one(i: int, n: int) -> RolloutResult:
        index, task = tasks[i]
        result = await _rollout(agent, task, step, index, n, validate, _seed(seed, step, int(validate), index, n),
                                temperature)
        progress.advance()
        return result

    results = await asyncio.gather(*(one(i, n) for i in range(len(tasks)) for n in range(rollouts)))
    progress.close()
    return list(results)


def group_advantages(results: Sequence[RolloutResult]) -> list[float]:
    """GRPO's advantage: each reward minus its group's mean, over the group's standard
    deviation (0 for a group whose rollouts all got the same reward)."""
    groups: dict[int, list[float]] = {}
    for r in results:
        groups.setdefault(r.sample_index, []).append(r.reward)
    advantages = []
    for r in results:
        rewards = groups[r.sample_index]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        advantages.append((r.reward - mean) / std if std > 0 else 0.0)
    return advantages


async def _update(agent: Any, results: Sequence[RolloutResult], advantages: Sequence[float], step: int,
                  stream: TextIO) -> None:
    """One policy-gradient step on a training step's rollouts (see Policy.update)."""
    stats = await agent.policy.update([(r.samples, a) for r, a in zip(results, advantages)])
    groups = len({r.sample_index for r in results})
    line = (f"{'update ' + str(step):<14} policy-gradient step on {stats['episodes']} of {len(results)} rollouts "
            f"(non-zero advantage, {groups} groups)")
    if "logp_pos" in stats:
        line += (f": log p/token of rewarded responses {stats['logp_pos']:.3f} -> {stats['logp_pos_after']:.3f}, "
                 f"of the others {stats['logp_neg']:.3f} -> {stats['logp_neg_after']:.3f}")
    stream.write(line + "\n")
    stream.flush()


def annotate_advantages(step: int, results: Sequence[RolloutResult]) -> list[float]:
    """Hand the trainer's GRPO advantages to rtrace, as a trainer does after scoring a
    batch: they join the step's trajectories (which wait for them: RTRACE_AWAIT_ANNOTATIONS)."""
    advantages = group_advantages(results)
    rtrace.annotate_batch(step=step, sample_index=[r.sample_index for r in results],
                          rollout_n=[r.rollout_n for r in results], advantage=advantages)
    return advantages


async def _run_all(opts: DemoOptions, agent: Any, stream: TextIO) -> list[_Row]:
    from .agent import make_tasks

    # A small dataset: each step draws its prompts from it, so prompts recur across steps
    # under the same dataset index (sample_index, group_id "prompt-<index>"); validation
    # has its own prompts, numbered after the training ones.
    rng = random.Random(opts.seed)
    pool = list(enumerate(make_tasks(2 * opts.prompts, random.Random(opts.seed))))
    rows = []
    for step in range(1, opts.steps + 1):
        tasks = sorted(rng.sample(pool, min(opts.prompts, len(pool))), key=lambda t: t[0])
        results = await _run_batch(agent, tasks, step, opts.rollouts, False, opts.seed, f"step {step}/{opts.steps}",
                                   stream)
        rows.append(_Row(step, "train", results))
        advantages = annotate_advantages(step, results)
        if opts.learning_rate > 0:
            await _update(agent, results, advantages, step, stream)
    if opts.validation:
        val = make_tasks(opts.prompts, random.Random(opts.seed + 10_000), validation=True)
        tasks = [(len(pool) + k, task) for k, task in enumerate(val)]
        results = await _run_batch(agent, tasks, opts.steps, 1, True, opts.seed, "validation", stream)
        rows.append(_Row(opts.steps, "val", results))
    return rows


# ----------------------------------------------------------------------------- report


def format_table(rows: Sequence[_Row]) -> str:
    """The end-of-run table: one line per step (and one for validation)."""
    header = ("step", "split", "rollouts", "kept", "mean reward", "mean turns", "tool calls", "mean latency")
    lines = [header]
    for row in rows:
        rs = row.results
        n = max(len(rs), 1)
        lines.append((str(row.step), row.split, str(len(rs)), str(row.written),
                      f"{sum(r.reward for r in rs) / n:.2f}", f"{sum(r.turns for r in rs) / n:.2f}",
                      str(sum(r.tool_calls for r in rs)), f"{sum(r.latency_ms for r in rs) / n:.0f} ms"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(cell.rjust(w) if k and i != 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def summary(rows: Sequence[_Row], policy: Any, opts: DemoOptions) -> str:
    """What the numbers in the table come from: the policy, the answers, the tool calls."""
    def count(split: str) -> str:
        rs = [r for row in rows if row.split == split for r in row.results]
        right = sum(r.reward == 1.0 for r in rs)
        return f"{right} correct, {len(rs) - right} wrong"

    results = [r for row in rows for r in row.results]
    info = policy.info
    trained = (f"trained by `python -m rtrace.demo.train` ({info['steps']} steps of {info['batch']} synthetic "
               "tool-use dialogues)" if "steps" in info else "loaded from its weights file")
    update = (f"one GRPO-style policy-gradient step after each training step (Adam, lr {opts.learning_rate:g})"
              if opts.learning_rate > 0 else "no policy updates (--lr 0)")
    lines = [
        f"Policy: a tiny Qwen2 ({policy.num_parameters / 1e6:.2f}M parameters) {trained};",
        f"train rollouts sample at temperature 1, validation is greedy; {update}.",
        f"Answers: train {count('train')}; val {count('val')}.",
        f"Tool calls: {sum(r.policy_tool_calls for r in results)} written by the policy, "
        f"{sum(r.forced_tool_calls for r in results)} added by the agent's fallback rule "
        "(first turn without a valid call, see rtrace/demo/agent.py).",
    ]
    return "\n".join(lines)


def run_demo(opts: DemoOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code (0: every sink wrote every trace)."""
    out = out or sys.stdout
    err = err or sys.stderr
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded, ever
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = Path(opts.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = _resolve_exporter(opts)
    flags = {"exporter": ("--exporter", opts.exporter) if opts.exporter else ("RTRACE_EXPORTER", exporter),
             "max_traces_per_step": ("--max-traces-per-step",
                                                                                opts.max_traces_per_step),
             "project": ("--project", opts.project)}
    try:  # fail on a bad --exporter / RTRACE_* value now, not after building the model
        load_settings({"exporter": exporter, "max_traces_per_step": opts.max_traces_per_step})
    except rtrace.ConfigError as exc:
        err.write(config_error("demo", exc, flags) + "\n")
        return 2

    err.write("rtrace demo: loading the tiny trained Qwen2 policy (offline, CPU)...\n")
    err.flush()
    from .agent import ToolAgentLoop
    from .model import build_policy

    policy = build_policy(max_new_tokens=opts.max_new_tokens, learning_rate=opts.learning_rate)
    try:
        where = _configure(opts, exporter, out_dir, policy.tokenizer)
    except rtrace.ConfigError as exc:
        err.write(config_error("demo", exc, flags) + "\n")
        policy.close()
        return 2
    err.write(f"rtrace demo: {opts.steps} steps x {opts.prompts} prompts x {opts.rollouts} rollouts, "
              f"max {opts.max_turns} turns, exporter={exporter}\n")
    agent = ToolAgentLoop(policy, max_turns=opts.max_turns)
    start = time.perf_counter()
    stdout = sys.stdout
    if "trackio" in where["names"]:
        sys.stdout = _TrackioBanner(stdout)  # type: ignore[assignment]
    # the demo's output is what a newcomer reads: no deprecation notices of the libraries it
    # runs on (transformers' FutureWarnings through torch), for this run only
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            rows = asyncio.run(_run_all(opts, agent, err))
        finally:
            flushed = rtrace.flush(60)
            rtrace.shutdown()
            _end_mlflow_run(where)
            policy.close()
            sys.stdout = stdout
    elapsed = time.perf_counter() - start
    for row in rows:
        row.written = where["written"].counts.get((row.split == "val", row.step), 0)

    stats = rtrace.stats()
    out.write("\n" + format_table(rows) + "\n\n")
    out.write(summary(rows, policy, opts) + "\n\n")
    failed = False
    for name in where["names"]:
        exported = stats.get(f"sink.{name}.exported", 0)
        lost = sum(stats.get(f"sink.{name}.{k}", 0) for k in ("failed_trajectories", "dropped_trajectories"))
        failed |= bool(lost)
        out.write(f"rtrace: {exported} trajectories written to {name}" + (f", {lost} LOST" if lost else "") + "\n")
    out.write(f"rollouts finished in {elapsed:.1f}s\n\nOpen what it wrote:\n")
    for command, what in open_commands(where):
        out.write(f"  {command}\n      {what}\n")
    out.flush()
    if not flushed or failed:
        err.write("rtrace demo: some traces were not written (see the counts above)\n")
        return 1
    return 0
