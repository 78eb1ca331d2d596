"""Per-token values at a trainer's scale: a step of 512 rollouts x 4,096 response tokens with
4 per-token arrays (issue 33's figure).

Each step: 512 traced rollouts (one 4,096-token generation each, with the sampler's
logprobs in its output, as an engine returns them), then the trainer's
``rtrace.annotate_batch`` with four [512, 4096] float32 torch tensors (old_logprob,
advantage, loss_mask, entropy) and the token mask. Measured:

- the trainer's thread: the annotate_batch call (target <= 5 ms per step);
- rtrace's worker thread: its CPU per step (/proc), the step's rollouts joined, checked
  for mismatch (k1, k3, max, share off), cut into the generations, and the kept ones
  written to JSONL (target: keeps up with a step every 10 s on one core);
- memory: the process's RSS after each step (bounded: only kept trajectories hold arrays).

    .venv/bin/python benchmarks/bench_token_values.py [STEPS] [CAP]     (CAP 0: keep all)
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rtrace  # noqa: E402
import rtrace._setup  # noqa: E402
from _machine import reference_line  # noqa: E402

B, T = 512, 4096
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@rtrace.traced_generation
def generate(prompt_ids, response_ids, logprobs):
    return {"response_ids": response_ids, "finish_reason": "stop", "logprobs": logprobs}


gc_ms: list[float] = []
_gc_start = [0.0]


def _gc_timer(phase: str, info: dict) -> None:
    # Python's cyclic GC runs on whatever thread allocates when a threshold is passed: in a
    # process holding millions of objects (the engines' logprob lists here) a full
    # collection can land in any call; the figure says how much of the call it was.
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        gc_ms.append((time.perf_counter() - _gc_start[0]) * 1e3)


def main() -> None:
    gc.callbacks.append(_gc_timer)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cap = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    print(reference_line())
    out = tempfile.mkdtemp()
    rtrace.configure(exporter="jsonl", jsonl_path=os.path.join(out, "t.jsonl"),
                     max_traces_per_step=cap or None, keep_mismatch=8 if cap else 0,
                     await_annotations="old_logprob", annotation_timeout_s=120, max_queue_size=1_000_000,
                     max_open_trajectories=100_000)
    worker = rtrace._setup._pipeline._worker
    rng = np.random.default_rng(0)
    prompt = list(range(100, 612))
    response = [int(x) for x in rng.integers(1000, 30000, T)]
    sampler = rng.normal(-1.0, 0.5, (B, T)).astype(np.float32)
    print(f"{B} rollouts x {T} response tokens x 4 arrays per step, cap {cap or 'none'}"
          + (", keep_mismatch 8" if cap else ""))
    print("step  annotate_batch (trainer thread)         worker CPU for the step  RSS")
    for step in range(steps):
        logprobs = [sampler[i].tolist() for i in range(B)]  # what an engine hands back: lists
        for i in range(B):
            with rtrace.rollout_context(step=step, sample_index=i // 8, rollout_n=i % 8):
                generate(prompt, response, logprobs[i])
                rtrace.record_reward(float(i % 2))
        old = torch.from_numpy(sampler + rng.normal(0, 0.01, (B, T)).astype(np.float32))
        arrays = {"old_logprob": old, "advantage": torch.randn(B, T), "loss_mask": torch.ones(B, T),
                  "entropy": torch.rand(B, T)}
        index = torch.arange(B) // 8
        rollout = torch.arange(B) % 8
        mask = torch.ones(B, T, dtype=torch.int64)
        before = thread_cpu_s(worker.native_id)
        gc_ms.clear()
        t0 = time.perf_counter()
        rtrace.annotate_batch(step=step, sample_index=index, rollout_n=rollout, token_mask=mask, **arrays)
        trainer_ms = (time.perf_counter() - t0) * 1e3
        paused = sum(gc_ms)
        del arrays, old, logprobs
        assert rtrace.flush(300)
        cpu = thread_cpu_s(worker.native_id) - before
        print(f"{step:4d}  {trainer_ms:8.2f} ms ({paused:5.1f} of it in GC)   {cpu:6.2f} s                 "
              f"{rss_mib():7.0f} MiB")
    stats = rtrace.stats()
    rtrace.shutdown()
    print(f"written {stats.get('trajectories_completed', 0)}; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"missing annotations {stats.get('trajectories_missing_annotations', 0)}")


if __name__ == "__main__":
    main()
