"""The KV offload tier: blocks evicted from the device prefix cache spill to host shared memory and are
reloaded on a later prefix hit instead of recomputed. Greedy outputs equal those of the engine without a tier
(float32, token for token) under eviction pressure, preemption and chunked prefill; reloads count as cached
tokens; another engine on the node (another process too) loads what one spilled; salts never cross; a
damaged or missing tier file makes its request recompute without touching others; every block of every tier
is accounted for after each workload."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.block_pool import hash_block_tokens
from pagedserve.kv_transfer.offload.tier_files import block_bytes, tier_location
from pagedserve.kv_transfer.layout import KVLayout
from tests.offload_checks import check_all_blocks, check_offload_tier
from tests.tiny_models import VOCAB_SIZE

BS = 4
PREFIX = 32  # 8 blocks
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, VOCAB_SIZE) for _ in range(n)]


def _llm(path, offload: str | None = "8MiB", **overrides) -> LLM:
    kwargs = dict(model=str(path), dtype="float32", num_kv_blocks=24, block_size=BS, max_num_batched_tokens=64,
                  max_num_seqs=2)
    kwargs.update(overrides)
    if offload is not None:
        kwargs["kv_offload_size"] = offload
    return LLM(**kwargs)


def _run(llm: LLM, prompts, params=GREEDY, one_by_one: bool = True):
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    if one_by_one:
        return [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
    return llm.generate(prompts, params, use_tqdm=False)


def _ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def _hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BS):
        out.append(hash_block_tokens(out[-1] if out else None, tokens[i * BS:(i + 1) * BS],
                                     (salt,) if i == 0 and salt is not None else None))
    return out


def _offload(llm: LLM) -> dict:
    return llm.get_stats().kv_offload


def _evict_all(llm: LLM, rng: random.Random) -> None:
    """Fill the device cache with unrelated prompts so that every earlier block is evicted (and spilled)."""
    _run(llm, [_tokens(rng, 40) for _ in range(3)])


@pytest.fixture
def tier_llms():
    made: list[LLM] = []

    def make(path, offload: str | None = "8MiB", **overrides) -> LLM:
        made.append(_llm(path, offload, **overrides))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


@pytest.mark.parametrize("shape", ["eviction", "chunked_prefill", "preemption"])
def test_greedy_outputs_with_the_tier_equal_those_without(tiny_llama, tier_llms, shape):
    rng = random.Random(1)
    prefixes = [_tokens(rng, PREFIX) for _ in range(5)]
    prompts = [p + _tokens(rng, 5) for _ in range(2) for p in prefixes]
    overrides: dict = {}
    params, one_by_one = GREEDY, True
    if shape == "chunked_prefill":
        overrides = {"max_num_batched_tokens": 8}  # a 37-token prompt takes several chunks after its reload
    elif shape == "preemption":
        overrides = {"num_kv_blocks": 20, "max_num_seqs": 4}
        params, one_by_one = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), False
    want = _ids(_run(tier_llms(tiny_llama, None, num_kv_blocks=4096, max_num_seqs=8), prompts, params, one_by_one))
    without = tier_llms(tiny_llama, None, **overrides)
    with_tier = tier_llms(tiny_llama, **overrides)
    assert _ids(_run(without, prompts, params, one_by_one)) == want
    got = _run(with_tier, prompts, params, one_by_one)
    assert _ids(got) == want
    stats = _offload(with_tier)
    assert stats["stored_blocks"] > 0 and stats["hit_tokens"] > 0 and stats["load_failures"] == 0
    assert stats["loaded_bytes"] > 0 and stats["hit_tokens"] <= stats["query_tokens"]
    if shape == "preemption":
        assert with_tier.get_stats().num_preemptions > 0
    check_all_blocks(without, with_tier)


def test_a_prefix_evicted_from_the_device_is_reloaded_and_counted_as_cached(tiny_llama, tier_llms):
    rng = random.Random(2)
    llm = tier_llms(tiny_llama)
    prefix = _tokens(rng, PREFIX)
    _run(llm, [prefix + _tokens(rng, 5)])
    _evict_all(llm, rng)
    pool = llm.llm_engine.engine_core.kv_cache_manager.block_pool
    assert all(pool.get_cached_block(h) is None for h in _hashes(prefix))  # gone from the device
    before = _offload(llm)
    device_hits = llm.get_stats().prefix_cache_hits
    out = _run(llm, [prefix + _tokens(rng, 5)])[0]
    after = _offload(llm)
    assert after["hit_tokens"] - before["hit_tokens"] == PREFIX
    assert after["loaded_blocks"] - before["loaded_blocks"] == PREFIX // BS
    assert out.num_cached_tokens == PREFIX  # reloaded tokens are cache hits
    assert llm.get_stats().prefix_cache_hits == device_hits  # ... of the tier, not of the device
    assert llm.get_stats().kv_offload_hit_tokens == after["hit_tokens"]
    check_all_blocks(llm)


def test_another_engine_on_the_node_loads_what_one_offloaded(tiny_llama, tier_llms):
    rng = random.Random(3)
    first, second = tier_llms(tiny_llama), tier_llms(tiny_llama)
    reference = tier_llms(tiny_llama, None, num_kv_blocks=4096)
    prefix = _tokens(rng, PREFIX)
    _run(first, [prefix + _tokens(rng, 5)])
    _evict_all(first, rng)
    check_offload_tier(first)  # (its writer caught up: the files are there)
    prompt = prefix + _tokens(rng, 5)
    got = _run(second, [prompt])
    assert _ids(got) == _ids(_run(reference, [prompt]))
    stats = _offload(second)
    assert stats["shared_hit_tokens"] == stats["hit_tokens"] == PREFIX
    assert got[0].num_cached_tokens == PREFIX
    check_all_blocks(first, second)


def test_an_engine_in_another_process_loads_what_one_offloaded(tiny_llama, tier_llms, tmp_path):
    rng = random.Random(4)
    prefix = _tokens(rng, PREFIX)
    fillers = [_tokens(rng, 40) for _ in range(3)]
    script = textwrap.dedent(f"""
        import sys
        from pagedserve.engine import LLM, SamplingParams
        llm = LLM(model={str(tiny_llama)!r}, dtype="float32", num_kv_blocks=24, block_size={BS},
                  max_num_batched_tokens=64, max_num_seqs=2, kv_offload_size="8MiB")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for prompt in [{prefix + [9, 9, 9, 9, 9]!r}, *{fillers!r}]:
            llm.generate([{{"prompt_token_ids": prompt}}], params, use_tqdm=False)
        llm.llm_engine.engine_core.kv_offload_state()  # the writer caught up
        print("offloaded", flush=True)
        sys.stdin.readline()
        llm.shutdown()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=str(Path(__file__).resolve().parent.parent))
    try:
        assert proc.stdout.readline().strip() == "offloaded"
        mine = tier_llms(tiny_llama)
        reference = tier_llms(tiny_llama, None, num_kv_blocks=4096)
        prompt = prefix + _tokens(rng, 5)
        assert _ids(_run(mine, [prompt])) == _ids(_run(reference, [prompt]))
        assert _offload(mine)["shared_hit_tokens"] == PREFIX
        check_all_blocks(mine)
    finally:
        proc.communicate("done\n", timeout=120)
    assert proc.returncode == 0


