"""The offload tier across nodes (kv_transfer/offload/remote.py), without Ray: two engines with tiers in two
directories stand for two nodes. A prefix that engine A spilled is read from A's tier by block hash, checked
and placed in B's tier, adopted by B's scheduler and loaded by B: greedy output equal to an engine without a
tier, counted as remote hits, every block of both tiers accounted for. Reads are signed and refused
otherwise; a hash A does not hold (another tenant's, unknown) returns nothing; a damaged block is never
placed and a block damaged after placing fails its load, so the request recomputes."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.kv_transfer.offload.remote import (
    MAX_TIER_READ_BLOCKS,
    TierReadAuth,
    TierReadAuthError,
    TierReadVerifier,
    block_file_limit,
    install_tier_blocks,
    read_tier_blocks,
    sign_tier_read,
)
from pagedserve.kv_transfer.offload.tier_files import make_rank_dir
from tests.offload_checks import check_all_blocks, check_offload_tier
from tests.test_kv_offload import BS, PREFIX, _evict_all, _hashes, _ids, _offload, _run, _tokens, tier_llms  # noqa: F401

SECRET = b"s" * 32
NS = "pagedserve-kv-0123"
HASHES = [bytes([i]) * 32 for i in range(3)]


def _tier(llm):
    return llm.llm_engine.engine_core.kv_connector


def _fetch(src, dst, hashes: list[bytes]) -> list[bytes]:
    """What the engine hosts do over Ray, in one process: read from src's tier, place in dst's, adopt."""
    a, b = _tier(src), _tier(dst)
    assert a.location.namespace.name == b.location.namespace.name  # same model and layout, other "node"
    blocks = read_tier_blocks(a.location, hashes, block_file_limit(a.block_bytes))
    installed = install_tier_blocks(b.location, hashes, blocks, block_file_limit(b.block_bytes))
    b.adopt(installed)
    return installed


# ---------------------------------------------------------------------------------------------- signing


def test_a_signed_read_passes_once_and_everything_else_is_refused():
    clock = [1000.0]
    verifier = TierReadVerifier(SECRET, "replica-a", clock=lambda: clock[0])
    auth = sign_tier_read(SECRET, NS, "replica-a", HASHES, clock=lambda: clock[0])
    verifier.verify(auth, NS, HASHES)
    refusals = [
        (auth, NS, HASHES),  # replayed
        (sign_tier_read(b"x" * 32, NS, "replica-a", HASHES), NS, HASHES),  # another deployment's secret
        (sign_tier_read(SECRET, NS, "replica-b", HASHES), NS, HASHES),  # meant for another peer
        (sign_tier_read(SECRET, NS, "replica-a", HASHES[:1]), NS, HASHES),  # other hashes than signed
        (sign_tier_read(SECRET, NS, "replica-a", HASHES), "pagedserve-kv-other", HASHES),  # another namespace
        (sign_tier_read(SECRET, NS, "replica-a", HASHES, clock=lambda: 0.0), NS, HASHES),  # stale
        (None, NS, HASHES),
        (TierReadAuth(clock[0], "n", b"short"), NS, HASHES),
        (sign_tier_read(SECRET, NS, "replica-a", [b"x"]), NS, [b"x"]),  # not a block hash
        (sign_tier_read(SECRET, NS, "replica-a", []), NS, []),
        (sign_tier_read(SECRET, NS, "replica-a", HASHES * MAX_TIER_READ_BLOCKS), NS, HASHES * MAX_TIER_READ_BLOCKS),
    ]
    for i, (bad, namespace, hashes) in enumerate(refusals):
        with pytest.raises(TierReadAuthError):
            verifier.verify(bad, namespace, hashes)
        assert verifier.refused == i + 1


# ---------------------------------------------------------------------------------------------- engines


@pytest.fixture
def two_nodes(tiny_llama, tier_llms, tmp_path):  # noqa: F811 - (the fixture imported above)
    """Engines A and B, each with its tier in a directory of its own (two nodes), and a reference engine."""
    a = tier_llms(tiny_llama, kv_offload_dir=str(tmp_path / "node-a"))
    b = tier_llms(tiny_llama, kv_offload_dir=str(tmp_path / "node-b"))
    reference = tier_llms(tiny_llama, None, num_kv_blocks=4096)
    return a, b, reference


def _spill_on_a(a, rng, salt: str | None = None) -> list[int]:
    prefix = _tokens(rng, PREFIX)
    prompt = prefix + _tokens(rng, 5)
    _run(a, [{"prompt_token_ids": prompt, "cache_salt": salt} if salt else prompt])
    _evict_all(a, rng)
    check_offload_tier(a)  # (A's writer caught up: its files are there)
    return prefix


def test_a_prefix_spilled_on_one_node_is_loaded_by_an_engine_on_another(two_nodes):
    a, b, reference = two_nodes
    rng = random.Random(11)
    prefix = _spill_on_a(a, rng)
    hashes = _hashes(prefix)
    assert not any(_tier(b).location.on_node(h) for h in hashes)  # B's node does not see A's tier
    assert _fetch(a, b, hashes) == hashes
    prompt = prefix + _tokens(rng, 5)
    got = _run(b, [prompt])
    assert _ids(got) == _ids(_run(reference, [prompt]))
    assert got[0].num_cached_tokens == PREFIX
    stats = _offload(b)
    assert stats["remote_fetched_blocks"] == PREFIX // BS
    assert stats["remote_hit_tokens"] == stats["hit_tokens"] == PREFIX and stats["shared_hit_tokens"] == 0
    state = check_offload_tier(b)  # the fetched blocks are B's entries now: indexed, owned, on its tier
    assert set(hashes) <= set(state["index"])
    check_all_blocks(a, b)


def test_a_hash_the_peer_does_not_hold_returns_nothing(two_nodes):
    a, b, _ = two_nodes
    rng = random.Random(12)
    prefix = _spill_on_a(a, rng, salt="tenant-a")
    location, limit = _tier(a).location, block_file_limit(_tier(a).block_bytes)
    assert len(read_tier_blocks(location, _hashes(prefix, "tenant-a"), limit)) == PREFIX // BS
    assert read_tier_blocks(location, _hashes(prefix, "tenant-b"), limit) == {}  # another tenant's chain
    assert read_tier_blocks(location, _hashes(prefix), limit) == {}  # unsalted
    assert _fetch(a, b, _hashes(prefix, "tenant-b")) == []
    out = _run(b, [{"prompt_token_ids": prefix + _tokens(rng, 5), "cache_salt": "tenant-b"}])[0]
    assert out.num_cached_tokens == 0 and _offload(b)["hit_tokens"] == 0
    check_all_blocks(a, b)


def test_a_block_damaged_in_transit_is_not_placed_and_the_rest_is_recomputed(two_nodes):
    a, b, reference = two_nodes
    rng = random.Random(13)
    prefix = _spill_on_a(a, rng)
    hashes = _hashes(prefix)
    a_tier, b_tier = _tier(a), _tier(b)
    blocks = read_tier_blocks(a_tier.location, hashes, block_file_limit(a_tier.block_bytes))
    damaged = bytearray(blocks[hashes[3]][0])
    damaged[-5] ^= 0xFF
    blocks[hashes[3]] = [bytes(damaged)]
    blocks[hashes[5]] = [blocks[hashes[5]][0][:-9]]  # (and a truncated one after it)
    installed = install_tier_blocks(b_tier.location, hashes, blocks, block_file_limit(b_tier.block_bytes))
    assert installed == hashes[:3]  # the run stops at the damaged block
    assert not b_tier.location.on_node(hashes[3]) and not b_tier.location.on_node(hashes[5])
    b_tier.adopt(installed)
    prompt = prefix + _tokens(rng, 5)
    got = _run(b, [prompt])
    assert _ids(got) == _ids(_run(reference, [prompt]))
    assert got[0].num_cached_tokens == 3 * BS and _offload(b)["remote_hit_tokens"] == 3 * BS
    check_all_blocks(a, b)


def test_a_fetched_block_damaged_on_the_tier_fails_its_load_and_the_request_recomputes(two_nodes):
    a, b, reference = two_nodes
    rng = random.Random(14)
    prefix = _spill_on_a(a, rng)
    hashes = _hashes(prefix)
    _fetch(a, b, hashes)
    path = _tier(b).location.block_path(0, hashes[6])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    prompt = prefix + _tokens(rng, 5)
    got = _run(b, [prompt])
    assert _ids(got) == _ids(_run(reference, [prompt]))
    stats = _offload(b)
    assert stats["load_failures"] == 1 and stats["remote_hit_tokens"] == 0
    check_all_blocks(a, b)
    assert not any(_tier(b).location.on_node(h) for h in hashes[:7])  # the failed load dropped what it read


# ---------------------------------------------------------------------------------------------- fuzzing


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=400), flip=st.integers(min_value=0, max_value=10_000))
def test_whatever_a_peer_sends_only_whole_checked_blocks_are_placed(tmp_path, blob, flip):
    """Garbage, a valid block under another hash, a valid block with one flipped byte, extra hashes nobody
    asked for: nothing is placed but the asked-for, intact block, and nothing raises."""
    import tempfile
    from pathlib import Path

    import torch

    from pagedserve.kv_transfer.offload.tier_files import TierLocation, write_block

    example = Path(tempfile.mkdtemp(dir=tmp_path))  # (tmp_path is shared by the examples)
    location = TierLocation("disk", example / "ns", 1)
    make_rank_dir(location, 0)
    good_hash, other_hash = bytes([1]) * 32, bytes([2]) * 32
    src = example / "src"
    write_block(src, good_hash, [torch.arange(8.0)], [torch.arange(8.0) + 1])
    good = src.read_bytes()
    damaged = bytearray(good)
    damaged[flip % len(damaged)] ^= 0x10
    limit = block_file_limit(64)
    for sent in ({good_hash: [blob]}, {good_hash: [bytes(damaged)]}, {good_hash: [good, good]},
                 {good_hash: good}, {other_hash: [good]}, [good], None):
        assert install_tier_blocks(location, [good_hash], sent, limit) == []
    assert not location.on_node(good_hash)
    assert install_tier_blocks(location, [good_hash], {good_hash: [good], other_hash: [good]}, limit) == [good_hash]
    assert location.block_path(0, good_hash).read_bytes() == good and not location.on_node(other_hash)
