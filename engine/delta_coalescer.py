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
"""

from __future__ import annotations

from pagedserve.engine.outputs import RequestOutput


class DeltaCoalescer:
    """One DELTA stream's outputs, held until a completion has `interval` unsent tokens."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {interval}")
        self.interval = interval
        self._held: RequestOutput | None = None
        self._unsent: dict[int, int] = {}  # completion index -> tokens held
        self._started: set[int] = set()  # completions whose first tokens went out

    def push(self, output: RequestOutput) -> RequestOutput | None:
        """Take the stream's next output; returns what to send now (the held outputs merged with it), or
        None while it is held."""
        urgent = output.finished or output.error is not None
        for completion in output.outputs:
            if completion.finish_reason is not None:
                urgent = True
            if completion.token_ids:
                if completion.index not in self._started:
                    self._started.add(completion.index)
                    urgent = True
                self._unsent[completion.index] = self._unsent.get(completion.index, 0) + len(completion.token_ids)
        if self._held is None:
            self._held = output
        else:
            self._held.add(output)
        if urgent or max(self._unsent.values(), default=0) >= self.interval:
            return self.flush()
        return None

    def flush(self) -> RequestOutput | None:
        """Whatever is held (None if nothing), e.g. before the stream ends with an error."""
        held, self._held = self._held, None
        self._unsent.clear()
        return held
