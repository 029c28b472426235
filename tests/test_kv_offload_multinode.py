"""The offload tier across nodes on a real multi-raylet Ray cluster (`ray.cluster_utils.Cluster` on this
machine): an engine replica pinned to node A and one pinned to node B by custom resources, each node's tier
in its own --kv-offload-dir (on one machine both nodes would otherwise share /dev/shm, and B would simply
read A's files). A prefix that A spilled is fetched by B from A's tier through a Serve call pinned to A's
replica (`EngineHost.kv_tier_read`, signed with the deployment's KV secret) and loaded: greedy output equal
to an engine without a tier, counted as a remote tier hit, every block of both tiers accounted for."""

from __future__ import annotations

import random

import pytest

from tests.multinode_cluster import in_process_cluster
from tests.serve_apps import on_engine

BS = 4
PREFIX = 32
PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with in_process_cluster({name: (1, {f"tier_node_{name}": 1}) for name in ("a", "b")}) as nodes:
        yield nodes


def _deploy(name: str, model, offload_dir) -> tuple:
    from ray import serve

    from pagedserve.cluster.serve.app import ROUTER_CLASS
    from pagedserve.cluster.serve.engine_host import EngineHost

    kwargs = {"model": str(model), "dtype": "float32", "num_kv_blocks": 24, "block_size": BS,
              "max_num_batched_tokens": 64, "max_num_seqs": 2, "kv_offload_size": "8MiB",
              "kv_offload_dir": str(offload_dir)}
    app = serve.deployment(EngineHost).options(
        name="engine", ray_actor_options={"num_cpus": 0.5, "resources": {f"tier_node_{name}": 0.5}},
        request_router_config={"request_router_class": ROUTER_CLASS, "request_routing_stats_period_s": 0.5},
    ).bind(kwargs)
    handle = serve.run(app, name=f"tier-{name}", route_prefix=None)
    ready = handle.options(method_name="ready").remote().result(timeout_s=300)
    return handle, ready


def _generate(handle, rid: str, prompt: list[int], **kwargs):
    stream = handle.options(method_name="generate", stream=True).remote(rid, prompt, PARAMS, 0, True, **kwargs)
    return list(stream)[-1]


def _replica_actor(app: str):
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"::{app}#engine#" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def _tier_state(host) -> dict:
    """The engine's tier (scheduler index, every rank's files) and its device pool, as tests/offload_checks.py
    reads them, from inside the replica."""
    core = host.engine.engine.engine_core
    state = core.kv_offload_state()
    pool = core.kv_cache_manager.block_pool
    state["busy_blocks"] = sum(1 for b in pool.blocks if b.ref_cnt)
    state["location"] = str(state["location"].namespace)
    return state


def _check_tier(state: dict) -> set[bytes]:
    index = set(state["index"])
    assert state["busy_blocks"] == 0
    assert len(index) == len(state["index"]) <= state["capacity_blocks"]
    assert not state["pins"] and state["loads_in_flight"] == 0
    for rank in state["ranks"]:
        assert rank["pending"] == 0 and rank["staged_bytes"] == 0 and rank["stats"]["skipped_stores"] == 0
        assert rank["owned"] == index and index <= rank["files"]
    return index


def test_a_prefix_spilled_on_one_node_is_fetched_and_loaded_by_an_engine_on_another(cluster, tiny_llama,
                                                                                     tmp_path):
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.core.block_pool import prompt_block_hashes

    a, ready_a = _deploy("a", tiny_llama, tmp_path / "node-a")
    b, ready_b = _deploy("b", tiny_llama, tmp_path / "node-b")
    assert (ready_a["node_id"], ready_b["node_id"]) == (cluster["a"], cluster["b"])
    rng = random.Random(31)
    prefix = [rng.randrange(8, 200) for _ in range(PREFIX)]
    _generate(a, "first", prefix + [rng.randrange(8, 200) for _ in range(5)])
    for i in range(3):  # unrelated prompts evict the prefix from A's device: it spills to A's tier
        _generate(a, f"filler{i}", [rng.randrange(8, 200) for _ in range(40)])
    hashes = prompt_block_hashes(prefix, BS)
    assert set(hashes) <= _check_tier(on_engine(_replica_actor("tier-a"), _tier_state))

    prompt = prefix + [rng.randrange(8, 200) for _ in range(5)]
    peer = {"app": "tier-a", "deployment": "engine", "replica": ready_a["replica"]}
    out = _generate(b, "q", prompt, kv_tier_peer=peer)
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=4096, block_size=BS)
    try:
        want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert out.num_cached_tokens == PREFIX
    stats = b.options(method_name="get_stats").remote().result(timeout_s=60)
    assert stats.kv_offload_remote_hit_tokens == stats.kv_offload_hit_tokens == PREFIX
    index_b = _check_tier(on_engine(_replica_actor("tier-b"), _tier_state))
    assert set(hashes) <= index_b  # the fetched blocks are B's own entries now (on B's node)
    _check_tier(on_engine(_replica_actor("tier-a"), _tier_state))
