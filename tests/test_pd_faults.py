"""PD faults over the real PD client (in-process: two prefill engines and two decode engines, the in-process
KV transport, no Ray), each engine's RPC handle able to die the way a lost replica's does (RayActorError).

- The decode engine dies before its first output: the decode leg goes to the other decode engine with
  the same hold, which loads the prompt's KV from it (a load, no fallback); the answer equals an
  uninterrupted run and `decode_retries` counts it. (Where the hold is gone by then, the engine's
  connector computes the prompt instead, as for any failed load: kv_transfer's own tests.)
- The decode engine dies mid-stream: `MigratingClient` continues the request on the other decode engine
  from the delivered tokens (recomputed: the hold went at the first output).
- A prefill engine dies before handing over: the prefill leg goes to another prefill engine (counted as
  a prefill retry), with the same answer; when that one fails too, the request is computed on a decode
  engine (counted as a prefill fallback), with the same answer.
Every KV block is free and nothing is held afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from ray.exceptions import RayActorError

from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.migration import MigratingClient
from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.engine.sampling_params import SamplingParams
from tests.local_serving import LocalHandle
from tests.pd_local import wait_engines_idle

PROMPT = [(17 * k) % 400 + 20 for k in range(30)]
PARAMS = [
    dict(temperature=0, max_tokens=24, ignore_eos=True),
    dict(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=1),
]


@dataclass
class Death:
    """When an engine goes: after `after_outputs` outputs (0: before the first) of the first request (the
    first `calls` requests) that reaches one of the engines it was put on."""

    after_outputs: int
    victim: Any = None  # the handle that died (last)
    calls: int = 1


class Dies:
    """One engine's handle that dies like a lost replica (its stream raises RayActorError) when a `Death`
    put on it comes due."""

    def __init__(self, inner: LocalHandle) -> None:
        self.inner = inner
        self.death: Death | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def generate(self) -> Any:
        outer = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                death = outer.death
                if death is None or death.calls == 0:
                    return outer.inner.generate.remote(*args, **kwargs)
                death.calls -= 1
                death.victim = outer

                async def stream():
                    if death.after_outputs:  # (dying before the first output, it never started the request)
                        inner = outer.inner.generate.remote(*args, **kwargs)
                        produced = 0
                        async for ref in inner:
                            yield ref
                            produced += 1
                            if produced >= death.after_outputs:
                                break
                        await inner.aclose()
                    raise RayActorError()

                return stream()

        return _Method()


def kill(handles: list[Dies], death: Death) -> Death:
    for handle in handles:
        handle.death = death
    return death


class PD:
    """Two prefill engines (producers "prefill-0", "prefill-1") and two decode engines behind the PD client."""

    def __init__(self, model: str) -> None:
        base = {"model": model, "dtype": "float32", "kv_cache_memory": "16MiB", "block_size": 4}
        extra = {"kv_connector_extra_config": {"hold_timeout_s": 120.0}}
        names = ["prefill-0", "prefill-1"]
        self.prefills = [EngineHost({**base, "kv_transfer_config": {
            "kv_connector": "inproc", "kv_role": "kv_producer", "engine_id": name, **extra}}, i,
            max_pending_requests=64) for i, name in enumerate(names)]
        self.decodes = [EngineHost({**base, "kv_transfer_config": {
            "kv_connector": "inproc", "kv_role": "kv_consumer", **extra}}, 2 + i, max_pending_requests=64)
            for i in range(2)]
        self.prefill_handles = [Dies(LocalHandle(engine)) for engine in self.prefills]
        self.decode_handles = [Dies(LocalHandle(engine)) for engine in self.decodes]
        self.client = PDClient.over_actors(self.prefill_handles, self.decode_handles, names,
                                           prefill_block_size=4, decode_block_size=4, stats_interval_s=0.05)
        self.client.start()

    def engines(self) -> list[EngineHost]:
        return [*self.prefills, *self.decodes]

    def kv(self, engine: EngineHost) -> dict:
        return dict(engine.engine.get_stats().scheduler.kv_transfer or {})

    def revive(self) -> None:
        """The coordinators route to every engine again (a dead one was marked unavailable)."""
        for pool in (self.client.prefill, self.client.decode):
            for state in pool.engines:
                state.available = True

    def wait_idle(self, timeout_s: float = 30.0) -> list[tuple[int, int, int]]:
        return wait_engines_idle(self.engines(), timeout_s)

    def close(self) -> None:
        asyncio.run(self.client.stop())
        for engine in self.engines():
            engine.shutdown()


@pytest.fixture(scope="module")
def pd(tiny_model_factory):
    running = PD(str(tiny_model_factory("llama", max_position_embeddings=512)))
    yield running
    running.close()


@pytest.fixture(autouse=True)
def idle_after(pd):
    yield
    pd.revive()
    for handle in (*pd.prefill_handles, *pd.decode_handles):
        handle.death = None
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)


_ids = itertools.count()


def next_id() -> str:
    """A fresh request id (a finished request's id may be a moment in the coordinator still, as its
    stream closes)."""
    return f"req-{next(_ids)}"


async def collect(client: Any, params: dict, request_id: str) -> dict[int, tuple[list[int], str]]:
    got: dict[int, tuple[list[int], str]] = {}
    async for out in client.generate(request_id, PROMPT, params):
        assert out.error is None
        for c in out.outputs:
            tokens, text = got.get(c.index, ([], ""))
            got[c.index] = (tokens + c.token_ids, text + c.text)
    return got


def totals(pd: PD, key: str) -> int:
    return sum(int(pd.kv(engine).get(key, 0)) for engine in pd.decodes)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_decode_lost_before_its_first_output_takes_the_hold_to_another_decode_engine(pd, params):
    params = SamplingParams(**params).model_dump()

    async def run() -> None:
        want = await collect(MigratingClient(pd.client), params, next_id())
        retries, loads, fallbacks = pd.client.counters.decode_retries, totals(pd, "loads"), totals(pd, "fallbacks")
        # Whichever decode engine the request reaches first dies.
        death = kill(pd.decode_handles, Death(0))
        client = MigratingClient(pd.client)
        got = await collect(client, params, next_id())
        assert death.victim is not None
        assert got == want
        assert client.num_migrations == 0, "the PD client retried the decode leg itself"
        assert pd.client.counters.decode_retries == retries + 1
        # The other decode engine loaded the prompt from the prefill's hold (nothing computed it again).
        assert (totals(pd, "loads"), totals(pd, "fallbacks")) == (loads + 1, fallbacks)

    asyncio.run(run())


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_decode_lost_mid_stream_migrates_to_the_other_decode_engine(pd, params):
    params = SamplingParams(**params).model_dump()

    async def run() -> None:
        want = await collect(MigratingClient(pd.client), params, next_id())
        retries = pd.client.counters.decode_retries
        death = kill(pd.decode_handles, Death(3))
        client = MigratingClient(pd.client)
        got = await collect(client, params, next_id())
        assert death.victim is not None and got == want
        assert client.num_migrations == 1 and pd.client.counters.decode_retries == retries

    asyncio.run(run())


def test_prefill_lost_before_handover_is_retried_on_another_prefill_engine(pd):
    params = SamplingParams(**PARAMS[1]).model_dump()

    async def run() -> None:
        want = await collect(MigratingClient(pd.client), params, next_id())
        counters = pd.client.counters
        retries, fallbacks, loads = counters.prefill_retries, counters.prefill_fallbacks, totals(pd, "loads")
        death = kill(pd.prefill_handles, Death(0))  # whichever prefill engine the request reaches first
        client = MigratingClient(pd.client)
        got = await collect(client, params, next_id())
        assert death.victim is not None and got == want
        assert (counters.prefill_retries, counters.prefill_fallbacks) == (retries + 1, fallbacks)
        assert client.num_migrations == 0
        assert totals(pd, "loads") == loads + 1  # the decode engine read the KV the retried prefill held

    asyncio.run(run())


def test_a_prefill_pool_that_keeps_failing_is_computed_on_a_decode_engine(pd):
    params = SamplingParams(**PARAMS[0]).model_dump()

    async def run() -> None:
        want = await collect(MigratingClient(pd.client), params, next_id())
        counters = pd.client.counters
        retries, fallbacks = counters.prefill_retries, counters.prefill_fallbacks
        death = kill(pd.prefill_handles, Death(0, calls=2))  # the first try and its retry
        client = MigratingClient(pd.client)
        got = await collect(client, params, next_id())
        assert death.calls == 0 and got == want
        assert (counters.prefill_retries, counters.prefill_fallbacks) == (retries + 1, fallbacks + 1)
        assert client.num_migrations == 0

    asyncio.run(run())
