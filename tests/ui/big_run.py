"""A generated run of 1,000,000 trajectories in the dataset's schema, for ``rtrace serve`` at scale.

Written with pyarrow directly (the dataset's own schema, ``rtrace.dataset.schema``; the
files the parquet sink leaves when the run is over: every 32 finished training steps one
file of ``trajectories/train/steps/`` (a row group per step), the last 8 steps and the
validation steps a file each in their ``step=N`` folders), in about a minute, instead of
hours through the pipeline: 1,000 training steps x 125 prompts
x 8 rollouts (GRPO groups), and a validation step of 125 rollouts every 100 steps. Each
rollout has a prompt from a pool of 2,000 that recur across steps, an answer, a reward
made of two components (``reward/accuracy``, ``reward/format`` as TRL records them),
``correct``, a group-normalised advantage, a response length (truncated at 512 tokens), a
latency, the train-inference mismatch annotations, 1% health findings; two spans (the
rollout, its generation). The generations of every 50th step carry per-token values
(``logprob``, ``old_logprob``, ``advantage``, ``loss_mask``) and their token texts.

Built once and cached (``ensure()``: ``$RTRACE_UI_CACHE`` or ``~/.cache/rtrace``; a marker
file says it is whole). ``python tests/ui/big_run.py [--n 1000000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

VERSION = 2  # bump when the generated data changes: the cache is keyed by it (2: files of steps/)
PROMPTS, ROLLOUTS, POOL = 125, 8, 2000
MAX_TOKENS = 512
SYSTEM = "You are a careful math assistant. Think step by step, then give the final answer."
WRITER = "5e7e5e7e5e7e5e7e"
STEPS_PER_FILE = 32  # rtrace.dataset.writer.DatasetWriter.STEPS_PER_FILE


def cache_root() -> Path:
    return Path(os.environ.get("RTRACE_UI_CACHE") or Path.home() / ".cache" / "rtrace")


def ensure(n: int = 1_000_000) -> Path:
    """The run's folder, generated the first time (and again when VERSION changes)."""
    root = cache_root() / f"serve-big-v{VERSION}-{n}"
    run = root / "big"
    if not (root / "complete").exists():
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        write_run(run, n)
        (root / "complete").write_text(json.dumps({"trajectories": n}))
    return run


def _task(i: int) -> str:
    a, b = 3 + i % 47, 5 + (i * 7) % 91
    return (f"Question {i}: a farmer packs {a} crates of {b} apples each and sells {a + b} apples at the market. "
            f"How many apples are left? Give the number.")


_BODIES: dict[int, str] = {}


def _body(length: int) -> str:
    """An answer's reasoning of about ``length`` tokens (cached by length)."""
    text = _BODIES.get(length)
    if text is None:
        text = _BODIES[length] = ("Each crate holds the same number of apples, so I multiply and then subtract what "
                                  "was sold. " * (1 + length // 60))[: max(20, length * 2)].strip()
    return text


def _messages(tasks: list[str], answers: list[str], dtype):
    """The conversations (system, user, assistant) as one Arrow list array, built column-wise."""
    import pyarrow as pa

    n = len(tasks)
    content = [x for pair in zip([SYSTEM] * n, tasks, answers) for x in pair]
    struct = dtype.value_type
    children = [pa.array(np.tile(np.array(["system", "user", "assistant"], object), n), pa.string()),
                pa.array(content, pa.string())]
    children += [pa.nulls(3 * n, f.type) for f in list(struct)[2:]]
    values = pa.StructArray.from_arrays(children, fields=list(struct))
    return pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)), values).cast(dtype)


def _maps(keys: list[str], values: list[np.ndarray], n: int, dtype):
    import pyarrow as pa

    offsets = np.arange(0, (n + 1) * len(keys), len(keys), dtype=np.int32)
    flat_keys = pa.array(np.tile(np.array(keys, dtype=object), n), pa.string())
    flat_vals = pa.array(np.stack(values, axis=1).reshape(-1), dtype)
    return pa.MapArray.from_arrays(pa.array(offsets), flat_keys, flat_vals)


