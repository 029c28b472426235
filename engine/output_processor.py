"""Turns the engine core's per-step token outputs into user-facing `RequestOutput`s.

Owns detokenization, stop strings, logprob bookkeeping, and the fan-in of `n > 1` child
requests into one output with n completions.

Work is done only for outputs someone reads this step. A request whose output nobody reads
before it finishes (FINAL_ONLY, CHECKPOINT) and that has no stop strings is not detokenized while
it runs: its text is decoded once when it finishes, batched with the other requests finishing in
the same step. Streams (DELTA, CUMULATIVE) and requests with stop strings are detokenized
incrementally. Logprob entries stay raw (ids, floats) until an output carries them; then the
step's entries are decoded in one batched call (cached per token id).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, detokenize_finished
from pagedserve.engine.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

# One position's raw logprob entries from the engine core: (token_id, logprob, rank), sampled token first.
RawLogprobs = list[tuple[int, float, int]]


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request is done (LLM.generate)
    # Deltas, at most one per checkpoint interval (and the finished one), the text decoded once into the
    # finishing delta (the deltas before it carry token ids and ""): for a caller that reads only the end
    # but must know what was generated so far (a serving router that continues the request elsewhere if
    # this engine dies), at about the cost of FINAL_ONLY.
    CHECKPOINT = 3


# OutputKinds whose outputs carry only what is new; those whose reader does not see the text grow.
DELTA_KINDS = (OutputKind.DELTA, OutputKind.CHECKPOINT)
READ_AT_END_KINDS = (OutputKind.FINAL_ONLY, OutputKind.CHECKPOINT)
# A CHECKPOINT request's default interval between outputs.
CHECKPOINT_INTERVAL_S = 1.0


RequestOutputKind = OutputKind  # vLLM's name


@dataclass
class ParentRequest:
    """An `n > 1` request: n child engine requests that report as one."""

    request_id: str
    n: int
    children: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0
    error: str | None = None  # the first child's error


@dataclass
class RequestState:
    request_id: str  # the engine request id (a child id when n > 1)
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    # None when the text is decoded once at the end (see the module docstring) or not at all.
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S
    next_checkpoint: float = 0.0  # a CHECKPOINT request reports nothing unfinished before this time
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Entries not yet turned into Logprob dicts (no output has carried them yet).
    raw_logprobs: list[RawLogprobs] = field(default_factory=list)
    raw_prompt_logprobs: list[RawLogprobs | None] = field(default_factory=list)
    final_text: str = ""  # the text of a request detokenized at the end
    num_tokens_returned: int = 0
    num_logprobs_returned: int = 0
    prompt_logprobs_returned: bool = False
    error: str | None = None  # the engine failed this request (finish_reason "error")
    kv_transfer_params: dict | None = None  # a prefill producer's hand-off to its decode reader

    @property
    def detokenized_at_end(self) -> bool:
        return self.detokenizer is None and self.params.detokenize


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._info: TokenizerInfo | None = None  # built on first use (a detokenize=False engine never needs it)

    @property
    def info(self) -> TokenizerInfo:
        if self._info is None:
            self._info = TokenizerInfo(self.tokenizer)
        return self._info

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        parent: ParentRequest | None = None,
        index: int = 0,
        prefilled_output_ids: list[int] = (),
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
    ) -> None:
        """`prefilled_output_ids`: a prefill/decode continuation's first output tokens, which its client
        already has: they count and shape the text (stop strings, detokenization) but DELTA outputs start
        after them (and carry no logprobs for them). `checkpoint_interval_s`: a CHECKPOINT request's
        seconds between outputs."""
        want_logprobs = params.logprobs is not None
        incremental = params.detokenize and (output_kind not in READ_AT_END_KINDS or bool(params.stop))
        detokenizer = None
        if incremental:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self.info)
        state = self.states[request_id] = RequestState(
            request_id=request_id,
            index=index,
            parent=parent,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            output_kind=output_kind,
            detokenizer=detokenizer,
            metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if want_logprobs else None,
            cumulative_logprob=0.0 if want_logprobs else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            checkpoint_interval_s=checkpoint_interval_s,
            next_checkpoint=time.time() + checkpoint_interval_s,
        )
        if prefilled_output_ids:
            state.token_ids = list(prefilled_output_ids)
            state.num_tokens_returned = len(state.token_ids)
            if detokenizer is not None:
                detokenizer.update(state.token_ids)
                detokenizer.get_next_output_text(finished=False, delta=True)  # already streamed

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the engine request ids stopped by a stop string
        (the engine core must finish those: it does not see text)."""
        stopped_by_string: list[str] = []
        to_report: list[tuple[RequestState, str | None, int | str | None]] = []
        now = time.time()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            self._record_metrics(state, out, now)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.error is not None:
                state.error = out.error
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.raw_prompt_logprobs.extend(out.new_prompt_logprobs)
            if out.new_token_ids:
                stop_str = self._append_tokens(state, out)
                if stop_str is not None:
                    if finish_reason is None:  # the engine core does not see text: it must be told
                        stopped_by_string.append(state.request_id)
                    # The text ends at the stop string even if the engine also hit a limit on that token.
                    finish_reason, stop_reason = "stop", stop_str
            elif finish_reason is None:
                continue  # a prefill chunk that only carried prompt logprobs
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.states[state.request_id]
            elif state.output_kind == OutputKind.FINAL_ONLY:
                continue  # nobody reads this request before it finishes
            elif state.output_kind == OutputKind.CHECKPOINT:
                if now < state.next_checkpoint:
                    continue  # its tokens go out with the next checkpoint
                state.next_checkpoint = now + state.checkpoint_interval_s
            to_report.append((state, finish_reason, stop_reason))
        self._materialize(to_report)
        request_outputs: list[RequestOutput] = []
        for state, finish_reason, stop_reason in to_report:
            request_output = self._make_output(state, finish_reason, stop_reason)
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs, stopped_by_string

    def _append_tokens(self, state: RequestState, out: EngineCoreOutput) -> str | None:
        """Take a step's new tokens (one, or several at once: speculative decoding, a continued
        request) and their logprobs. A stop string completed by one of them ends the output at that
        token, as if the tokens had come one per step: the later ones are dropped. Returns the stop
        string, if one matched."""
        new_ids = out.new_token_ids
        stop_str = None
        if state.detokenizer is not None:
            before = state.detokenizer.num_output_tokens
            stop_str = state.detokenizer.update(new_ids)
            if stop_str is not None:
                new_ids = new_ids[: state.detokenizer.num_output_tokens - before]
        state.token_ids.extend(new_ids)
        if out.new_logprobs is not None and state.logprobs is not None:
            entries = out.new_logprobs[: len(new_ids)]
            state.raw_logprobs.extend(entries)
            cumulative = state.cumulative_logprob
            for position in entries:  # added one by one: the same float as one token per step
                cumulative += position[0][1]
            state.cumulative_logprob = cumulative
        return stop_str

    def _materialize(self, to_report: list[tuple[RequestState, str | None, int | str | None]]) -> None:
        """Give the states about to report what their outputs carry: the final text of requests
        detokenized at the end (one batched decode), and Logprob dicts for the raw entries (their
        tokens decoded in one batched call)."""
        finishing = [state for state, finish_reason, _ in to_report
                     if finish_reason is not None and state.detokenized_at_end]
        if finishing:
            texts = detokenize_finished(self.info, [(s.prompt_token_ids, s.token_ids, s.params) for s in finishing])
            for state, text in zip(finishing, texts):
                state.final_text = text
        with_logprobs = [state for state, _, _ in to_report if state.raw_logprobs or state.raw_prompt_logprobs]
        if not with_logprobs:
            return
        token_ids = [tid for state in with_logprobs
                     for position in (*state.raw_prompt_logprobs, *state.raw_logprobs) if position is not None
                     for tid, _, _ in position]
        texts = iter(self.info.token_texts(token_ids))
        for state in with_logprobs:
            if state.raw_prompt_logprobs:
                state.prompt_logprobs.extend(
                    None if position is None else {tid: Logprob(lp, rank, next(texts)) for tid, lp, rank in position}
                    for position in state.raw_prompt_logprobs
                )
                state.raw_prompt_logprobs = []
            if state.raw_logprobs:
                state.logprobs.extend(
                    {tid: Logprob(lp, rank, next(texts)) for tid, lp, rank in position}
                    for position in state.raw_logprobs
                )
                state.raw_logprobs = []

    def _record_metrics(self, state: RequestState, out: EngineCoreOutput, now: float) -> None:
        m = state.metrics
        if out.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        m.num_preemptions = out.num_preemptions
        m.num_cached_tokens = out.num_cached_tokens
        if out.timeline is not None:
            m.timeline = out.timeline

    def _completion(self, state: RequestState, finish_reason: str | None, stop_reason, delta: bool) -> CompletionOutput:
        finished = finish_reason is not None
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
        else:
            text = state.final_text  # "" with detokenize=False
        if delta:
            token_ids = state.token_ids[state.num_tokens_returned :]
            logprobs = None if state.logprobs is None else state.logprobs[state.num_logprobs_returned :]
        else:
            token_ids = list(state.token_ids)
            logprobs = None if state.logprobs is None else list(state.logprobs)
        state.num_tokens_returned = len(state.token_ids)
        state.num_logprobs_returned = 0 if state.logprobs is None else len(state.logprobs)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
    def _make_output(self, state: RequestState, finish_reason: str | None, stop_reason) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.output_kind
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, finish_reason, stop_reason, delta=kind in DELTA_KINDS)
        parent = state.parent
        if parent is None:
            completions = [completion]
            request_id = state.request_id
            all_finished = finished
        else:
            request_id = parent.request_id
            parent.children[state.index] = completion
            parent.num_finished += int(finished)
            parent.error = parent.error or state.error
            all_finished = parent.num_finished == parent.n
            if kind == OutputKind.FINAL_ONLY:
                if not all_finished:
                    return None
                completions = [parent.children[i] for i in sorted(parent.children)]
            elif kind in DELTA_KINDS:
                completions = [completion]
            else:
                completions = [parent.children[i] for i in sorted(parent.children)]
        prompt_logprobs = None
        if state.prompt_logprobs is not None and (kind not in DELTA_KINDS or not state.prompt_logprobs_returned):
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_returned = True
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=all_finished,
            metrics=state.metrics,
            num_cached_tokens=state.metrics.num_cached_tokens,
            error=state.error if parent is None else parent.error,
            kv_transfer_params=state.kv_transfer_params,
        )
