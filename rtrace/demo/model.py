"""The demo's policy: a tiny causal LM with seeded random weights, generating on CPU.

Nothing is downloaded: the model is built from a transformers ``Qwen2Config`` (hidden
size 64, 2 layers, ~110k parameters) with weights drawn from a seeded generator, and
the tokenizer is :func:`rtrace.demo.build_tokenizer` (built in code). ``generate`` is
transformers' real ``generate`` on real token ids, so the traces show what a rollout
worker really sees: prompt ids in, sampled response ids and a finish reason out.

The weights are random: the text it produces is noise, and rewards are mostly 0. It
is a stand-in for a trained policy, small enough to run anywhere in seconds.

Requires the ``torch`` extra; torch and transformers are imported by :func:`build_policy`.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["Policy", "build_policy", "MODEL_NAME"]

#: Recorded as ``gen_ai.request.model`` on every generation span of the demo.
MODEL_NAME = "rtrace-demo/tiny-qwen2-random"


class Policy:
    """A model and its tokenizer behind an async, traced-friendly ``generate``.

    Generation runs in a one-thread executor so the asyncio loop keeps scheduling the
    other rollouts (tool calls, rewards) meanwhile, like a rollout worker talking to an
    inference server. Each call reseeds torch with its own ``seed``, so a rollout's
    tokens do not depend on how concurrent rollouts interleave.
    """

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 16) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop_ids = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtrace-demo-policy")

    async def generate(self, prompt_ids: list[int], seed: int, temperature: float = 1.0) -> dict[str, Any]:
        """Sample a response to ``prompt_ids``.

        Returns:
            ``{"response_ids": [...], "finish_reason": "stop" | "length"}``: the fields
            rtrace's generation spans read token ids and the finish reason from.
        """
        ids = list(prompt_ids)  # the caller may extend its list while we run
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._generate, ids, seed, temperature)

    def _generate(self, prompt_ids: list[int], seed: int, temperature: float) -> dict[str, Any]:
        import torch

        torch.manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=None,
                top_p=None,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_ids,
            )
        response = out[0, len(prompt_ids):].tolist()
        finish = "stop" if response and response[-1] in self.stop_ids else "length"
        return {"response_ids": response, "finish_reason": finish}

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def build_policy(seed: int = 0, max_new_tokens: int = 16, threads: int = 1) -> Policy:
    """Build the tokenizer and a randomly initialised tiny Qwen2 model, offline.

    Args:
        seed: seeds the weights (the same seed gives the same model on any machine).
        max_new_tokens: response length limit of each generation.
        threads: torch intra-op threads (the demo uses 1: it runs on small machines).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from .tokenizer import build_tokenizer

    hf_logging.set_verbosity_error()  # the random model triggers no useful warnings
    torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    return Policy(model, tokenizer, max_new_tokens=max_new_tokens)
