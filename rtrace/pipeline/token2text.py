"""token2text: decode captured token ids to text in the worker thread, a batch at a time.

The traced call only stores token ids (``SpanRecord.prompt_ids`` / ``response_ids``,
read out of the captured arguments and return value by the builder). Once per batch of
finished trajectories, :class:`Token2Text` gathers every span's prompt ids and makes ONE
``tokenizer.batch_decode`` call for them, then one for all response ids, and writes the
text to the span attributes ``rtrace.prompt_text`` / ``rtrace.response_text``. Unless
``token2text_keep_ids`` is set, the id lists are dropped afterwards.

Outputs too: a span other than a generation whose output is a dict with ``prompt_ids``
/ ``response_ids`` (or ``token_ids``) id lists (an agent loop returning veRL's
``AgentLoopOutput``) gets ``prompt_text`` / ``response_text`` next to them in its output,
as veRL's token2text shows them; the ids stay (they are the output). One more
``batch_decode`` for all of those.

The tokenizer is read at each batch through a callable handed in by ``rtrace._setup``,
which keeps the one set by ``configure(tokenizer=...)`` / ``RTRACE_TOKENIZER`` or
``rtrace.set_tokenizer()`` (the latest call wins), so it can be handed in before or
after ``configure()`` and from whichever object owns it.

A tokenizer failure never loses a trajectory: the spans keep their ids, the failure is
counted as ``token2text_errors`` and the trajectory is exported without text.

This module imports neither torch nor transformers: ``AutoTokenizer`` is imported only
when a tokenizer *name or path* has to be loaded.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _stats
from .._serialize import only_ints
from ..config import ConfigError
from ..trajectory import SpanRecord, Trajectory

__all__ = ["Token2Text", "check_tokenizer", "load_tokenizer", "PROMPT_TEXT", "RESPONSE_TEXT"]

#: Span attributes written by token2text.
PROMPT_TEXT = "rtrace.prompt_text"
RESPONSE_TEXT = "rtrace.response_text"
#: On a generation: the text the loop inserted between the previous turn's response and
#: this turn (a retry prompt, a user message), when no tool ran between them: its prompt
#: ids continue the previous prompt + response with these tokens.
INSERTED_TEXT = "rtrace.inserted_text"
#: On a generation with per-token values (pipeline/tokens.py): each response token's own
#: text, in order (one entry per id), for views that colour tokens by a value.
RESPONSE_TOKENS = "rtrace.response_tokens"



def load_tokenizer(name_or_path: str) -> Any:
    """Load a tokenizer by hub name (from the local cache only) or local path.

    Raises:
        ConfigError: transformers is not installed, or nothing loadable is found locally.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"RTRACE_TOKENIZER={name_or_path!r} needs transformers (pip install 'rtrace[torch]'), "
            "or hand a tokenizer object to configure(tokenizer=...) / rtrace.set_tokenizer()") from None
    try:
        # Offline on purpose: tracing must never download anything. A trainer has its
        # tokenizer in the local cache already.
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, ... depending on what is missing
        raise ConfigError(
            f"RTRACE_TOKENIZER={name_or_path!r}: cannot load this tokenizer from a local path or the "
            f"local Hugging Face cache ({type(exc).__name__}: {exc}); accepted values: a local "
            "tokenizer directory or a hub name already in the cache") from None


