"""Engine output streams of one HTTP request: merging several prompts' streams, timing them for the
metrics, and collecting DELTA outputs into whole choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serving.request_stages import RequestStages
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

@dataclass
class EncodedPrompt:
    """One prompt of a request, tokenized: its position in the batch, its text (if given as text), its ids."""

    index: int
    text: str | None
    token_ids: list[int]


@dataclass
class RequestTimer:
    """Per-request latency bookkeeping for the metrics (TTFT, inter-token, e2e).

    `final_only`: the stream's outputs each merge the deltas of a checkpoint interval, or of the whole
    request (`OutputKind.CHECKPOINT`). Its first token is then dated from the engine's own
    record (`RequestOutput.metrics`): it came as long before the first output as the engine's last token
    in that output came after its first; the first output's tokens count as equal gaps over the engine's
    decode time up to it. In every stream, the tokens of a later output (several when merged: final_only,
    a stream interval, a reader that fell behind) count as equal gaps over the time since the one before."""

    metrics: ServingMetrics
    prompt_tokens: int
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    generated: int = 0
    finish_reason: str | None = None
    final_only: bool = False
    # Overhead metrics and tracing: the HTTP request's stages, the engines' own records (by arrival time:
    # a PD request has a prefill leg and a decode leg), and what to call when the engine request finished.
    stages: RequestStages | None = None
    legs: dict[float, RequestMetrics] = field(default_factory=dict)
    on_finish: Callable[[RequestTimer], None] | None = None

    def ordered_legs(self) -> list[RequestMetrics]:
        return [self.legs[k] for k in sorted(self.legs)]

    def on_output(self, output: RequestOutput) -> None:
        if self.stages is not None:
            self.stages.on_output(output)
        if output.metrics is not None:
            self.legs[output.metrics.arrival_time] = output.metrics
        now = time.perf_counter()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens:
            decode_s = self._engine_decode_time(output) if self.first is None and self.final_only else None
            if decode_s is not None:
                self.first = max(self.start, now - decode_s)
                self.metrics.observe_first_token(self.first - self.start)
                gap = (now - self.first) / max(1, num_tokens - 1)
                for _ in range(num_tokens - 1):
                    self.metrics.observe_inter_token(gap)
            elif self.first is None:
                self.first = now
                self.metrics.observe_first_token(now - self.start)
            else:  # an output of several tokens (merged: final_only, a stream interval, a lagging reader)
                gap = (now - self.last) / num_tokens  # type: ignore[operator]
                for _ in range(num_tokens):
                    self.metrics.observe_inter_token(gap)
            self.last = now
            self.generated += num_tokens
        for c in output.outputs:
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
        if output.finished:
            if self.generated > 1 and self.first is not None and self.last is not None:
                self.metrics.observe_time_per_output_token((self.last - self.first) / (self.generated - 1))
            self.metrics.observe_finished(now - self.start, self.prompt_tokens, self.generated, self.finish_reason)
            if self.on_finish is not None:
                self.on_finish(self)

    @staticmethod
    def _engine_decode_time(output: RequestOutput) -> float | None:
        """Seconds between the engine's first token and its last one in `output` (None when the output
        carries no engine timings: then it is timed on arrival, like a delta)."""
        m = output.metrics
        if m is None or m.first_token_time is None or m.last_token_time is None:
            return None
        return max(0.0, m.last_token_time - m.first_token_time)


class RequestFailedError(RuntimeError):
    """The engine finished this request with an error (finish_reason "error"): it failed alone, inside
    a step, while the rest of its batch went on. The client gets an error, never that finish reason."""


async def timed(stream: AsyncIterator[RequestOutput], timer: RequestTimer) -> AsyncIterator[RequestOutput]:
    """Pass a stream through, feeding each output to `timer`; an output that carries an engine error
    ends the stream with `RequestFailedError`."""
    try:
        async for output in stream:
            timer.on_output(output)
            if output.error is not None:
                raise RequestFailedError(output.error)
            yield output
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def chain(first: tuple[int, RequestOutput], rest: AsyncIterator) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The first (already awaited) item, then the rest of the stream."""
    yield first
    async for item in rest:
        yield item


@dataclass
class CollectedChoice:
    """One choice's DELTA outputs joined: the whole output and, for the request, its prompt index."""

    prompt_index: int
    output: CompletionOutput
    texts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass
class Collected:
    """Every choice of a request, by choice index (prompt index * n + the engine's index)."""

    choices: dict[int, CollectedChoice] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output.token_ids) for c in self.choices.values())


async def collect(first: tuple[int, RequestOutput], rest: AsyncIterator, n: int) -> Collected:
    """Join a request's DELTA outputs (from `merge_streams`) into whole choices."""
    result = Collected()
    async for i, output in chain(first, rest):
        if output.prompt_logprobs and i not in result.prompt_logprobs:
            result.prompt_logprobs[i] = output.prompt_logprobs
        for c in output.outputs:
            idx = i * n + c.index
            choice = result.choices.get(idx)
            if choice is None:
                whole = CompletionOutput(idx, "", [], None, [] if c.logprobs is not None else None)
                choice = result.choices[idx] = CollectedChoice(i, whole)
            acc = choice.output
            choice.texts.append(c.text)
            acc.token_ids.extend(c.token_ids)
            if c.logprobs is not None and acc.logprobs is not None:
                acc.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    return result