def test_tenants_never_load_each_others_blocks(tiny_llama, tier_llms):
    rng = random.Random(5)
    llm = tier_llms(tiny_llama)
    prefix = _tokens(rng, PREFIX)
    _run(llm, [{"prompt_token_ids": prefix + _tokens(rng, 5), "cache_salt": "tenant-a"}])
    _evict_all(llm, rng)
    hits = _offload(llm)["hit_tokens"]
    other = _run(llm, [{"prompt_token_ids": prefix + _tokens(rng, 5), "cache_salt": "tenant-b"}])[0]
    unsalted = _run(llm, [prefix + _tokens(rng, 5)])[0]
    assert other.num_cached_tokens == unsalted.num_cached_tokens == 0 and _offload(llm)["hit_tokens"] == hits
    _evict_all(llm, rng)
    same = _run(llm, [{"prompt_token_ids": prefix + _tokens(rng, 5), "cache_salt": "tenant-a"}])[0]
    assert same.num_cached_tokens == PREFIX and _offload(llm)["hit_tokens"] == hits + PREFIX
    check_all_blocks(llm)


def _damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    else:  # one flipped byte in the last layer's V
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_a_damaged_tier_block_is_recomputed_without_disturbing_another_request(tiny_llama, tier_llms, how):
    rng = random.Random(6)
    llm = tier_llms(tiny_llama, max_num_seqs=4, num_kv_blocks=32)
    reference = tier_llms(tiny_llama, None, num_kv_blocks=4096)
    bad, good = _tokens(rng, PREFIX), _tokens(rng, PREFIX)
    _run(llm, [bad + _tokens(rng, 5), good + _tokens(rng, 5)])
    _run(llm, [_tokens(rng, 40) for _ in range(4)])
    location = check_offload_tier(llm)["location"]
    _damage(location.block_path(0, _hashes(bad)[3]), how)
    prompts = [bad + _tokens(rng, 5), good + _tokens(rng, 5)]
    got = _run(llm, prompts, one_by_one=False)  # one step loads both
    assert _ids(got) == _ids(_run(reference, prompts))
    stats = _offload(llm)
    assert stats["load_failures"] == 1 and stats["loads"] == 1 and stats["hit_tokens"] == PREFIX
    assert got[1].num_cached_tokens == PREFIX
    check_all_blocks(llm)
    # The damaged entries left the tier; the prefix, recomputed, spills and reloads again.
    _evict_all(llm, rng)
    again = _run(llm, [bad + _tokens(rng, 5)])[0]
    assert again.num_cached_tokens == PREFIX
    check_all_blocks(llm)


