"""The in-process coordinator routes as the Serve router does: the same routing policy (`routing_policy`)
and the same tenant-isolated hashes (cache salt and LoRA adapter), over engines whose routing stats carry
their KV events (fast, no Ray, no model: a real KV cache manager and event log stand in for each engine,
as in test_kv_index)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from pagedserve.cluster.serve.coordinator import DPCoordinator
from pagedserve.cluster.serve.kv_feed import KVEventFeed
from pagedserve.cluster.serve.routing_policy import (
    AFFINE, BALANCED, EXACT_HIT, MISS, RANDOM, prefix_hashes, short_hash,
)
from pagedserve.engine.lora.request import SAMPLING_KEY, LoRARequest
from tests.coordinator_fakes import FakeEngine, Method, engine_stats, ready
from tests.test_kv_index import BS
from tests.test_kv_index import FakeEngine as CacheEngine
from tests.test_routing_lora import ADAPTER_A, ADAPTER_B, PREFIX, engine_hit_tokens, serve


class KVEngineHandle(FakeEngine):
    """An engine actor handle whose `record_routing_stats` reports what a real cache manager holds (its KV
    events, the prefixes it served) and whose final outputs say how many prompt tokens its cache found."""

    def __init__(self, index: int) -> None:
        super().__init__(index, num_tokens=2)
        self.cache = CacheEngine(64)
        self.feed = KVEventFeed(self.cache, f"inc-{index}", snapshot_every=1000)
        self.served: list[str] = []
        self.routing_polls = 0
        self.record_routing_stats = Method(self._routing_stats)

    async def _routing_stats(self) -> dict:
        self.routing_polls += 1
        return {**self.stats.to_dict(), "block_size": BS, "prefix_hashes": list(self.served),
                "lora_adapters": [], "kv_events": await self.feed.report()}

    def serve(self, tokens: list[int], salt: str | None, lora: LoRARequest | None) -> None:
        serve(self.cache, tokens, salt, lora)
        self.served += [short_hash(h) for h in prefix_hashes(tokens, BS, 4, salt, lora.cache_key if lora else ())]

    async def _generate(self, request_id, prompt, sampling_params, priority=0, *rest):
        lora = sampling_params.get(SAMPLING_KEY)
        hit = engine_hit_tokens(self.cache, prompt["prompt_token_ids"], prompt.get("cache_salt"),
                                LoRARequest(**lora) if lora else None)
        async for ref in super()._generate(request_id, prompt, sampling_params, priority):
            output = await ref
            if output.finished:
                output.num_cached_tokens = hit
            yield ready(output)


def coordinator(n: int, **kwargs) -> tuple[DPCoordinator, list[KVEngineHandle]]:
    engines = [KVEngineHandle(i) for i in range(n)]
    return DPCoordinator(engines, block_size=BS, seed=0, **kwargs), engines


def params(lora: LoRARequest | None) -> dict:
    return {"max_tokens": 2, **({SAMPLING_KEY: asdict(lora)} if lora is not None else {})}


async def generate(coord: DPCoordinator, rid: str, prompt: list[int], salt: str | None,
                   lora: LoRARequest | None) -> int:
    """Run the request; the index of the engine that served it."""
    outputs = [o async for o in coord.generate(rid, prompt, params(lora), cache_salt=salt)]
    assert outputs[-1].finished
    return next(e.index for e in coord.engines if rid in e.handle.requests)


def test_exact_routing_goes_to_the_holder_under_its_salt_and_adapter_only():
    coord, engines = coordinator(3)
    engines[1].serve(PREFIX + [1, 2], "tenant-a", ADAPTER_A)
    prompt = PREFIX + [7, 8, 9]

    async def run() -> None:
        await coord.refresh_stats()
        assert await generate(coord, "a1", prompt, "tenant-a", ADAPTER_A) == 1
        # The same tokens under another adapter, the base model, or another salt: no cache can hit them.
        for n, (salt, lora) in enumerate([("tenant-a", ADAPTER_B), ("tenant-a", None), (None, ADAPTER_A),
                                          ("tenant-b", ADAPTER_A)]):
            await generate(coord, f"b{n}", prompt, salt, lora)

    asyncio.run(run())
    assert coord.policy.decisions[EXACT_HIT] == 1 and coord.policy.decisions[MISS] == 4
    # Each prediction was checked against what the serving engine's cache found: all exact.
    counters = coord.chooser.prediction_counters
    assert counters.checked == counters.matched == 5 and counters.actual_tokens == len(PREFIX)
    stats = coord.aggregate_stats()
    assert stats.routing_decisions[EXACT_HIT] == 1 and stats.kv_routing["matched"] == 5
    assert stats.kv_routing["stale_engines"] == 0


def test_approximate_routing_hashes_salt_and_adapter_too():
    coord, engines = coordinator(3, routing_policy="prefix_approx")
    engines[2].serve(PREFIX + [1], "tenant-a", ADAPTER_A)
    engines[2].stats = engine_stats(2, running=1)  # a little busier: affinity still wins within the bound
    asyncio.run(coord.refresh_stats())
    assert coord.choose_engine(PREFIX + [5], cache_salt="tenant-a", sampling_params=params(ADAPTER_A)) == 2
    assert coord.policy.decisions[AFFINE] == 1
    # Another tenant's (or adapter's) request for the same tokens knows of no holder: load decides.
    for salt, lora in (("tenant-b", ADAPTER_A), ("tenant-a", None)):
        assert coord.choose_engine(PREFIX + [5], cache_salt=salt, sampling_params=params(lora)) != 2
    assert coord.policy.decisions[BALANCED] == 2
    assert not coord.chooser.index.views  # no KV index under the approximate policy


@pytest.mark.parametrize("policy, decision", [("random", RANDOM), ("power_of_two", BALANCED)])
def test_blind_policies_ignore_prefixes_and_poll_no_routing_stats(policy, decision):
    coord, engines = coordinator(2, routing_policy=policy)
    engines[0].serve(PREFIX + [1], None, None)
    asyncio.run(coord.refresh_stats())
    assert all(e.routing_polls == 0 for e in engines)
    picks = {coord.choose_engine(PREFIX + [i]) for i in range(40)}
    assert picks == {0, 1} and coord.policy.decisions[decision] == 40


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="routing_policy"):
        coordinator(2, routing_policy="nearest")