def check_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` ready to decode: a name or path is loaded; an object must have
    ``batch_decode`` or ``decode``.

    Raises:
        TypeError: the object has neither ``batch_decode`` nor ``decode``.
        ConfigError: a name or path that cannot be loaded.
    """
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if tokenizer is not None and not (callable(getattr(tokenizer, "batch_decode", None))
                                      or callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"{type(tokenizer).__name__} has neither batch_decode nor decode")
    return tokenizer


#: Id lists in a span's output (a dict) and the key their text is written to.
OUTPUT_FIELDS = (("prompt_ids", "prompt_text"), ("response_ids", "response_text"))


def _ids(value: Any) -> bool:
    return type(value) is list and bool(value) and only_ints(value)


def _output_ids(output: dict[str, Any]) -> list[tuple[dict[str, Any], str, list[int]]]:
    """``(output, text key, ids)`` for the id lists of an output dict: ``prompt_ids`` ->
    ``prompt_text``, ``response_ids`` (else ``token_ids``) -> ``response_text``, unless the
    text key is there already."""
    found = []
    for source, target in OUTPUT_FIELDS:
        ids = output.get(source)
        if source == "response_ids" and ids is None:
            ids = output.get("token_ids")
        if target not in output and _ids(ids):
            found.append((output, target, ids))
    return found


def _inserted(traj: Trajectory) -> list[tuple[SpanRecord, list[int]]]:
    """``(generation, ids)`` for each turn whose prompt continues the previous turn's prompt
    and response with tokens no tool span accounts for (a retry prompt, a user message)."""
    out = []
    prev: SpanRecord | None = None
    for span in sorted(traj.spans, key=lambda s: s.start_ns):
        if span.kind == "tool":
            prev = None  # what follows a tool is the tool's turn
        elif span.kind == "generation":
            if prev is not None and span.prompt_ids is not None and prev.response_ids is not None:
                base = prev.prompt_ids + prev.response_ids
                ids = span.prompt_ids
                if len(ids) > len(base) and ids[:len(base)] == base:
                    out.append((span, ids[len(base):]))
                elif prev.response_ids and len(ids) >= len(base) and ids[:len(base) - 1] == base[:-1]:
                    out.append((span, ids[len(base) - 1:]))  # the reply's stop token left out
            prev = span if span.prompt_ids is not None and span.response_ids is not None else None
    return out


class Token2Text:
    """Postprocessor (worker thread): decodes a batch of trajectories' token ids.

    Args:
        skip_special_tokens: passed to ``batch_decode``.
        keep_ids: keep ``prompt_ids`` / ``response_ids`` on the spans after decoding.
        required: token2text was turned on (``token2text=True``): a batch with ids and no
            tokenizer is counted and warned about. False for the default (``token2text``
            unset): decode only when ``tokenizer()`` gives one (a trainer adapter handed
            it in), else do nothing, at the cost of one call per batch.
    """

    def __init__(self, tokenizer: Callable[[], Any], skip_special_tokens: bool = True,
                 keep_ids: bool = False, required: bool = True) -> None:
        #: returns the tokenizer to decode with (read at each batch: it may be set later)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep_ids = keep_ids
        self.required = required
        self._takes_kwarg: dict[int, bool] = {}  # id(tokenizer) -> accepts skip_special_tokens

    def __call__(self, trajectories: list[Trajectory]) -> None:
        """Decode every span's ids in place: one ``batch_decode`` per field for the batch."""
        if not self.required and self.tokenizer() is None:
            return  # token2text unset and no trainer's tokenizer: nothing to do, not even a walk
        prompts: list[SpanRecord] = []
        responses: list[SpanRecord] = []
        outputs: list[tuple[dict[str, Any], str, list[int]]] = []
        inserted: list[tuple[SpanRecord, list[int]]] = []
        for traj in trajectories:
            inserted.extend(_inserted(traj))
            for span in traj.spans:
                if span.prompt_ids is not None:
                    prompts.append(span)
                if span.response_ids is not None:
                    responses.append(span)
                if span.kind != "generation" and type(span.output) is dict:
                    outputs.extend(_output_ids(span.output))
        if prompts or responses or outputs or inserted:
            tok = self.tokenizer()
            if tok is None:
                _stats.incr("token2text_no_tokenizer", len(trajectories))
                _stats.warn_once("t2t-no-tokenizer", "rtrace token2text is on but no tokenizer is set: call "
                                 "rtrace.set_tokenizer(tok), configure(tokenizer=...) or set RTRACE_TOKENIZER; "
                                 "trajectories keep their token ids")
            else:
                pieces = [span for span in responses if span.token_values]
                if pieces:  # each token alone, before the id lists are dropped
                    self._pieces(tok, pieces)
                if inserted:  # before the id lists are dropped
                    for (span, _), text in zip(inserted, self._decode_all(tok, [ids for _, ids in inserted])):
                        if isinstance(text, str) and text.strip():
                            span.attributes[INSERTED_TEXT] = text
                self._field(tok, prompts, "prompt_ids", PROMPT_TEXT)
                self._field(tok, responses, "response_ids", RESPONSE_TEXT)
                self._outputs(tok, outputs)

    # ------------------------------------------------------------------ decoding
    def _field(self, tok: Any, spans: list[SpanRecord], field: str, attr: str) -> None:
        if not spans:
            return
        texts = self._decode_all(tok, [getattr(span, field) for span in spans])
        decoded = 0
        for span, text in zip(spans, texts):
            if not isinstance(text, str):
                continue  # failed: the span keeps its ids and is exported without text
            span.attributes[attr] = text
            decoded += 1
            if not self.keep_ids:
                setattr(span, field, None)
        _stats.incr("token2text_decoded", decoded)

    def _pieces(self, tok: Any, spans: list[SpanRecord]) -> None:
        """:data:`RESPONSE_TOKENS` of each span: one ``batch_decode`` of every token alone."""
        singles = [[t] for span in spans for t in span.response_ids]
        texts = self._decode_all(tok, singles)
        at = 0
        for span in spans:
            n = len(span.response_ids)
            got = texts[at:at + n]
            at += n
            if all(isinstance(t, str) for t in got):
                span.attributes[RESPONSE_TOKENS] = got

    def _outputs(self, tok: Any, outputs: list[tuple[dict[str, Any], str, list[int]]]) -> None:
        """The text of ids in outputs, next to them (one ``batch_decode`` for all of them)."""
        if not outputs:
            return
        texts = self._decode_all(tok, [one for _, _, one in outputs])
        decoded = 0
        for (output, key, _), text in zip(outputs, texts):
            if isinstance(text, str):
                output[key] = text
                decoded += 1
        _stats.incr("token2text_decoded", decoded)

    def _decode_all(self, tok: Any, ids: list[list[int]]) -> list[Any]:
        """One ``batch_decode`` for ``ids``; if it fails, one call per sequence, so one bad
        sequence (an id out of the vocabulary ...) costs only its own text (None, counted)."""
        try:
            texts = self._decode(tok, ids)
            if len(texts) != len(ids):
                raise ValueError(f"batch_decode returned {len(texts)} texts for {len(ids)} sequences")
            return texts
        except Exception:
            _stats.warn_once("t2t-batch", "rtrace token2text: batch_decode failed; decoding one by one",
                             exc_info=True)
        texts = []
        for one in ids:
            try:
                texts.append(self._decode(tok, [one])[0])
            except Exception:
                _stats.incr("token2text_errors")
                texts.append(None)
        return texts

    def _decode(self, tok: Any, ids: list[list[int]]) -> list[Any]:
        key = id(tok)
        batch = getattr(tok, "batch_decode", None)
        fn = batch if callable(batch) else None
        if self._takes_kwarg.get(key, True):
            try:
                if fn is not None:
                    return list(fn(ids, skip_special_tokens=self.skip_special_tokens))
                return [tok.decode(one, skip_special_tokens=self.skip_special_tokens) for one in ids]
            except TypeError as exc:
                if "skip_special_tokens" not in str(exc):
                    raise
                # A plain decoder without the keyword: remember, and call it without.
                self._takes_kwarg[key] = False
        if fn is not None:
            return list(fn(ids))
        return [tok.decode(one) for one in ids]