def test_the_tier_is_bounded_and_least_recently_used_goes_first(tiny_llama, tier_llms):
    rng = random.Random(7)
    llm = tier_llms(tiny_llama, offload="16KiB")
    capacity = llm.llm_engine.engine_core.kv_offload_state()["capacity_blocks"]
    layout = llm.llm_engine.engine_core.executor.worker.model_runner.kv_layout()
    assert capacity == 16 * 1024 // block_bytes(layout, 0) < 4 * PREFIX // BS
    prefixes = [_tokens(rng, PREFIX) for _ in range(4)]
    for prefix in prefixes:
        _run(llm, [prefix + _tokens(rng, 5)])
    _evict_all(llm, rng)
    state = check_offload_tier(llm)
    assert len(state["index"]) == capacity and _offload(llm)["dropped_blocks"] > 0
    # The oldest prefixes were dropped; the newest spills are there.
    assert not set(_hashes(prefixes[0])) & set(state["index"])
    check_all_blocks(llm)


def test_config_errors_name_the_field(tiny_llama):
    from pagedserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_offload_size: cannot parse"):
        EngineConfig(model=str(tiny_llama), kv_offload_size="lots")
    with pytest.raises(ValueError, match="kv_offload_size: must be positive"):
        EngineConfig(model=str(tiny_llama), kv_offload_size=0)
    with pytest.raises(ValueError, match="kv_offload_dir: needs kv_offload_size"):
        EngineConfig(model=str(tiny_llama), kv_offload_dir="/tmp")
    with pytest.raises(ValueError, match="async_scheduling: cannot run with kv_offload_size"):
        EngineConfig(model=str(tiny_llama), kv_offload_size="1GiB", async_scheduling=True)
    assert EngineConfig(model=str(tiny_llama), kv_offload_size="2GiB").kv_offload_bytes == 2 * 1024**3


