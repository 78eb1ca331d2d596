"""The logprob_mismatch values of docs/token-values.md, computed from a trainer's own torch
tensors: the reference the real-trainer tests (tests/verl, tests/frameworks/test_trl.py)
compare rtrace's annotations with. Written from the doc, not from rtrace's code."""

from __future__ import annotations

import math


def mismatch_of(sampler, trainer, mask) -> dict[str, float]:
    """k1, k3, max |Δ| and the share of tokens whose ratio leaves [1/1.05, 1.05], over the
    tokens ``mask`` selects (float64, as rtrace computes them)."""
    import torch

    keep = mask.bool()
    s, t = sampler[keep].double(), trainer[keep].double()
    delta = t - s
    return {"logprob_mismatch_k1": (s - t).mean().item(),
            "logprob_mismatch_k3": (torch.expm1(delta) - delta).mean().item(),
            "logprob_mismatch_max": delta.abs().max().item(),
            "logprob_mismatch_frac": (delta.abs() > math.log(1.05)).double().mean().item()}
