"""Detokenization of request outputs, with stop strings.

Text is produced with the prefix/read-offset technique: each step decodes a short
window of token ids twice, once up to `read_offset` (text already emitted) and once to
the end, and emits the difference. The window starts at `prefix_offset`, a few tokens
back, so tokenizer effects that depend on the neighbouring token (sentencepiece's
leading-space strip, byte-level tokens that split a UTF-8 character) come out right.
A window whose text ends in U+FFFD holds an incomplete character and is not emitted
until a later token completes it.

Outputs nobody reads before they finish skip all of that: `detokenize_finished` decodes
each one once, batched, and proves per request that one decode gives exactly the text the
windows would have built (`TokenizerInfo`); where it cannot, it replays the windows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine.sampling_params import SamplingParams

# Prompt tokens used as decoding context for the first output tokens (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

# Decoders (tokenizers library) under which a window's text past its first token does not depend on
# where the window starts, so the windows' pieces add up to one decode of the whole output. The
# "first token" ones render a window's first token differently (Metaspace and Strip drop a leading
# space; no decoder joins tokens with spaces), which is the same only when that token is not skipped.
_CONTEXT_FREE_DECODERS = {"ByteLevel", "ByteFallback", "Fuse"}
_FIRST_TOKEN_DECODERS = {"Metaspace"}


def _classify_decoder(node: dict | None) -> tuple[bool, bool]:
    """(whole decodes are exact, a skipped special token may not start a window) for a decoder's JSON."""
    if node is None:
        return True, True  # tokens joined with " "
    kind = node.get("type")
    if kind == "Sequence":
        parts = [_classify_decoder(d) for d in node.get("decoders", [])]
        return all(ok for ok, _ in parts), any(first for _, first in parts)
    if kind in _CONTEXT_FREE_DECODERS:
        return True, False
    if kind in _FIRST_TOKEN_DECODERS:
        return True, True
    if kind == "Replace":  # per token; a one-character pattern cannot span tokens even after Fuse
        pattern = node.get("pattern", {})
        return isinstance(pattern.get("String"), str) and len(pattern["String"]) == 1, False
    if kind == "Strip":  # trimming the end would change text already emitted
        return node.get("stop", 1) == 0, True
    return False, True


class TokenizerInfo:
    """What detokenization needs to know about a tokenizer, computed once per engine (not per request),
    and the decoded text of single tokens (logprob entries), cached by token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.added_ids = frozenset(tokenizer.get_added_vocab().values())
        # The Rust tokenizer behind a fast HF tokenizer decodes the same text without transformers'
        # per-call argument conversion (this runs for every token of every streamed request).
        backend = getattr(tokenizer, "_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.backend = backend if backend is not None and not cleans_up else None
        self.backend_decode: Callable[..., str] | None = None if self.backend is None else self.backend.decode
        self.whole_decode_exact, self.first_token_sensitive = False, True
        if self.backend is not None:
            decoder = self.backend.decoder
            try:
                state = None if decoder is None else json.loads(decoder.__getstate__())
            except (TypeError, ValueError, AttributeError):  # a decoder we cannot read: decode window by window
                state = {"type": "unknown"}
            self.whole_decode_exact, self.first_token_sensitive = _classify_decoder(state)
        self._spaced: dict[tuple[bool, bool], frozenset[int]] = {}
        self._token_text: dict[int, str] = {}

    def spaced_ids(self, params: SamplingParams) -> frozenset[int]:
        """Added tokens that `spaces_between_special_tokens` separates from their neighbours' text."""
        key = (params.skip_special_tokens, params.spaces_between_special_tokens)
        spaced = self._spaced.get(key)
        if spaced is None:
            spaced = frozenset()
            if params.spaces_between_special_tokens:
                spaced = self.added_ids - self.special_ids if params.skip_special_tokens else self.added_ids
            self._spaced[key] = spaced
        return spaced

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]:
        if self.backend is not None:
            return self.backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """`tokenizer.decode([t])` for each id (a logprob entry's decoded_token): cached ids from the
        cache, the others in one batched decode."""
        cache = self._token_text
        missing = list({t for t in token_ids if t not in cache})
        if missing:
            for t, text in zip(missing, self.decode_batch([[t] for t in missing], skip_special_tokens=False)):
                cache[t] = text
        return [cache[t] for t in token_ids]