def _empty_maps(n: int, dtype):
    import pyarrow as pa

    return pa.MapArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], pa.string()),
                                   pa.array([], dtype))


def _step(rng: np.random.Generator, step: int, validate: bool, t0_ns: int, tokens_on: bool):
    """One step's two tables."""
    import pyarrow as pa

    from rtrace.dataset.schema import SPANS, TRAJECTORIES, arrow_schema

    n_prompts = PROMPTS
    rollouts = 1 if validate else ROLLOUTS
    n = n_prompts * rollouts
    prompt_ids = rng.choice(POOL, n_prompts, replace=False) if not validate else np.arange(POOL, POOL + n_prompts)
    pid = np.repeat(prompt_ids, rollouts)
    sample = np.repeat(np.arange(n_prompts), rollouts)
    rollout_n = np.tile(np.arange(rollouts), n_prompts)
    difficulty = (pid * 2654435761 % 1000) / 1000.0
    skill = min(0.9, 0.25 + step / 1600)
    p_correct = np.clip(skill + 0.4 * (0.5 - difficulty), 0.02, 0.98)
    correct = rng.random(n) < p_correct
    fmt = rng.choice([0.0, 0.5, 1.0], n, p=[0.1, 0.2, 0.7])
    length = np.minimum(MAX_TOKENS, rng.lognormal(5.0, 0.6, n).astype(np.int64) + 8)
    truncated = length >= MAX_TOKENS
    correct &= ~truncated
    accuracy = correct.astype(np.float64)
    reward = accuracy + 0.2 * fmt
    groups = reward.reshape(n_prompts, rollouts)
    adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)).reshape(-1)
    duration = rng.lognormal(6.5, 0.5, n)  # ms
    trace_ids = [rng.bytes(16).hex() for _ in range(n)]
    span_ids = [rng.bytes(8).hex() for _ in range(2 * n)]
    values = pid * 3 + 11
    guess = np.where(correct, values, values + rng.integers(1, 9, n))
    answers = [f"{_body(int(k))} The answer is {g}." for k, g in zip(length, guess)]
    token_lists = [re.findall(r"\s*\S+", text) for text in answers] if tokens_on else []
    tasks = [_task(int(i)) for i in pid]
    verdict = np.where(truncated, "truncated", np.where(correct, "correct", "wrong")).astype(object)
    health = [None] * n
    unhealthy = rng.random(n) < 0.01
    for i in np.flatnonzero(unhealthy):
        health[i] = [{"check": "retokenization", "detail": f"turn 1: decoding the {int(length[i])} response ids and "
                      f"encoding the text gives {int(length[i]) - 1} ids, first different at 3"}]
    health = [h if h is not None else [] for h in health]
    k3 = rng.gamma(0.5, 0.002, n)
    start = t0_ns + np.cumsum(rng.integers(1_000_000, 5_000_000, n))
    end = start + (duration * 1e6).astype(np.int64)
    ts = pa.timestamp("ns", tz="UTC")

    def times(values) -> pa.Array:
        return pa.array(np.asarray(values, np.int64)).cast(ts)

    schema = arrow_schema(TRAJECTORIES)
    cols = {
        "run": pa.array(["big"] * n), "trace_id": pa.array(trace_ids), "name": pa.array(["rollout"] * n),
        "step": pa.array(np.full(n, step)), "validate": pa.array(np.full(n, validate)),
        "sample_index": pa.array(sample), "rollout_n": pa.array(rollout_n),
        "group_id": pa.array([f"s{step}-g{s}" for s in sample]), "policy_version": pa.array(np.full(n, step)),
        "experiment": pa.array(["big"] * n), "group_key": pa.array([f"s{step}-g{s}" for s in sample]),
        "reward": pa.array(reward), "advantage": pa.array(adv), "verdict": pa.array(verdict, pa.string()),
        "status": pa.array(["ok"] * n), "partial": pa.array(np.zeros(n, bool)),
        "finish_reason": pa.array(np.where(truncated, "length", "stop").astype(object), pa.string()),
        "truncated": pa.array(truncated), "kept": pa.array([[]] * n, pa.list_(pa.string())),
        "in_sample": pa.array(np.ones(n, bool)), "health": pa.array(health, schema.field("health").type),
        "num_turns": pa.array(np.ones(n, np.int32)), "num_tool_calls": pa.array(np.zeros(n, np.int32)),
        "num_spans": pa.array(np.full(n, 2, np.int32)), "dropped_spans": pa.array(np.zeros(n, np.int32)),
        "input_tokens": pa.array(np.full(n, 96)), "output_tokens": pa.array(length),
        "start_time": times(start), "end_time": times(end), "duration_ms": pa.array(duration),
        "generation_ms": pa.array(duration * 0.8), "tool_ms": pa.array(np.zeros(n)), "task": pa.array(tasks),
        "answer": pa.array(answers),
        "messages": _messages(tasks, answers, schema.field("messages").type),
        "extra_str": _maps(["prompt_id", "dataset"], [np.array([f"gsm8k-{i}" for i in pid], object),
                                                      np.array(["gsm8k"] * n, object)], n, pa.string()),
        "outcome_double": _maps(["reward/accuracy", "reward/format"], [accuracy, fmt], n, pa.float64()),
        "outcome_bool": _maps(["correct"], [correct], n, pa.bool_()),
        "outcome_int": _maps(["expected"], [values], n, pa.int64()),
        "annotations_double": _maps(["advantage", "logprob_mismatch_k1", "logprob_mismatch_k3", "logprob_mismatch_max",
                                     "logprob_mismatch_frac"],
                                    [adv, k3 * 0.9, k3, np.sqrt(k3) * 3, np.minimum(1, k3 * 5)], n, pa.float64()),
        "health_checks": pa.array([["token_continuity", "reward", "generation", "retokenization"]] * n,
                                  pa.list_(pa.string())),
    }
    traj = pa.table([cols[f.name] if f.name in cols else
                     (_empty_maps(n, f.type.item_type) if pa.types.is_map(f.type) else pa.nulls(n, f.type))
                     for f in schema], schema=schema)
    # spans: the rollout, then its generation
    sschema = arrow_schema(SPANS)
    gen_start = start + 200_000
    token_values = [None] * n
    response_tokens: list = [None] * n
    response_ids: list = [None] * n
    if tokens_on:
        for i in range(n):
            toks = token_lists[i]
            k = len(toks)
            lp = np.log(rng.uniform(0.05, 1.0, k)).astype(np.float32)
            old = (lp + rng.normal(0, 0.02 + 0.3 * (i % 97 == 0), k)).astype(np.float32)
            mask = np.ones(k, np.float32)
            mask[: min(2, k)] = 0
            token_values[i] = [{"name": "logprob", "values": lp.tolist()}, {"name": "old_logprob", "values": old.tolist()},
                               {"name": "advantage", "values": np.full(k, adv[i], np.float32).tolist()},
                               {"name": "loss_mask", "values": mask.tolist()}]
            response_tokens[i] = json.dumps(toks)
            response_ids[i] = list(range(1000, 1000 + k))
    both = lambda a, b: [x for pair in zip(a, b) for x in pair]  # noqa: E731
    m = 2 * n
    sc = {
        "run": pa.array(["big"] * m), "trace_id": pa.array(both(trace_ids, trace_ids)), "span_id": pa.array(span_ids),
        "parent_span_id": pa.array(both([None] * n, span_ids[0::2]), pa.string()),
        "name": pa.array(both(["rollout"] * n, ["chat toy-policy"] * n)),
        "kind": pa.array(both(["rollout"] * n, ["generation"] * n)),
        "start_time": times(both(start, gen_start)), "end_time": times(both(end, end - 100_000)),
        "duration_ms": pa.array(both(duration, duration - 0.3)), "status_code": pa.array(["ok"] * m),
        "step": pa.array(np.full(m, step)), "validate": pa.array(np.full(m, validate)),
        "sample_index": pa.array(np.repeat(sample, 2)), "rollout_n": pa.array(np.repeat(rollout_n, 2)),
        "group_id": pa.array([f"s{step}-g{s}" for s in np.repeat(sample, 2)]),
        "policy_version": pa.array(np.full(m, step)), "model": pa.array(both([None] * n, ["toy-policy"] * n), pa.string()),
        "input_tokens": pa.array(both([None] * n, [96] * n), pa.int64()),
        "output_tokens": pa.array(both([None] * n, length.tolist()), pa.int64()),
        "finish_reasons": pa.array(both([None] * n, [["length"] if t else ["stop"] for t in truncated]),
                                   pa.list_(pa.string())),
        "attributes_json": pa.array(both([[]] * n, [[("rtrace.response_tokens", t)] if t else [] for t in response_tokens]),
                                    pa.map_(pa.string(), pa.string())),
        "response_ids": pa.array(both([None] * n, response_ids), pa.list_(pa.int64())),
        "token_values": pa.array(both([None] * n, token_values), sschema.field("token_values").type),
    }
    spans = pa.table([sc[f.name] if f.name in sc else
                      (_empty_maps(m, f.type.item_type) if pa.types.is_map(f.type) else pa.nulls(m, f.type))
                      for f in sschema], schema=sschema)
    return traj, spans, int(end.max())


