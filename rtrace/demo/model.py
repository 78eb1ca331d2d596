"""The demo's policy: a tiny tool-calling Qwen2, trained in this repository, sampling on CPU.

Nothing is downloaded. The model is a transformers ``Qwen2ForCausalLM`` built from a
``Qwen2Config`` (:data:`ARCHITECTURE`: hidden size 128, 2 layers, 0.37M parameters)
whose weights are read from ``policy.safetensors`` next to this file. Those weights
were trained by :mod:`rtrace.demo.train` (``python -m rtrace.demo.train``:
deterministic, CPU, a few minutes) on synthetic tool-use dialogues in the exact chat
and ``<tool_call>`` format of :mod:`rtrace.demo.agent`. The tokenizer is
:func:`rtrace.demo.build_tokenizer` (built in code).

``generate`` samples real token ids from the model (a KV-cached decoding loop, softmax
at the given temperature, greedy at temperature 0), so the traces show what a rollout
worker really sees: prompt ids in, sampled response ids and a finish reason out.
Sampling draws from a private ``torch.Generator`` seeded per call: a rollout's tokens
do not depend on how concurrent rollouts interleave, and neither torch's global
generator nor Python's ``random`` (which OpenTelemetry draws trace ids from) is seeded
or consumed.

:meth:`Policy.update` is a policy-gradient (GRPO-style) step on sampled episodes, which
``rtrace demo`` runs after each training step.

Requires the ``torch`` extra; torch and transformers are imported by :func:`build_policy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["Policy", "build_policy", "MODEL_NAME", "ARCHITECTURE", "WEIGHTS_PATH", "new_model", "load_model",
           "save_model", "tokenizer_fingerprint", "recording"]

#: Recorded as ``gen_ai.request.model`` on every generation span of the demo.
MODEL_NAME = "rtrace-demo/tiny-qwen2-tools"
#: The trained weights shipped in the package (written by ``python -m rtrace.demo.train``).
WEIGHTS_PATH = Path(__file__).with_name("policy.safetensors")
#: The Qwen2 shape of the demo policy (vocabulary and special ids come from the tokenizer).
ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}

# (prompt_ids, response_ids) of every generation in the current episode, when recording.
_SAMPLES: contextvars.ContextVar[list | None] = contextvars.ContextVar("rtrace_demo_samples", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[list[int], list[int]]]]:
    """Collect the ``(prompt_ids, response_ids)`` of each :meth:`Policy.generate` call made
    in this context (one asyncio task: one episode) — the data of a policy-gradient step.
    Invisible to the traces."""
    samples: list[tuple[list[int], list[int]]] = []
    token = _SAMPLES.set(samples)
    try:
        yield samples
    finally:
        _SAMPLES.reset(token)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the vocabulary: the weights only make sense with the same tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def _config(tokenizer: Any, architecture: dict[str, int]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **architecture,
    )


def new_model(tokenizer: Any, seed: int, architecture: dict[str, int] | None = None) -> Any:
    """A freshly initialised model (the starting point of training), seeded by ``seed``.

    transformers initialises weights from torch's global generator; it is forked, so
    the caller's global random state is left as it was.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(_config(tokenizer, dict(architecture or ARCHITECTURE)))


def save_model(model: Any, tokenizer: Any, path: str | os.PathLike, architecture: dict[str, int],
               info: dict[str, Any]) -> None:
    """Write the weights as float16 safetensors; the architecture, the tokenizer's
    fingerprint and ``info`` (how it was trained) go in the file's metadata."""
    import torch
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # tied to the input embedding
    save_file(tensors, str(path), metadata={"architecture": json.dumps(architecture),
                                            "tokenizer": tokenizer_fingerprint(tokenizer),
                                            "info": json.dumps(info)})