def test_only_engines_whose_kv_is_interchangeable_share_a_tier(tmp_path):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float32", block_size=4)
    same = tier_location("model-a", layout, None)
    assert same == tier_location("model-a", layout, None) and same.name == "host"
    others = [tier_location("model-b", layout, None)] + [
        tier_location("model-a", KVLayout(**{**layout.to_dict(), key: value}), None)
        for key, value in [("dtype", "bfloat16"), ("block_size", 8), ("num_kv_heads", 1), ("tp_size", 2)]]
    assert len({same.namespace, *(o.namespace for o in others)}) == 1 + len(others)
    disk = tier_location("model-a", layout, str(tmp_path))
    assert disk.name == "disk" and disk.namespace.parent == tmp_path


def test_a_tier_on_local_disk(tiny_llama, tier_llms, tmp_path):
    rng = random.Random(8)
    llm = tier_llms(tiny_llama, kv_offload_dir=str(tmp_path))
    prefix = _tokens(rng, PREFIX)
    _run(llm, [prefix + _tokens(rng, 5)])
    _evict_all(llm, rng)
    state = check_offload_tier(llm)
    assert state["location"].namespace.parent == tmp_path and state["location"].name == "disk"
    assert _run(llm, [prefix + _tokens(rng, 5)])[0].num_cached_tokens == PREFIX
    check_all_blocks(llm)
    llm.shutdown()  # an engine takes its files with it
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_decode_engine_runs_the_tier_beside_its_prefill_decode_connector(tiny_llama, tier_llms):
    """A PD consumer with a tier: pulled prompts equal the monolithic engine's, and a plain request whose
    prefix it evicted reloads from the tier (the two connectors side by side)."""
    from tests.test_kv_transfer import _decode, _prefill

    rng = random.Random(9)
    producer = _llm(tiny_llama, None, num_kv_blocks=96, kv_transfer_config={
        "kv_connector": "inproc", "kv_role": "kv_producer"})
    try:
        consumer = tier_llms(tiny_llama, kv_transfer_config={"kv_connector": "inproc", "kv_role": "kv_consumer"})
        reference = tier_llms(tiny_llama, None, num_kv_blocks=4096)
        prompts = [_tokens(rng, PREFIX + 5) for _ in range(2)]
        got = _decode(consumer, prompts, _prefill(producer, prompts))
        assert [c.token_ids for o in got for c in o.outputs] == _ids(_run(reference, prompts, SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True)))
        assert consumer.get_stats().kv_transfer["loads"] == 2
        _evict_all(consumer, rng)
        again = prompts[0][:PREFIX] + _tokens(rng, 5)
        out = _run(consumer, [again])
        assert _ids(out) == _ids(_run(reference, [again])) and out[0].num_cached_tokens == PREFIX
        assert _offload(consumer)["hit_tokens"] == PREFIX and consumer.get_stats().kv_transfer["loads"] == 2
        check_all_blocks(consumer)
    finally:
        producer.shutdown()


def test_the_tier_reports_its_blocks_in_the_engines_kv_events(tiny_llama, tier_llms):
    """What the tier gains and drops joins the engine's KV events (which routers index), and a snapshot
    carries the tier's holdings: replaying the events gives the snapshot's offload tier."""
    from pagedserve.engine.core.kv_events import OFFLOAD, apply_event

    rng = random.Random(5)
    llm = tier_llms(tiny_llama)
    log = llm.llm_engine.engine_core.kv_events
    start = log.seq
    prefix = _tokens(rng, PREFIX)
    _run(llm, [prefix + _tokens(rng, 5)])
    _evict_all(llm, rng)
    snapshot = log.snapshot()
    offloaded = set(snapshot.tiers.get(OFFLOAD, ()))
    assert set(_hashes(prefix)) <= offloaded
    holdings: dict = {}
    for batch in log.since(start):
        for event in batch.events:
            apply_event(holdings, event)
    assert holdings.get(OFFLOAD, set()) == offloaded
    check_all_blocks(llm)
