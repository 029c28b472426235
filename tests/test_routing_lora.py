"""The router hashes a request's prompt as the engine does: cache salt and LoRA adapter both (fast, no Ray,
no model: a real KV cache manager and event log stand in for each engine, as in test_kv_index)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from pagedserve.cluster.serve.engine_calls import lora_key_of
from pagedserve.cluster.serve.routing_policy import AFFINE, BALANCED, EXACT_HIT, MISS, prefix_hashes, short_hash
from pagedserve.engine.lora.request import SAMPLING_KEY, LoRARequest
from tests.test_kv_cache_manager import Req, schedule_prefill
from tests.test_kv_index import BS, FakeEngine, _replicas_from
from tests.test_serve_router import make_router
from pagedserve.cluster.serve.kv_feed import KVEventFeed

ADAPTER_A = LoRARequest("sql", 1, "/adapters/sql")
ADAPTER_B = LoRARequest("chat", 2, "/adapters/chat")
PREFIX = list(range(400, 400 + 8 * BS))  # eight full blocks


@dataclass
class LoRAReq(Req):
    lora_request: LoRARequest | None = None


def serve(engine: FakeEngine, tokens: list[int], salt: str | None, lora: LoRARequest | None) -> LoRAReq:
    """One request's prefill and end on the engine (its blocks stay cached), as one step."""
    engine.n += 1
    req = LoRAReq(f"q{engine.n}", list(tokens), cache_salt=salt, lora_request=lora)
    assert schedule_prefill(engine.kv, req)[0] is not None
    engine.kv.free(req)
    engine.log.seal()
    return req


def engine_hit_tokens(engine: FakeEngine, tokens: list[int], salt: str | None, lora: LoRARequest | None) -> int:
    """What the engine's prefix cache would find for this request (looked up, nothing allocated; a fresh
    request id, since the manager keeps each request's hashes by id)."""
    engine.n += 1
    probe = LoRAReq(f"probe{engine.n}", list(tokens), cache_salt=salt, lora_request=lora)
    return engine.kv.get_computed_blocks(probe)[1]


def generate_call(request_id: str, prompt: list[int], salt: str | None, lora: LoRARequest | None) -> Any:
    """A Serve PendingRequest for `EngineHost.generate`, as the engine client makes it."""
    params: dict = {"max_tokens": 4}
    if lora is not None:
        params[SAMPLING_KEY] = asdict(lora)
    return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=request_id),
                           args=[request_id, prompt, params, 0], kwargs={"cache_salt": salt})


def route(router, replicas, call) -> Any:
    return asyncio.run(router.choose_replicas(replicas, call))[0][0]


def test_router_hashes_equal_the_engine_block_hashes_for_a_salted_lora_request():
    engine = FakeEngine(64)
    req = serve(engine, PREFIX + [1, 2], "tenant-a", ADAPTER_A)
    engine_hashes = engine.kv.block_hashes(req)
    assert prefix_hashes(PREFIX + [1, 2], BS, None, "tenant-a", ADAPTER_A.cache_key) == engine_hashes
    # Neither the salt alone nor the adapter alone gives the engine's chain.
    assert prefix_hashes(PREFIX + [1, 2], BS, None, "tenant-a")[0] != engine_hashes[0]
    assert prefix_hashes(PREFIX + [1, 2], BS, None, None, ADAPTER_A.cache_key)[0] != engine_hashes[0]


def test_lora_key_of_reads_the_adapter_as_the_engine_host_does():
    assert lora_key_of(generate_call("r", PREFIX, None, ADAPTER_B)) == ("lora", 2)
    assert lora_key_of(generate_call("r", PREFIX, None, None)) == ()
    bad = generate_call("r", PREFIX, None, None)
    bad.args[2][SAMPLING_KEY] = {"lora_name": "x"}  # malformed: the engine host rejects it; no key here
    assert lora_key_of(bad) == ()
    assert lora_key_of(SimpleNamespace(metadata=SimpleNamespace(call_method="kv_read"), args=[], kwargs={})) == ()


def test_exact_prediction_equals_the_engine_hit_and_never_crosses_adapters():
    router, replicas = make_router(3)
    engines = [FakeEngine(64) for _ in replicas]
    feeds = [KVEventFeed(e, f"i{n}", snapshot_every=1000) for n, e in enumerate(engines)]
    serve(engines[1], PREFIX + [1, 2], "tenant-a", ADAPTER_A)
    _replicas_from(router, replicas, feeds)
    prompt = PREFIX + [7, 8, 9]

    # Same salt, same adapter: routed to the holder, predicted exactly what its cache finds.
    assert route(router, replicas, generate_call("a1", prompt, "tenant-a", ADAPTER_A)) is replicas[1]
    predicted = router.predictions["a1"]
    assert predicted == engine_hit_tokens(engines[1], prompt, "tenant-a", ADAPTER_A) == len(PREFIX)
    router.observe_cached("a1", engine_hit_tokens(engines[1], prompt, "tenant-a", ADAPTER_A))
    assert router.prediction_counters.matched == 1 and router.policy.decisions[EXACT_HIT] == 1

    # Another adapter (or the base model) over the same tokens and salt: no engine would hit, none predicted.
    for n, (salt, lora) in enumerate([("tenant-a", ADAPTER_B), ("tenant-a", None), (None, ADAPTER_A)]):
        rid = f"b{n}"
        choice = route(router, replicas, generate_call(rid, prompt, salt, lora))
        engine = engines[[r.replica_id for r in replicas].index(choice.replica_id)]
        assert router.predictions[rid] == 0 == engine_hit_tokens(engine, prompt, salt, lora), (salt, lora)
    assert router.policy.decisions[MISS] == 3


def test_approximate_routing_keys_reported_prefixes_by_adapter():
    router, replicas = make_router(3, routing_policy="prefix_approx")
    # What an engine host reports having served under adapter A (engine_host._remember hashes the same way).
    replicas[2].routing_stats["prefix_hashes"] = [
        short_hash(h) for h in prefix_hashes(PREFIX, BS, 8, None, ADAPTER_A.cache_key)]
    for n in range(5):
        assert route(router, replicas, generate_call(f"a{n}", PREFIX + [n], None, ADAPTER_A)) is replicas[2]
    assert router.policy.decisions[AFFINE] == 5
    route(router, replicas, generate_call("b", PREFIX + [9], None, ADAPTER_B))
    assert router.policy.decisions[BALANCED] == 1


def test_the_engine_host_reports_served_prefixes_under_their_adapter():
    from collections import OrderedDict

    from pagedserve.cluster.serve.engine_host import EngineHost

    host = EngineHost.__new__(EngineHost)  # only the prefix report's state: no engine behind it
    host.block_size, host._prefixes = BS, OrderedDict()
    host._remember(PREFIX, "tenant-a", ADAPTER_A.cache_key)
    reported = set(host._prefixes)
    assert short_hash(prefix_hashes(PREFIX, BS, 1, "tenant-a", ADAPTER_A.cache_key)[0]) in reported
    assert short_hash(prefix_hashes(PREFIX, BS, 1, "tenant-a")[0]) not in reported