def load_model(tokenizer: Any, path: str | os.PathLike = WEIGHTS_PATH) -> tuple[Any, dict[str, Any]]:
    """The trained model (float32, eval mode) and the metadata of its weights file."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen2ForCausalLM

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k).to(torch.float32) for k in f.keys()}
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise RuntimeError(f"{path} was trained with a different tokenizer than build_tokenizer() gives now; "
                           "retrain it with: python -m rtrace.demo.train")
    architecture = json.loads(meta["architecture"])
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the global RNG alone
        model = Qwen2ForCausalLM(_config(tokenizer, architecture))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{path} does not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    info = json.loads(meta.get("info", "{}"))
    return model.eval(), {"architecture": architecture, **info}


def sequence_logprobs(model: Any, samples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> list[Any]:
    """Per-token log-probabilities of each sample's response given its prompt (with grad).

    One right-padded batch; returns one 1-D tensor per sample (its response's length).
    """
    import torch

    lengths = [len(p) + len(r) for p, r in samples]
    width = max(lengths)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (p, r) in enumerate(samples):
        ids[i, :lengths[i]] = torch.tensor(list(p) + list(r))
        mask[i, :lengths[i]] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    # the logit at position t predicts token t+1: a response of n tokens after a prompt of m
    # is predicted by positions m-1 .. m+n-2
    return [logp[i, len(p) - 1: len(p) - 1 + len(r)] for i, (p, r) in enumerate(samples)]


class Policy:
    """A model and its tokenizer behind an async, traced-friendly ``generate``.

    Generation runs in a one-thread executor so the asyncio loop keeps scheduling the
    other rollouts (tool calls, rewards) meanwhile, like a rollout worker talking to an
    inference server. Each call samples from its own ``torch.Generator`` seeded with
    ``seed``, so a rollout's tokens do not depend on how concurrent rollouts interleave.
    """

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 48, info: dict[str, Any] | None = None,
                 learning_rate: float = 0.0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.info = info or {}
        self.learning_rate = learning_rate
        self.stop_ids = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
        self._optimizer: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtrace-demo-policy")

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    async def generate(self, prompt_ids: list[int], seed: int, temperature: float = 1.0) -> dict[str, Any]:
        """Sample a response to ``prompt_ids``.

        Returns:
            ``{"response_ids": [...], "finish_reason": "stop" | "length", "logprobs": [...]}``:
            the fields rtrace's generation spans read token ids, the finish reason and the
            sampler's per-token log-probabilities from (docs/token-values.md).
        """
        ids = list(prompt_ids)  # the caller may extend its list while we run
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._executor, self._generate, ids, seed, temperature)
        samples = _SAMPLES.get()
        if samples is not None:
            samples.append((ids, list(out["response_ids"])))
        return out

    def _generate(self, prompt_ids: list[int], seed: int, temperature: float) -> dict[str, Any]:
        import torch

        generator = torch.Generator().manual_seed(seed)
        response: list[int] = []
        logprobs: list[float] = []  # each sampled token's, as an inference engine returns them
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True,
                             logits_to_keep=1)
            for _ in range(self.max_new_tokens):
                logits = out.logits[0, -1].float()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                    logprobs.append(round(math.log(max(float(probs[token]), 1e-45)), 6))
                else:
                    token = int(logits.argmax())
                    logprobs.append(round(float(torch.log_softmax(logits, dim=-1)[token]), 6))
                response.append(token)
                if token in self.stop_ids:
                    break
                out = self.model(input_ids=torch.tensor([[token]], dtype=torch.long),
                                 past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        finish = "stop" if response and response[-1] in self.stop_ids else "length"
        return {"response_ids": response, "finish_reason": finish, "logprobs": logprobs}

    async def update(self, episodes: Sequence[tuple[Sequence[tuple[list[int], list[int]]], float]]) -> dict[str, float]:
        """One policy-gradient step (see :meth:`_update`), in the generation thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._update, list(episodes))

    def _update(self, episodes: list[tuple[Sequence[tuple[list[int], list[int]]], float]]) -> dict[str, float]:
        """REINFORCE with a group baseline (GRPO's advantage; no ratio clipping, as it is
        one step on fresh on-policy samples): minimise ``-sum(A * log p(token)) / tokens``
        over every response token of every episode with a non-zero advantage ``A``.

        Args:
            episodes: ``(samples, advantage)`` per episode, ``samples`` its
                ``(prompt_ids, response_ids)`` per generation (see :func:`recording`).

        Returns:
            ``episodes`` (with a non-zero advantage), ``loss``, and the mean per-token
            log-probability of the responses with a positive (``logp_pos``) and a negative
            (``logp_neg``) advantage before the step and after it (``*_after``): the
            step makes rewarded responses likelier and the others less likely.
        """
        import torch

        weighted = [(s, a) for samples, a in episodes if a != 0.0 for s in samples if s[1]]
        stats: dict[str, float] = {"episodes": sum(1 for _, a in episodes if a != 0.0), "loss": 0.0}
        if not weighted or self.learning_rate <= 0:
            return stats
        if self._optimizer is None:
            self._optimizer = torch.optim.Adam(self.model.parameters(), lr=self.learning_rate)
        batch = [s for s, _ in weighted]
        signs = [a > 0 for _, a in weighted]

        def mean_logp(logps: list[Any], positive: bool) -> float:
            chosen = [lp for lp, sign in zip(logps, signs) if sign == positive]
            return float(sum(lp.sum() for lp in chosen) / max(sum(len(lp) for lp in chosen), 1))

        self.model.train()
        logps = sequence_logprobs(self.model, batch, self.tokenizer.pad_token_id)
        tokens = sum(len(lp) for lp in logps)
        loss = -sum(a * lp.sum() for (_, a), lp in zip(weighted, logps)) / tokens
        self._optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self._optimizer.step()
        self.model.eval()
        detached = [lp.detach() for lp in logps]
        with torch.no_grad():
            after = sequence_logprobs(self.model, batch, self.tokenizer.pad_token_id)
        stats.update(loss=loss.item(), logp_pos=mean_logp(detached, True), logp_neg=mean_logp(detached, False),
                     logp_pos_after=mean_logp(after, True), logp_neg_after=mean_logp(after, False))
        return stats

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def build_policy(max_new_tokens: int = 48, threads: int = 1, learning_rate: float = 0.0,
                 weights: str | os.PathLike = WEIGHTS_PATH) -> Policy:
    """Build the tokenizer and load the trained tiny Qwen2 policy, offline.

    Args:
        max_new_tokens: response length limit of each generation.
        threads: torch intra-op threads (the demo uses 1: it runs on small machines).
        learning_rate: Adam learning rate of :meth:`Policy.update` (0: no updates).
        weights: the safetensors file (default: the one shipped in the package).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    from .tokenizer import build_tokenizer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model, info = load_model(tokenizer, weights)
    return Policy(model, tokenizer, max_new_tokens=max_new_tokens, info=info, learning_rate=learning_rate)
