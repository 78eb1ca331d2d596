"""A tiny chat tokenizer built offline, in code: no hub, no files, well under a second.

``build_tokenizer()`` trains a byte-level BPE with the ``tokenizers`` library on a small
in-code corpus of arithmetic and agent/tool-call text, and wraps it in a transformers
``PreTrainedTokenizerFast`` with ChatML special tokens and a ChatML chat template that
renders tool calls (Qwen-2.5 style ``<tool_call>`` blocks). Byte-level BPE covers every
byte, so any text round-trips through ``encode``/``decode`` exactly.

It is the tokenizer of the ``rtrace demo`` model and of the token2text tests. Requires
the ``torch`` extra (``transformers`` and ``tokenizers``), imported only when called.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["build_tokenizer", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "CORPUS"]

#: ChatML special tokens; the order fixes their ids (0..3).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
#: Tool-call markers: added as whole tokens but NOT special (like Qwen-2.5), so
#: ``skip_special_tokens=True`` keeps them in the decoded text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

#: ChatML with tools. Assistant messages may carry ``tool_calls`` (OpenAI format:
#: ``{"function": {"name", "arguments"}}``, arguments a dict or a JSON string); tool
#: results are ``role: "tool"`` messages, rendered as a user turn in <tool_response>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus() -> list[str]:
    """Deterministic training text: arithmetic word problems, agent turns, tool calls."""
    lines = [
        "You are a helpful assistant that solves math problems step by step.",
        "Use the calculator tool when you need to compute something.",
        "The answer is", "Let me think step by step.", "So the final answer is",
        "I will call the calculator.", "The result of the tool is", "Therefore",
        "Question: Natalia sold clips to 48 of her friends in April, and then she sold "
        "half as many clips in May. How many clips did Natalia sell altogether?",
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "system", "user", "assistant", "tool", "calculator", "search", "python",
        '{"name": "calculator", "arguments": {"expression": "48 / 2"}}',
        '{"name": "search", "arguments": {"query": "capital of France"}}',
        "reward correct incorrect rollout generation trajectory policy step sample",
        "#### 72", "\\boxed{72}", "<think>", "</think>",
    ]
    for a in range(0, 40, 3):
        for b in range(1, 30, 4):
            lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is {a + b}.")
            lines.append(f'{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}} -> {a * b}')
            lines.append(f"{a} - {b} = {a - b}, {a} * {b} = {a * b}")
    return lines


CORPUS = tuple(_corpus())


@lru_cache(maxsize=1)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: exact round-trips
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    # Serialised once per process; each build_tokenizer() call gets a fresh, independent object.
    return tok.to_str()


def build_tokenizer(vocab_size: int = 600) -> Any:
    """A fresh ``PreTrainedTokenizerFast`` (byte-level BPE, ChatML), built offline.

    Deterministic: the same vocabulary and merges on every call and machine. Special
    tokens: ``<|endoftext|>`` (eos, id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2),
    ``<|pad|>`` (pad, 3); ``<tool_call>`` ... are added, non-special tokens. The chat
    template is ChatML with tool calls (see :data:`CHAT_TEMPLATE`).

    Args:
        vocab_size: target vocabulary size of the BPE (special and added tokens excluded).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tokenizer_json(vocab_size))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.add_tokens(list(TOOL_TOKENS))
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"  # decoder-only generation pads on the left
    return tok
