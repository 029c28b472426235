"""Stream coalescing (vLLM's `--stream-interval`): a DELTA stream's outputs merged so that it carries at
most one output per `interval` generated tokens of a completion.

Every output a streamed request sends costs the same on its way out whatever it carries (a Ray
streaming-generator item, an SSE event through the HTTP proxy, a client parse), so sending one per N
tokens divides that cost by N. What a reader sees is otherwise the same: the merged output carries the
held outputs' text, token ids and logprobs concatenated in order (`RequestOutput.add`), so that
concatenating a stream's chunks gives exactly what interval 1 gives. A completion's first tokens go out
at once (time to first token is unchanged), and so do a finish (of a completion or of the request) and
an engine error.

The coalescer runs where the engine's outputs are handed to their stream (`AsyncLLM`, on the engine
thread), so that held outputs cost no wake-up of the reader either.

`stream_interval="auto"` follows the engine's load instead of a fixed N (`auto_interval`): one output per
token while at most `AUTO_STREAMS_PER_STEP` streams are open, and beyond that N grows with them (up to
`AUTO_MAX_INTERVAL`), so a step sends about that many stream outputs however many requests it runs. A
person chatting alone gets every token as it comes; a server saturated with streams stops spending the
engine's cores on per-token events (each one costs the same in the replica, the ingress, the proxy and
the client: on a 2-core machine that was a third of the served throughput at 64 streams).
"""

from __future__ import annotations

import dataclasses

from pagedserve.engine.outputs import CompletionOutput, RequestOutput

AUTO = "auto"
# With stream_interval="auto": stream outputs a step may send before the interval grows past 1, and the
# largest interval it grows to.
AUTO_STREAMS_PER_STEP = 16
AUTO_MAX_INTERVAL = 8


def validate_stream_interval(interval: int | str) -> int | str:
    """An interval >= 1 or "auto"; ValueError naming `stream_interval` otherwise."""
    if interval == AUTO or (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
        return interval
    raise ValueError(f"stream_interval: must be an integer >= 1 or {AUTO!r}, got {interval!r}")


def auto_interval(num_streams: int) -> int:
    """The interval "auto" runs at with `num_streams` coalesced streams open: ceil(streams / budget)."""
    return max(1, min(AUTO_MAX_INTERVAL, -(-num_streams // AUTO_STREAMS_PER_STEP)))


class DeltaCoalescer:
    """One DELTA stream's outputs, each completion held until it has `interval` unsent tokens (counted per
    completion: with n > 1 every choice gets at most one delta per `interval` of its own tokens)."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {interval}")
        self.interval = interval
        self._held: dict[int, CompletionOutput] = {}  # completion index -> its unsent deltas, merged
        self._started: set[int] = set()  # completions whose first tokens went out
        self._prompt_logprobs = None  # the stream's prompt logprobs, until an output carries them
        self._prompt_logprobs_sent = False
        self._last: RequestOutput | None = None

    def push(self, output: RequestOutput, interval: int | None = None) -> RequestOutput | None:
        """Take the stream's next output; returns what to send now (the due completions' held deltas merged
        with this one's), or None while everything is held. `interval`: this push's interval instead of the
        coalescer's own (stream_interval="auto": the engine's current one)."""
        interval = self.interval if interval is None else interval
        self._last = output
        if output.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            self._prompt_logprobs = output.prompt_logprobs
        due: set[int] = set()
        for completion in output.outputs:
            held = self._hold(completion)
            if completion.token_ids and completion.index not in self._started:
                self._started.add(completion.index)
                due.add(completion.index)  # a completion's first tokens go at once (time to first token)
            if held.finish_reason is not None or len(held.token_ids) >= interval:
                due.add(completion.index)
        if output.finished or output.error is not None:
            return self._send(set(self._held))
        return self._send(due) if due else None

    def flush(self) -> RequestOutput | None:
        """Everything held, as one output (None if nothing is), e.g. before the stream ends with an error."""
        return self._send(set(self._held)) if self._held else None

    def _hold(self, completion: CompletionOutput) -> CompletionOutput:
        held = self._held.get(completion.index)
        if held is None:  # a copy: the merge extends it, and the engine's output is not ours to change
            held = self._held[completion.index] = dataclasses.replace(
                completion, token_ids=list(completion.token_ids),
                logprobs=None if completion.logprobs is None else list(completion.logprobs))
            return held
        held.text += completion.text
        held.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            held.logprobs = (held.logprobs or []) + completion.logprobs
        held.cumulative_logprob = completion.cumulative_logprob  # a running figure: the latest is the whole
        held.finish_reason, held.stop_reason = completion.finish_reason, completion.stop_reason
        return held

    def _send(self, due: set[int]) -> RequestOutput:
        last = self._last
        assert last is not None
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        self._prompt_logprobs_sent = self._prompt_logprobs_sent or prompt_logprobs is not None
        outputs = [self._held.pop(index) for index in sorted(due)]
        return dataclasses.replace(last, outputs=outputs, prompt_logprobs=prompt_logprobs)
