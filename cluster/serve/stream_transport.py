"""What a request's output stream looks like on its way from an engine actor to the coordinator.

A stream's prompt (its token ids and text) is the same in every output, and pickling it with every
delta costs O(prompt) per generated token. The engine actor sends it once, in the first output of the
stream (`PromptElider`); the coordinator puts it back into every later output (`PromptRestorer`), so
callers still see complete `RequestOutput`s. Prompt logprobs already travel once: a DELTA stream
carries them only in its first output.

Two transports carry a stream. The ingress's handle to the engine deployment sends it over Serve's
gRPC transport (`client.ServeEngineClient`: one message per output, the stream paused by gRPC's flow
control when its reader stops reading), but for requests that may not fit a gRPC message
(`client.too_large_for_grpc`: Ray objects have no size cap); plain engine actors (`engine_actor`) and the other handle calls use Ray's streaming
generators, where `STREAM_BACKPRESSURE_OBJECTS` bounds how many outputs of one stream may wait, unread,
between the actor and its reader. Either way, while the stream is paused the engine's outputs merge
into one delta (`RequestOutput.add` in `AsyncLLM.generate`), so a slow reader gets fewer, larger
deltas instead of a pile of one object per step.

A request whose caller reads only its end (`final_only`: a non-streaming HTTP request) still leaves
the engine as deltas (`OutputKind.CHECKPOINT`: one per checkpoint interval and the finish, the text
decoded once into the finishing delta), so that the router knows what it generated and a migration
continues it from there (cluster/serve/migration.py) instead of starting over.

A streamed request's deltas leave the engine at most once per `stream_interval` generated tokens
(`ServeArgs.stream_interval`, `engine.delta_coalescer`; the first tokens and the finish at once): every
item of a Ray stream, and every SSE event the ingress makes of it, costs the same whatever it carries.

An aborted stream ends with one finished "abort" output (`abort_output`): the engine itself emits
nothing for a request it aborted.
"""

from __future__ import annotations

import dataclasses

from pagedserve.engine.outputs import (
    CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput,
)
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams

# Outputs of one stream that may be produced and not yet read (Ray streaming-generator backpressure).
STREAM_BACKPRESSURE_OBJECTS = 4


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



def abort_output(request_id: str, prompt: str | dict,
                 params: SamplingParams | PoolingParams) -> RequestOutput | EmbeddingRequestOutput:
    """The finished output that ends an aborted request's stream: every completion "abort", nothing new."""
    prompt_ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
    if isinstance(params, PoolingParams):
        text = prompt if isinstance(prompt, str) else None
        return EmbeddingRequestOutput(request_id, text, prompt_ids, EmbeddingOutput([]), error="aborted")
    outputs = [
        CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="abort")
        for i in range(params.n)
    ]
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=prompt_ids, prompt_logprobs=None, outputs=outputs, finished=True)
