"""What a request's output stream looks like on its way from an engine actor to the coordinator.

A stream's prompt (its token ids and text) is the same in every output, and pickling it with every
delta costs O(prompt) per generated token. The engine actor sends it once, in the first output of the
stream (`PromptElider`); the coordinator puts it back into every later output (`PromptRestorer`), so
callers still see complete `RequestOutput`s. Prompt logprobs already travel once: a DELTA stream
carries them only in its first output.

`STREAM_BACKPRESSURE_OBJECTS` bounds how many outputs of one stream may wait, unread, between the
actor and its reader: the actor's generator pauses at that many, and meanwhile the engine's outputs
merge into one delta (`RequestOutput.add` in `AsyncLLM.generate`), so a slow reader gets fewer,
larger deltas instead of a pile of one object per step.

A request whose caller reads only its end (`final_only`: a non-streaming HTTP request) still leaves
the engine as deltas, so that the router knows what it generated and a migration continues it from
there (cluster/serve/migration.py) instead of starting over. `FinalOnlyBatcher` keeps its cost that of
one finished output: the engine runs it DELTA without per-step detokenization (unless stop strings need
the text as it grows; a FINAL_ONLY request detokenizes those incrementally too), its deltas go out
merged, one per `FINAL_ONLY_CHECKPOINT_S` (the most generation a migration loses), and the text of each
completion is decoded once, whole, into its finishing delta (joined with the empty texts before it:
the completion's text).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from pagedserve.engine.detokenizer import TokenizerInfo, detokenize_finished
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

# Outputs of one stream that may be produced and not yet read (Ray streaming-generator backpressure).
STREAM_BACKPRESSURE_OBJECTS = 4
# A final_only request's deltas go out merged, at most one output per this many seconds (and its finish).
FINAL_ONLY_CHECKPOINT_S = 1.0


class PromptElider:
    """Actor side: the first output of a stream keeps its prompt; later ones are sent without it."""

    def __init__(self) -> None:
        self._sent_prompt = False

    def __call__(self, output: RequestOutput) -> RequestOutput:
        if not self._sent_prompt:
            self._sent_prompt = True
            return output
        # A shallow copy: the engine's output (and its prompt list) is not ours to change.
        return dataclasses.replace(output, prompt=None, prompt_token_ids=[])


class PromptRestorer:
    """Coordinator side: remembers the first output's prompt and fills it into the later ones."""

    def __init__(self) -> None:
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] | None = None

    def __call__(self, output: RequestOutput) -> RequestOutput:
        if self._prompt_token_ids is None:
            self._prompt, self._prompt_token_ids = output.prompt, output.prompt_token_ids
            return output
        if not output.prompt_token_ids:
            output.prompt_token_ids = self._prompt_token_ids
            output.prompt = self._prompt
        return output


class FinalOnlyBatcher:
    """Engine host side: the DELTA outputs of a `final_only` request, merged into one output per
    checkpoint interval (and the finished one), texts decoded once at each completion's end."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, info: Callable[[], TokenizerInfo],
                 interval_s: float = FINAL_ONLY_CHECKPOINT_S) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.interval_s = interval_s
        # Decoded here at the end, not by the engine step by step (stop strings need the engine's text).
        self.decode_at_end = params.detokenize and not params.stop
        self._info = info
        self._resumed = list(params.resume_output_token_ids or ())  # a migrated request's earlier tokens
        self._token_ids: dict[int, list[int]] = {}
        self._pending: RequestOutput | None = None
        self._next_send = time.monotonic() + interval_s

    @property
    def engine_params(self) -> SamplingParams:
        """The params the engine runs the request with."""
        return self.params.model_copy(update={"detokenize": False}) if self.decode_at_end else self.params

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """Take the engine's next delta; returns what to send now (the merged deltas), or None."""
        for completion in output.outputs:
            if self.decode_at_end:
                ids = self._token_ids.setdefault(completion.index, [])
                ids.extend(completion.token_ids)
                if completion.finish_reason is not None:
                    completion.text = detokenize_finished(
                        self._info(), [(self.prompt_token_ids, self._resumed + ids, self.params)])[0]
        if self._pending is None:
            self._pending = output
        else:
            self._pending.add(output)
        now = time.monotonic()
        if not output.finished and now < self._next_send:
            return None
        self._next_send = now + self.interval_s
        merged, self._pending = self._pending, None
        return merged

    async def next_from(self, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Read `stream` until there is something to send (StopAsyncIteration at its end)."""
        async for output in stream:
            merged = self.add(output)
            if merged is not None:
                return merged
        raise StopAsyncIteration
