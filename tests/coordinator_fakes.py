"""Fake engine actor handles for coordinator tests: `generate.remote()` yields awaitables like a Ray
ObjectRefGenerator, and the prompt travels in the first output only, as from a real engine actor."""

from __future__ import annotations

import asyncio
import dataclasses

from ray.exceptions import ActorDiedError

from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.serve.coordinator import DPCoordinator
from pagedserve.cluster.serve.stream_transport import PromptElider
from pagedserve.engine.outputs import CompletionOutput, RequestOutput

BLOCK = 4


def engine_stats(index: int, running: int = 0, waiting: int = 0, usage: float = 0.0, healthy: bool = True,
                 **extra) -> EngineStats:
    base = dict(engine_index=index, num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                num_free_blocks=100, num_total_blocks=100, healthy=healthy, incarnation="first", stats_time=0.0)
    return EngineStats(**{**base, **extra})


def make_output(request_id: str, tokens: list[int], finish: str | None, prompt_ids: list[int] | None = None) -> RequestOutput:
    comp = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                            finish_reason=finish)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_ids or []),
                         prompt_logprobs=None, outputs=[comp], finished=finish is not None)


class _Done:
    """An awaitable that is already resolved (like a finished ObjectRef); never warns when left unawaited."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # makes this a generator function


def ready(value):
    return _Done(value)


async def raising(exc: BaseException):
    raise exc


class Method:
    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    """Mimics an engine actor handle: generate.remote() yields awaitables like a Ray ObjectRefGenerator."""

    def __init__(self, index: int, num_tokens: int = 5, die_after: int | None = None) -> None:
        self.index = index
        self.num_tokens = num_tokens
        self.die_after = die_after
        self.stats = engine_stats(index)
        self.aborted: list[str] = []
        self.abort_rpcs = 0  # abort calls of either kind: one RPC each on a real actor
        self.requests: list[str] = []
        self.generate = Method(self._generate)
        self.abort = Method(lambda rid: self._abort([rid]))
        self.abort_requests = Method(self._abort)
        self.get_stats = Method(self._get_stats)

    def _abort(self, request_ids):
        self.abort_rpcs += 1
        self.aborted.extend(request_ids)
        return ready(None)

    async def _generate(self, request_id, prompt, sampling_params, priority=0):
        """Like the real actor: the prompt travels in the first output only (PromptElider)."""
        self.requests.append(request_id)
        elide = PromptElider()
        for i in range(self.num_tokens):
            if self.die_after is not None and i == self.die_after:
                yield raising(ActorDiedError())
                return
            finish = "length" if i == self.num_tokens - 1 else None
            yield ready(elide(make_output(request_id, [i], finish, prompt["prompt_token_ids"])))
            await asyncio.sleep(0)

    def _get_stats(self):
        if self.die_after is not None and self.die_after < 0:
            return raising(ActorDiedError())
        return ready(dataclasses.replace(self.stats))  # a copy, as from a real actor


def make_coordinator(n: int, **kw) -> tuple[DPCoordinator, list[FakeEngine]]:
    engines = [FakeEngine(i) for i in range(n)]
    return DPCoordinator(engines, block_size=BLOCK, **kw), engines


def make_prompt(seed: int, length: int = 20) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 + 3 for i in range(length)]