def prompt_context(prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt's last tokens that shape the text of the first output tokens."""
    return list(prompt_token_ids[-(_PROMPT_CONTEXT_TOKENS + 1) :])


class IncrementalDetokenizer:
    """Builds `output_text` as tokens arrive and checks `params.stop` over it."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams, info: TokenizerInfo | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the output, if any
        self._enabled = params.detokenize
        self._skip_special = params.skip_special_tokens
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        # Text held back while streaming so a stop string is never partly emitted.
        self._stop_buffer = (
            self._max_stop_len - 1 if params.stop and not params.include_stop_str_in_output else 0
        )
        self._last_output_offset = 0
        # Stop strings (like EOS and stop tokens) only end the output once it has min_tokens tokens.
        self._min_tokens = params.min_tokens
        self.num_output_tokens = 0  # tokens taken by update(), up to and including a stop string's last
        if not self._enabled:
            return
        info = info if info is not None else TokenizerInfo(tokenizer)
        self._special_ids = info.special_ids
        self._backend_decode = info.backend_decode
        self._spaced_ids = info.spaced_ids(params)
        context = prompt_context(prompt_token_ids)
        self._ids: list[int] = context
        self._prefix_offset = max(len(context) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(context)

    @property
    def finished_by_stop(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        if not self._spaced_ids or self._spaced_ids.isdisjoint(ids):
            if self._backend_decode is not None:
                return self._backend_decode(ids, skip_special_tokens=self._skip_special)
            return self.tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        # Decode the runs between added tokens separately and join them with spaces.
        segments: list[str] = []
        run: list[int] = []
        for t in ids:
            if self._skip_special and t in self._special_ids:
                continue
            if t in self._spaced_ids:
                if run:
                    segments.append(self.tokenizer.decode(run, skip_special_tokens=self._skip_special))
                    run = []
                segments.append(self.tokenizer.decode([t], skip_special_tokens=False))
            else:
                run.append(t)
        if run:
            segments.append(self.tokenizer.decode(run, skip_special_tokens=self._skip_special))
        return " ".join(segments)

    def _pending_text(self) -> tuple[str, bool]:
        """Text of the tokens past `read_offset`, and whether it is complete (no split char)."""
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text):
            return "", False
        return new_text[len(prefix_text) :], not new_text.endswith(_REPLACEMENT_CHAR)

    def _advance(self) -> str:
        text, complete = self._pending_text()
        if not complete:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens one at a time and extend `output_text`; return the stop string if one matched
        (output_text is then truncated at it, and the tokens after the one that completed it are not
        taken: `num_output_tokens` counts up to that token), else None.

        A stop string counts only if it ends in text that arrived once the output had at least
        `min_tokens` tokens; text before that is ordinary output.
        """
        if not self._enabled or self.stop_reason is not None:
            return None
        check_from = len(self.output_text)  # matches must end past this point
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.num_output_tokens += 1
            self.output_text += self._advance()
            if self.num_output_tokens < self._min_tokens:
                check_from = len(self.output_text)
            elif self.params.stop and len(self.output_text) > check_from:
                stop = self._check_stop(check_from)
                if stop is not None:
                    return stop
                check_from = len(self.output_text)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        # Earliest match that ends in the new text (earlier text was already checked).
        best: tuple[int, int, str] | None = None
        for stop in self.params.stop:
            pos = self.output_text.find(stop, max(0, old_len - len(stop) + 1))
            if pos >= 0 and (best is None or (pos, len(stop)) < best[:2]):
                best = (pos, len(stop), stop)
        if best is None:
            return None
        pos, length, stop = best
        end = pos + length if self.params.include_stop_str_in_output else pos
        self.output_text = self.output_text[:end]
        self.stop_reason = stop
        return stop

    def _flush(self) -> None:
        """At the end of the request, emit text held back for an incomplete character
        (it decodes to U+FFFD, exactly as a full decode would show it)."""
        if not self._enabled or self.stop_reason is not None:
            return
        text, _ = self._pending_text()
        self.output_text += text
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: all so far (delta=False) or only what was not returned before.
        Until finished, the last (longest stop string - 1) characters are held back."""
        if finished:
            self._flush()
        buffer = 0 if finished or self.stop_reason is not None else self._stop_buffer
        length = max(len(self.output_text) - buffer, 0)
        if not delta:
            return self.output_text[:length]
        start = self._last_output_offset
        if length <= start:
            return ""
        self._last_output_offset = length
        return self.output_text[start:length]


def streamed_text_of_first_tokens(text: str, stop: list[str] | None = None,
                                  include_stop_str_in_output: bool = False) -> str:
    """What a stream shows of a finished short output's `text` had it not finished yet: nothing of an
    incomplete character, and not the last (longest stop string - 1) characters. A prefill/decode
    client streams this for the prefill's token; the decode engine's continuation streams the rest."""
    if text.endswith(_REPLACEMENT_CHAR):
        return ""
    buffer = max(len(s) for s in stop) - 1 if stop and not include_stop_str_in_output else 0
    return text[: max(0, len(text) - buffer)]


def _whole_decode_allowed(info: TokenizerInfo, window: list[int], output: Sequence[int],
                          params: SamplingParams) -> bool:
    """Whether one decode of the window gives the text that decoding it window by window gives (the
    text itself is checked too, in `detokenize_finished`)."""
    if not info.whole_decode_exact:
        return False
    spaced = info.spaced_ids(params)
    if spaced and not spaced.isdisjoint(window):
        return False  # those are decoded run by run, joined with spaces
    # A later window starts at an output token; a skipped special there would leave the next token first.
    return not (info.first_token_sensitive and params.skip_special_tokens
                and not info.special_ids.isdisjoint(output[:-1]))


def detokenize_finished(info: TokenizerInfo, requests: Sequence[tuple[Sequence[int], Sequence[int], SamplingParams]]
                        ) -> list[str]:
    """The final text of finished requests, each given as (prompt token ids, output token ids, params)
    and without stop strings: exactly what `IncrementalDetokenizer` fed the output one token at a
    time gives at the end. Requests whose text one decode provably gives are decoded together, two
    sequences each (the context window, and the window with the output), in one batched call per
    skip_special_tokens value; the others are replayed window by window."""
    texts: list[str | None] = [None] * len(requests)
    batches: dict[bool, tuple[list[int], list[list[int]]]] = {}
    for i, (prompt_ids, output_ids, params) in enumerate(requests):
        if params.stop:
            raise ValueError("detokenize_finished: requests with stop strings are detokenized incrementally")
        context = prompt_context(prompt_ids)
        head = context[max(len(context) - _PROMPT_CONTEXT_TOKENS, 0) :]
        window = head + list(output_ids)
        if _whole_decode_allowed(info, window, output_ids, params):
            indices, sequences = batches.setdefault(params.skip_special_tokens, ([], []))
            indices.append(i)
            sequences += [head, window]
    for skip, (indices, sequences) in batches.items():
        decoded = info.decode_batch(sequences, skip_special_tokens=skip)
        for k, i in enumerate(indices):
            prefix, full = decoded[2 * k], decoded[2 * k + 1]
            # A split character (U+FFFD) in the output, or where the prompt ends, makes the windows' text
            # depend on where they start: replay those. (The context may begin inside a character: the
            # windows and the whole decode start at the same token.)
            if full.startswith(prefix) and not prefix.endswith(_REPLACEMENT_CHAR):
                text = full[len(prefix) :]
                if _REPLACEMENT_CHAR not in text:
                    texts[i] = text
    for i, text in enumerate(texts):
        if text is None:
            prompt_ids, output_ids, params = requests[i]
            detokenizer = IncrementalDetokenizer(info.tokenizer, prompt_ids, params, info)
            detokenizer.update(output_ids)
            texts[i] = detokenizer.get_next_output_text(finished=True, delta=False)
    return texts  # type: ignore[return-value]
