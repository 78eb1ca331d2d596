"""A training script as torchrun runs it (tests/test_collector.py): every rank is a
rollout worker configured only by the environment `rtrace collect` printed."""

import os

import rtrace

rank = int(os.environ["RANK"])


@rtrace.traced_generation
def generate(prompt_ids):
    return {"response_ids": [1, 2], "finish_reason": "stop"}


for step in range(2):
    for i in range(4):
        with rtrace.rollout_context(step=step, sample_index=rank * 4 + i, rollout_n=0):
            generate([1, 2, 3])
            rtrace.record_reward(float(rank))
