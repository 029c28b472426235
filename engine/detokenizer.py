"""Incremental detokenization of one request's output, with stop strings.

Text is produced with the prefix/read-offset technique: each step decodes a short
window of token ids twice, once up to `read_offset` (text already emitted) and once to
the end, and emits the difference. The window starts at `prefix_offset`, a few tokens
back, so tokenizer effects that depend on the neighbouring token (sentencepiece's
leading-space strip, byte-level tokens that split a UTF-8 character) come out right.
A window whose text ends in U+FFFD holds an incomplete character and is not emitted
until a later token completes it.
"""

from __future__ import annotations

from typing import Any

from pagedserve.engine.sampling_params import SamplingParams

# Prompt tokens used as decoding context for the first output tokens (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Builds `output_text` as tokens arrive and checks `params.stop` over it."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
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
        self._num_output_tokens = 0
        if not self._enabled:
            return
        self._special_ids = set(tokenizer.all_special_ids)
        # The Rust tokenizer behind a fast HF tokenizer decodes the same text without transformers'
        # per-call argument conversion (this runs for every token of every request).
        backend = getattr(tokenizer, "_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend_decode = backend.decode if backend is not None and not cleans_up else None
        # Added tokens (special or not) are spaced from neighbouring text when asked.
        self._spaced_ids: set[int] = set()
        if params.spaces_between_special_tokens:
            self._spaced_ids = set(tokenizer.get_added_vocab().values())
            if self._skip_special:
                self._spaced_ids -= self._special_ids
        context = list(prompt_token_ids[-(_PROMPT_CONTEXT_TOKENS + 1) :])
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

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens and extend `output_text`; return the stop string if one matched
        (output_text is then truncated at it), else None.

        A stop string counts only if it ends in text that arrived once the output had at least
        `min_tokens` tokens; text before that is ordinary output.
        """
        if not self._enabled or self.stop_reason is not None:
            return None
        check_from = len(self.output_text)  # matches must end past this point
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._num_output_tokens += 1
            self.output_text += self._advance()
            if self._num_output_tokens < self._min_tokens:
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
