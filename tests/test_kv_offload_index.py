"""The offload tier's scheduler half on its own (no engine): spills on eviction, the LRU bound, entries that
loads read are never dropped, lookups stop at the first miss and short of the last token, a failed load drops
what it read, and the tier's listeners hear every change (the KV event stream's hooks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.kv_transfer.offload.scheduler_side import OffloadConnectorScheduler
from pagedserve.kv_transfer.offload.tier_files import TierLocation

BS = 4


@dataclass
class Req:
    request_id: str
    hashes: list[bytes]
    num_tokens: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, str]] = []

    def block_offloaded(self, block_hash: bytes, tier: str) -> None:
        self.seen.append(("offloaded", block_hash, tier))

    def block_dropped(self, block_hash: bytes, tier: str) -> None:
        self.seen.append(("dropped", block_hash, tier))

    def block_reloaded(self, block_hash: bytes, tier: str) -> None:
        self.seen.append(("reloaded", block_hash, tier))


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _tier(tmp_path: Path, capacity: int) -> tuple[OffloadConnectorScheduler, Events]:
    location = TierLocation("host", tmp_path / "ns", world_size=1)
    tier = OffloadConnectorScheduler(location, BS, capacity, block_bytes=100, block_hashes=lambda r: r.hashes)
    events = Events()
    tier.listeners.append(events)
    return tier, events


def test_evicted_blocks_spill_once_and_the_lru_bound_drops_the_oldest(tmp_path):
    tier, events = _tier(tmp_path, capacity=3)
    for i in range(3):
        tier.block_evicted(i, _h(i))
    tier.block_evicted(7, _h(0))  # already held: touched, not stored again
    tier.block_evicted(3, _h(3))
    md = tier.build_connector_metadata()
    assert md.stores == [(0, _h(0)), (1, _h(1)), (2, _h(2)), (3, _h(3))]
    assert md.drops == [_h(1)]  # h0 was touched after h1
    assert list(tier.index) == [_h(2), _h(0), _h(3)]
    assert [e[0] for e in events.seen] == ["offloaded"] * 4 + ["dropped"] and events.seen[0][2] == "host"
    stats = tier.snapshot_offload_stats()
    assert (stats.stored_blocks, stats.stored_bytes, stats.dropped_blocks, stats.resident_blocks) == (4, 400, 1, 3)


def test_lookups_stop_at_the_first_miss_and_short_of_the_last_token(tmp_path):
    tier, _ = _tier(tmp_path, capacity=10)
    for i in (0, 1, 3):
        tier.block_evicted(i, _h(i))
    req = Req("a", [_h(0), _h(1), _h(2), _h(3)], num_tokens=16)
    assert tier.get_num_new_matched_tokens(req, 0) == 2 * BS
    assert tier.get_num_new_matched_tokens(req, BS) == BS  # after one device hit
    whole = Req("b", [_h(0), _h(1)], num_tokens=8)  # two full blocks: the last token is computed
    assert tier.get_num_new_matched_tokens(whole, 0) == BS
    failed = Req("c", [_h(0)], num_tokens=9)
    failed.kv_offload_failed = True
    assert tier.get_num_new_matched_tokens(failed, 0) == 0


def test_entries_being_loaded_are_never_dropped(tmp_path):
    tier, _ = _tier(tmp_path, capacity=2)
    tier.block_evicted(0, _h(0))
    tier.block_evicted(1, _h(1))
    tier.build_connector_metadata()
    req = Req("a", [_h(0), _h(1), _h(9)], num_tokens=12)
    assert tier.get_num_new_matched_tokens(req, 0) == 2 * BS
    tier.block_evicted(5, _h(5))  # (during the request's own allocation) the matched entries stay
    assert _h(0) in tier.index and _h(1) in tier.index
    tier.update_state_after_alloc(req, [10, 11, 12], 2 * BS)
    md = tier.build_connector_metadata()
    assert [(j.req_id, j.block_ids, j.token_start, j.token_end, j.hashes) for j in md.loads] == [
        ("a", [10, 11, 12], 0, 2 * BS, [_h(0), _h(1)])]
    assert tier.external_tokens_are_cached(req)
    assert md.stores == [(5, _h(5))] and md.drops == [_h(5)]  # (the only entry neither matched nor read)
    tier.block_evicted(6, _h(6))
    md = tier.build_connector_metadata()
    assert md.stores == [(6, _h(6))] and md.drops == [_h(6)]
    assert _h(0) in tier.index and _h(1) in tier.index  # pinned while the load is in flight
    tier.load_finished("a", ok=True)
    tier.block_evicted(7, _h(7))
    assert len(tier.index) == 2 and tier.accounting()["pins"] == {}
    stats = tier.snapshot_offload_stats()
    assert (stats.loads, stats.hit_tokens, stats.loaded_blocks, stats.query_tokens) == (1, 2 * BS, 2, 12)


def test_a_failed_load_drops_what_it_read_and_the_request_never_reads_the_tier_again(tmp_path):
    tier, events = _tier(tmp_path, capacity=4)
    tier.block_evicted(0, _h(0))
    req = Req("a", [_h(0), _h(1)], num_tokens=9)
    assert tier.get_num_new_matched_tokens(req, 0) == BS
    tier.update_state_after_alloc(req, [3, 4, 5], BS)
    tier.build_connector_metadata()
    tier.mark_load_failed(req)
    assert req.kv_offload_failed and _h(0) not in tier.index
    assert tier.build_connector_metadata().drops == [_h(0)]
    assert ("dropped", _h(0), "host") in events.seen
    stats = tier.snapshot_offload_stats()
    assert stats.load_failures == 1 and stats.hit_tokens == 0


def test_a_request_that_finishes_during_its_load_unpins_its_entries(tmp_path):
    tier, _ = _tier(tmp_path, capacity=1)
    tier.block_evicted(0, _h(0))
    req = Req("a", [_h(0), _h(1)], num_tokens=9)
    tier.get_num_new_matched_tokens(req, 0)
    tier.update_state_after_alloc(req, [3, 4, 5], BS)
    assert tier.request_finished(req, [3, 4, 5]) is False
    tier.load_finished("a", ok=True)  # (its load came back after it left: nothing to account)
    tier.block_evicted(1, _h(1))
    assert list(tier.index) == [_h(1)] and tier.accounting()["loads_in_flight"] == 0


def test_metrics_and_the_cli_carry_the_tier(tiny_llama):
    from pagedserve.cluster.cli import build_parser, serve_args_from
    from pagedserve.cluster.fleet_stats import FleetStats
    from pagedserve.cluster.serving.metrics import ServingMetrics

    figures = FleetStats(kv_offload_query_tokens=64, kv_offload_hit_tokens=32, kv_offload_remote_hit_tokens=16,
                         kv_offload_stored_bytes=4096, kv_offload_loaded_bytes=2048)
    text = ServingMetrics("m", lambda: figures).render()[0].decode()
    for name, value in [("queries", 64), ("hits", 32), ("remote_hits", 16), ("stored_bytes", 4096),
                        ("loaded_bytes", 2048)]:
        assert f'pagedserve:kv_offload_{name}_total{{model_name="m"}} {value}.0' in text
    ns = build_parser().parse_args(["serve", str(tiny_llama), "--kv-offload-size", "2GiB", "--kv-offload-dir", "/x"])
    args = serve_args_from(ns)
    assert args.engine_kwargs()["kv_offload_size"] == "2GiB" and args.engine_kwargs()["kv_offload_dir"] == "/x"


def test_new_weights_at_the_same_path_get_a_tier_of_their_own(tiny_model_factory, tmp_path):
    import os
    import shutil

    from pagedserve.engine.config import EngineConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), model)
    spec = EngineConfig(model=str(model), kv_offload_size="1MiB").kv_offload_spec()
    assert spec == EngineConfig(model=str(model), kv_offload_size="1MiB").kv_offload_spec()
    assert spec.size_bytes == 1024**2 and spec.offload_dir is None
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert EngineConfig(model=str(model), kv_offload_size="1MiB").kv_offload_spec().model_identity != spec.model_identity
    assert EngineConfig(model=str(model)).kv_offload_spec() is None
