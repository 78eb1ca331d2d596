"""The model the real vLLM serves in tests/gateway: the demo's trained tool-calling policy.

``rtrace demo``'s policy is a standard ``Qwen2ForCausalLM`` (hidden size 128, 4 heads: head
dim 32, which vLLM's CPU attention takes) trained in this repository to write
``<tool_call>`` blocks, with a byte-level BPE tokenizer built in code and a ChatML chat
template that renders tool calls. Written as a Hugging Face model folder (config,
float32 safetensors, tokenizer files with the chat template): nothing comes from a hub,
and vLLM's ``hermes`` tool parser turns its ``<tool_call>`` blocks into OpenAI tool calls,
so agents get real tool calls from a real server.
"""

from __future__ import annotations

import os

#: The name vLLM serves the model under (``--served-model-name``).
MODEL_NAME = "rtrace-demo-policy"


def write_model(path: str | os.PathLike) -> str:
    """Write the model folder to ``path`` (created); returns it as a string."""
    from rtrace.demo.model import load_model
    from rtrace.demo.tokenizer import build_tokenizer

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer()
    model, _ = load_model(tok)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":  # python -m tests.gateway.model DIR
    import sys

    print(write_model(sys.argv[1]))