def write_run(path: Path, n: int = 1_000_000, seed: int = 7) -> Path:
    """Write a run of about ``n`` training trajectories (and validation) to ``path``."""
    import pyarrow.parquet as pq

    from rtrace.dataset.layout import FileName, partition_dir, steps_dir
    from rtrace.dataset.schema import SPANS, TRAJECTORIES

    rng = np.random.default_rng(seed)
    steps = max(1, n // (PROMPTS * ROLLOUTS))
    t0 = time.perf_counter()
    clock = 1_767_225_600 * 10**9
    seq = 0
    pending: list = []  # finished training steps not in a file yet: (step, number, trajectories, spans)

    def merge(chunk: list) -> None:
        name = FileName(WRITER, chunk[0][1], chunk[-1][1], steps=(chunk[0][0], chunk[-1][0]))
        for table, index in ((SPANS, 3), (TRAJECTORIES, 2)):
            folder = path / steps_dir(table, False)
            folder.mkdir(parents=True, exist_ok=True)
            with pq.ParquetWriter(folder / str(name), chunk[0][index].schema, compression="snappy") as writer:
                for part in chunk:  # a row group per step
                    writer.write_table(part[index], row_group_size=65536)

    for step in range(1, steps + 1):
        parts = [(False, step)] + ([(True, step)] if step % 100 == 0 else [])
        for validate, s in parts:
            traj, spans, clock = _step(rng, s, validate, clock, tokens_on=(s % 50 == 0 or s == steps))
            number = seq
            seq += 1
            if not validate and step <= steps - steps % STEPS_PER_FILE:
                pending.append((s, number, traj, spans))
                if len(pending) == STEPS_PER_FILE:
                    merge(pending)
                    pending = []
                continue
            name = f"{WRITER}-{number:06d}.v1.1.parquet"
            for table, data in ((SPANS, spans), (TRAJECTORIES, traj)):
                folder = path / partition_dir(table, validate, s)
                folder.mkdir(parents=True, exist_ok=True)
                pq.write_table(data, folder / name, compression="snappy", row_group_size=65536)
        if step % 100 == 0:
            print(f"  {step * PROMPTS * ROLLOUTS:,} trajectories in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--out", default=None, help="write here (default: the cache, once)")
    args = ap.parse_args()
    t = time.perf_counter()
    where = write_run(Path(args.out), args.n) if args.out else ensure(args.n)
    print(f"{where} ({time.perf_counter() - t:.0f} s)")
