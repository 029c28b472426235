"""The KV read path under attack (issue 26): a producer serves a read only for a hold it issued, with
that hold's token, from that hold's own blocks, before its deadline; a read is checked before anything
is sized or allocated; a gather in progress pins its hold; a release needs the hold's token; a Ray read
needs the deployment's signature.

KVSource, the scheduler half and the Ray rank server directly; then whole engines handed forged
kv_transfer_params over the in-process and torch_p2p (loopback) transports: the consumer's greedy
output is the monolithic engine's (it recomputes), the victim's hold survives, and every block on both
engines is free afterwards. The Ray transport end to end: tests/test_pd_layouts.py.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pagedserve.cluster.pd.read_auth import ReadAuth, ReadAuthError, ReadVerifier, sign_read
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.connectors import p2p_protocol
from pagedserve.kv_transfer.holds import MAX_ID_CHARS, HoldGrant, hash_token, new_hold_token
from pagedserve.kv_transfer.kv_source import KVSource, ReadRefused, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.rank_read import read_layers
from pagedserve.kv_transfer.scheduler_connector import PDConnectorScheduler

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", block_size=4)
NUM_BLOCKS = 8
FAR = 10**12  # a deadline that never comes (with the real clock)


def _caches(layout: KVLayout = LAYOUT, rank: int = 0, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    heads = len(layout.heads_of(rank))
    shape = (NUM_BLOCKS, layout.block_size, heads, layout.head_size)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in layout.layers_of(rank)]


def _grant(source: KVSource, hold_id: str, block_ids, deadline: float = FAR, token: str | None = None,
           num_tokens: int | None = None) -> str:
    token = token or new_hold_token()
    n = len(block_ids) * source.layout.block_size if num_tokens is None else num_tokens
    source.register([HoldGrant(hold_id, hash_token(token), tuple(block_ids), n, deadline)])
    return token


def _spec(hold_id, token, start=0, end=8, layers=(0, 1, 2), heads=(0, 2)) -> ReadSpec:
    return ReadSpec(hold_id, token, start, end, tuple(layers), heads[0], heads[1])


def _oracle(source: KVSource, block_ids, start: int, end: int, layer: int, heads=(0, 2)) -> torch.Tensor:
    """K of `layer` for tokens [start, end) of a hold over `block_ids`, straight from the cache."""
    key_cache = source.kv_caches[layer - source.layers.start][0]
    bs = source.layout.block_size
    h0, h1 = heads[0] - source.heads.start, heads[1] - source.heads.start
    return torch.stack([key_cache[block_ids[t // bs], t % bs, h0:h1] for t in range(start, end)])


# ---------------------------------------------------------------------- KVSource: what a read may name


def test_a_hold_reads_its_own_blocks_and_nothing_else_can_be_named():
    source = KVSource(LAYOUT, 0, _caches())
    a_token, b_token = _grant(source, "a@0", (0, 1)), _grant(source, "b@1", (5, 6))
    k, v = source.read_layer(_spec("a@0", a_token, 1, 7), 2)
    assert torch.equal(k, _oracle(source, (0, 1), 1, 7, 2))
    # The wire cannot name blocks: a frame for hold a that names b's blocks (and no expiry) reads a's.
    frame = {**p2p_protocol.spec_to_json(_spec("a@0", a_token, 0, 8)), "block_ids": [5, 6], "expires_at": None}
    spec = source.check_request(p2p_protocol.spec_from_json(frame))
    got = source.read_layer(spec, 0)[0]
    assert torch.equal(got, _oracle(source, (0, 1), 0, 8, 0))
    assert not torch.equal(got, _oracle(source, (5, 6), 0, 8, 0))
    # Hold a's id with hold b's token (or any other token) is refused.
    for token in (b_token, "guessed", a_token[:-1]):
        with pytest.raises(ReadRefused, match="wrong hold token"):
            source.open(_spec("a@0", token))
    assert source.reads_refused == 3


def test_never_issued_expired_and_released_holds_are_refused():
    now = [1000.0]
    source = KVSource(LAYOUT, 0, _caches(), clock=lambda: now[0])
    token = _grant(source, "live@4", (2, 3), deadline=1010.0)
    # Never issued: an id no producer makes, or a sequence number this rank has passed: refused at once.
    for hold_id in ("made-up", "live@3", "live@04x", "other@2"):
        with pytest.raises(ReadRefused, match="no such hold"):
            source.open(_spec(hold_id, token))
    source.open(_spec("live@4", token))  # (the hold itself is readable)
    now[0] = 1010.5
    with pytest.raises(ReadRefused, match="hold expired"):
        source.open(_spec("live@4", token))
    now[0] = 1000.0
    source.revoke(["live@4"])
    with pytest.raises(ReadRefused, match="no such hold"):
        source.open(_spec("live@4", token))
    source.register([HoldGrant("live@4", hash_token(token), (2, 3), 8, 1010.0)])  # a replayed grant
    assert source.live_holds() == set()  # a revoked hold never comes back


def test_grants_outside_the_cache_are_ignored():
    source = KVSource(LAYOUT, 0, _caches())
    token = _grant(source, "far@0", (1, NUM_BLOCKS))  # block 8 of blocks 0-7
    _grant(source, "neg@1", (-1,))
    _grant(source, "long@2", (1,), num_tokens=5)  # 5 tokens in one block of 4
    assert source.live_holds() == set()
    with pytest.raises(ReadRefused, match="no such hold"):
        source.open(_spec("far@0", token))


class _AllocationSpy:
    """Records the tensors torch allocates by size (arange/tensor/zeros/empty/full)."""

    NAMES = ("arange", "tensor", "zeros", "empty", "full")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return spy


def test_specs_are_checked_before_anything_is_allocated(monkeypatch):
    source = KVSource(LAYOUT, 0, _caches())
    token = _grant(source, "h@0", (0, 1))
    bad = {
        "token_end=10**8": _spec("h@0", token, 0, 10**8),
        "beyond the cache": _spec("h@0", token, 0, NUM_BLOCKS * 4 + 1),
        "beyond the hold": _spec("h@0", token, 0, 12),
        "negative start": _spec("h@0", token, -4, 4),
        "empty range": _spec("h@0", token, 4, 4),
        "heads the model lacks": _spec("h@0", token, heads=(0, 3)),
        "layers the model lacks": _spec("h@0", token, layers=(0, 3)),
        "layers out of order": _spec("h@0", token, layers=(1, 0)),
        "a float": ReadSpec("h@0", token, 0.0, 8, (0,), 0, 2),
        "a boolean": ReadSpec("h@0", token, 0, 8, (True,), 0, 2),
        "a list of layers": ReadSpec("h@0", token, 0, 8, [0], 0, 2),
        "a long id": _spec("h" * (MAX_ID_CHARS + 1), token),
        "an unprintable id": _spec("h@0\n", token),
        "a non-ASCII id": _spec("h@０", token),
        "a token that is not text": _spec("h@0", b"x" * 32),
        "a long token": _spec("h@0", "t" * (MAX_ID_CHARS + 1)),
        "not a spec": SimpleNamespace(**vars(_spec("h@0", token))),
    }
    spy = _AllocationSpy(monkeypatch)
    for what, spec in bad.items():
        with pytest.raises(ReadRefused):
            source.read_layer(spec, 0)
        assert spy.calls == [], f"{what}: allocated {spy.calls} before refusing"
    k, _ = source.read_layer(_spec("h@0", token, 0, 8), 0)
    assert "arange" in spy.calls and k.shape == (8, 2, 4)  # (the spy sees a read's allocations)
    assert source.reads_refused == len(bad)


def test_heads_and_layers_of_another_rank_are_refused():
    tp2 = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", block_size=4, tp_size=2)
    source = KVSource(tp2, 1, _caches(tp2, rank=1))  # rank 1 holds head 1
    token = _grant(source, "h@0", (0, 1))
    with pytest.raises(ReadRefused, match="not on this rank"):
        source.open(_spec("h@0", token, heads=(0, 1)))
    assert torch.equal(source.read_layer(_spec("h@0", token, heads=(1, 2)), 1)[0],
                       _oracle(source, (0, 1), 0, 8, 1, heads=(1, 2)))
    pp2 = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", block_size=4, pp_size=2)
    stage = KVSource(pp2, 0, _caches(pp2))
    token = _grant(stage, "h@0", (0, 1))
    mine, theirs = tuple(stage.layers), tuple(pp2.layers_of(1))
    with pytest.raises(ReadRefused, match="not all on this rank"):
        stage.open(_spec("h@0", token, layers=(mine[-1], theirs[0])))
    stage.open(_spec("h@0", token, layers=mine))


def test_peer_chosen_ids_are_bounded_and_escaped_in_messages():
    source = KVSource(LAYOUT, 0, _caches())
    for hold_id in ("x" * 100_000, "evil\x1b[2J\nFAKE LOG LINE"):
        with pytest.raises(ReadRefused) as refused:
            source.open(_spec(hold_id, "t"))
        message = str(refused.value)
        assert len(message) < 400 and "\n" not in message and "\x1b" not in message
    # The producer's own hold ids are short and printable whatever the client named its request.
    connector, request = _producer_connector(), _finished_request("r\n\x1b" * 200 + "é")
    assert connector.request_finished(request, [0, 1])
    hold_id = request.kv_transfer_params_out["remote_request_id"]
    assert len(hold_id) <= MAX_ID_CHARS and hold_id.isascii() and hold_id.isprintable() and hold_id.endswith("@0")


# ---------------------------------------------------------------------- registration races


class _WaitObserved(KVSource):
    """Sets `waiting` when a read of an unknown hold starts waiting for its registration."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = threading.Event()

    def _may_still_register(self, hold_id: str) -> bool:
        ahead = super()._may_still_register(hold_id)
        if ahead:
            self.waiting.set()
        return ahead


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_read_that_arrives_before_its_registration_waits_for_it():
    source = _WaitObserved(LAYOUT, 0, _caches(), registration_wait_s=60)
    _grant(source, "earlier@4", (0,))
    token = new_hold_token()
    thread, result = _in_thread(lambda: source.read_layer(_spec("late@5", token, 0, 4), 0))
    assert source.waiting.wait(30)
    source.register([HoldGrant("late@5", hash_token(token), (3,), 4, FAR)])
    thread.join(30)
    assert "error" not in result, result
    assert torch.equal(result["value"][0], _oracle(source, (3,), 0, 4, 0))


def test_ids_that_can_never_be_registered_do_not_wait_and_a_late_one_waits_boundedly():
    source = _WaitObserved(LAYOUT, 0, _caches(), registration_wait_s=600)
    _grant(source, "seen@7", (0,))
    for hold_id in ("seen@6", "made-up", "x@"):
        with pytest.raises(ReadRefused, match="no such hold"):
            source.open(_spec(hold_id, "t"))
    assert not source.waiting.is_set()
    short = _WaitObserved(LAYOUT, 0, _caches(), registration_wait_s=0.05)
    with pytest.raises(ReadRefused, match="no such hold"):
        short.open(_spec("never@99", "t"))
    assert short.waiting.is_set()


# ---------------------------------------------------------------------- a gather pins its hold


class _GatedSource(KVSource):
    """A source whose gather stops in the middle until the test lets it go on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.go_on = threading.Event(), threading.Event()

    def _gather(self, read, layer):
        self.entered.set()
        assert self.go_on.wait(30)
        return super()._gather(read, layer)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_revocation_during_a_gather_waits_for_it_and_the_next_layer_is_refused():
    source = _GatedSource(LAYOUT, 0, _caches())
    token = _grant(source, "pinned@0", (4, 5))
    spec = _spec("pinned@0", token)
    expected = [_oracle(source, (4, 5), 0, 8, layer) for layer in range(3)]
    read = source.open(spec)
    reader, result = _in_thread(lambda: source.read_layer(spec, 0, read))
    assert source.entered.wait(30)  # the gather of layer 0 is in progress
    revoked = threading.Event()
    revoker, _ = _in_thread(lambda: (source.revoke(["pinned@0"]), revoked.set()))
    _wait_until(lambda: "pinned@0" not in source.live_holds())  # the revocation has begun...
    assert not revoked.is_set() and revoker.is_alive()  # ...and waits for the gather
    source.go_on.set()
    reader.join(30)
    revoker.join(30)
    assert revoked.is_set()
    assert torch.equal(result["value"][0], expected[0])
    for key_cache, value_cache in source.kv_caches:  # the blocks are reused once the revocation returned
        key_cache[4:6] = 0
        value_cache[4:6] = 0
    with pytest.raises(ReadRefused, match="released or expired during the read"):
        source.read_layer(spec, 1, read)


def test_an_expiry_during_a_gather_lets_it_finish_and_refuses_the_next_layer():
    now = [1000.0]
    source = _GatedSource(LAYOUT, 0, _caches(), clock=lambda: now[0])
    token = _grant(source, "late@0", (2,), deadline=1001.0)
    spec = _spec("late@0", token, 0, 4)
    read = source.open(spec)
    reader, result = _in_thread(lambda: source.read_layer(spec, 0, read))
    assert source.entered.wait(30)
    now[0] = 1002.0  # the deadline passes mid-gather
    source.go_on.set()
    reader.join(30)
    assert torch.equal(result["value"][0], _oracle(source, (2,), 0, 4, 0))
    with pytest.raises(ReadRefused, match="expired during the read"):
        source.read_layer(spec, 1, read)


# ---------------------------------------------------------------------- the scheduler half: grants and releases


def _producer_connector() -> PDConnectorScheduler:
    config = KVTransferConfig(kv_connector="inproc", kv_role="kv_producer")
    return PDConnectorScheduler(config, LAYOUT, LAYOUT.block_size)


def _finished_request(request_id: str, num_tokens: int = 8) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(num_tokens)), output_token_ids=[3],
                           sampling_params=SimpleNamespace(kv_transfer_params={"do_remote_decode": True}),
                           status=SimpleNamespace(finish_reason="length"))


def test_a_release_needs_the_holds_token():
    connector = _producer_connector()
    request = _finished_request("r")
    assert connector.request_finished(request, [2, 3])
    params = request.kv_transfer_params_out
    hold_id, token = params["remote_request_id"], params["remote_hold_token"]
    assert "remote_block_ids" not in params  # blocks are the producer's business
    connector.release([(hold_id, "guessed"), (hold_id, None), ("other@0", token), ("junk",), (hold_id,)])
    assert connector.take_freeable() == [] and connector.has_held
    assert connector.snapshot_stats().refused_releases == 2  # (releases of no hold are merely ignored)
    connector.release([(hold_id, token)])
    assert connector.take_freeable() == [request] and not connector.has_held
    assert connector.build_connector_metadata().revoked == [hold_id]
    connector.release([(hold_id, token)])  # again (a reader and the router both release): the hold is gone
    assert connector.take_freeable() == [] and connector.snapshot_stats().refused_releases == 2


def test_holds_reach_local_ranks_at_once_and_other_ranks_with_the_next_step():
    remote_only = _producer_connector()
    request = _finished_request("r")
    remote_only.request_finished(request, [2, 3])
    assert remote_only.has_pending_releases  # the engine steps once more to deliver the grant
    (grant,) = remote_only.build_connector_metadata().registered
    token = request.kv_transfer_params_out["remote_hold_token"]
    assert grant.token_hash == hash_token(token) and token not in repr(grant)
    assert (grant.block_ids, grant.num_tokens) == ((2, 3), 8) and not remote_only.has_pending_releases

    local = _producer_connector()
    source = KVSource(LAYOUT, 0, _caches())
    local.attach_local_source(source)
    request = _finished_request("s")
    local.request_finished(request, [6, 7])
    params = request.kv_transfer_params_out
    assert source.live_holds() == {params["remote_request_id"]}  # before the output leaves the engine
    assert not local.has_pending_releases  # every rank is local: no step owed
    source.release(params["remote_request_id"], "guessed")
    source.release(params["remote_request_id"], params["remote_hold_token"])
    assert local.take_freeable() == [request] and local.snapshot_stats().refused_releases == 1


# ---------------------------------------------------------------------- Ray reads: signed by the deployment

SECRET = b"s" * 32


def _rank_hooks(source: KVSource, serving_token: str = "serving") -> SimpleNamespace:
    """The worker half of a producer rank's KV connector, as `Worker.kv_read` hands it to `read_layers`."""
    transport = SimpleNamespace(token=serving_token, verifier=ReadVerifier(SECRET, source.rank))
    return SimpleNamespace(source=source, transport=transport)


def test_ray_reads_are_refused_unless_signed_with_the_deployment_secret():
    source = KVSource(LAYOUT, 0, _caches())
    hooks = _rank_hooks(source)
    token = _grant(source, "h@0", (1, 2))
    spec = _spec("h@0", token)
    good = sign_read(SECRET, "serving", 0, spec, [0])
    ((k, _),) = read_layers(hooks, "serving", spec, [0], good)
    assert torch.equal(k, _oracle(source, (1, 2), 0, 8, 0))
    altered = _spec("h@0", token, 0, 4)
    forged = {
        "unsigned": None,
        "another secret": sign_read(b"x" * 32, "serving", 0, spec, [0]),
        "replayed": good,
        "signed for another rank": sign_read(SECRET, "serving", 1, spec, [0]),
        "signed for other layers": sign_read(SECRET, "serving", 0, spec, [1]),
        "a spec altered after signing": sign_read(SECRET, "serving", 0, altered, [0]),
        "stale": sign_read(SECRET, "serving", 0, spec, [0], clock=lambda: time.time() - 3600),
        "from the future": sign_read(SECRET, "serving", 0, spec, [0], clock=lambda: time.time() + 3600),
        "a short signature": ReadAuth(time.time(), "n", b"x"),
    }
    for what, auth in forged.items():
        with pytest.raises(ReadAuthError):
            read_layers(hooks, "serving", spec, [0], auth)
        assert source.reads_refused == 0, f"{what}: reached the source"
    # A signed read is still only a read of a hold it names with its token.
    for bad in (_spec("h@0", "guessed"), _spec("gone@0", token)):
        with pytest.raises(ReadRefused):
            read_layers(hooks, "serving", bad, [0], sign_read(SECRET, "serving", 0, bad, [0]))
    with pytest.raises(ConnectionError, match="restarted"):
        read_layers(hooks, "an earlier incarnation", spec, [0], sign_read(SECRET, "serving", 0, spec, [0]))
    with pytest.raises(ReadRefused, match="not part of the read"):
        layers = [0, 1]
        narrow = _spec("h@0", token, layers=(0,))
        read_layers(hooks, "serving", narrow, layers, sign_read(SECRET, "serving", 0, narrow, layers))


# ---------------------------------------------------------------------- whole engines, forged kv_transfer_params

MAX_NEW = 6


def _engines(model, connector: str):
    from pagedserve.engine import LLM

    def config(role: str) -> dict:
        extra = {"kv_host": "127.0.0.1"} if connector == "torch_p2p" else {}
        return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}

    kw = dict(model=str(model), dtype="float32", num_kv_blocks=48, block_size=4, max_num_batched_tokens=64)
    # (No prefix cache on the consumer: every decode tries to load the whole prompt.)
    return (LLM(**kw, kv_transfer_config=config("kv_producer")),
            LLM(**kw, kv_transfer_config=config("kv_consumer"), enable_prefix_caching=False), LLM(**kw))


def _generate(llm, prompts, params_list) -> list[list[int]]:
    from pagedserve.engine import SamplingParams

    sp = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, kv_transfer_params=p) for p in params_list]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prefill(producer, prompts) -> list:
    from pagedserve.engine import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
    return producer.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _hold(params: dict) -> tuple[str, str]:
    return params["remote_request_id"], params["remote_hold_token"]


def _drain(*llms) -> None:
    for llm in llms:
        engine = llm.llm_engine
        deadline = time.monotonic() + 30
        while engine.free_released_kv() and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


@pytest.mark.parametrize("connector", ["inproc", "torch_p2p"])
def test_forged_kv_transfer_params_get_no_foreign_kv(tiny_llama, connector):
    producer, consumer, mono = _engines(tiny_llama, connector)
    try:
        a_prompt, b_prompt, c_prompt = [[(13 * i + 7 * k) % 400 + 20 for k in range(12)] for i in range(3)]
        want = _generate(mono, [a_prompt, b_prompt], [None, None])
        pre = _prefill(producer, [a_prompt, b_prompt])  # same length: either could pass for the other
        a, b = (o.kv_transfer_params for o in pre)
        b_blocks = producer.llm_engine.engine_core.kv_cache_manager.get_block_ids(pre[1].request_id)
        assert b_blocks

        def decode_a(params: dict, loads: int) -> None:
            before = consumer.llm_engine.get_stats().kv_transfer
            assert _generate(consumer, [a_prompt], [params]) == [want[0]]
            after = consumer.llm_engine.get_stats().kv_transfer
            assert (after["loads"] - before["loads"], after["fallbacks"] - before["fallbacks"]) == (loads, 1 - loads)

        decode_a({**a, "remote_hold_token": b["remote_hold_token"]}, loads=0)  # a's hold, b's token
        decode_a({**b, "remote_hold_token": "guessed-" + "x" * 35}, loads=0)  # b's hold, a guessed token
        decode_a({**a, "remote_request_id": "made-up@0"}, loads=0)  # a hold id never issued
        never_handed = {"do_remote_prefill": True, "remote_engine_id": a["remote_engine_id"],
                        "remote_request_id": "5@1", "remote_hold_token": "guessed", "remote_num_tokens": 12,
                        "remote_layout": a["remote_layout"], "remote_addresses": a["remote_addresses"],
                        "kv_connector": connector, "expires_at": time.time() + 600}
        decode_a(never_handed, loads=0)
        # a's own capability naming b's blocks: the producer reads a's blocks (it never takes block ids).
        decode_a({**a, "remote_block_ids": b_blocks}, loads=1)
        # Forged releases do not free b. a goes (its reader released it; the router releases it again).
        producer.llm_engine.release_kv([(b["remote_request_id"], a["remote_hold_token"]),
                                        (b["remote_request_id"], "guessed"), _hold(a)])
        c = _prefill(producer, [c_prompt])[0].kv_transfer_params  # a step: frees a, revokes it at the ranks
        decode_a(a, loads=0)  # a released hold
        before = consumer.llm_engine.get_stats().kv_transfer["loads"]
        assert _generate(consumer, [b_prompt], [b]) == [want[1]]  # the victim's hold was intact
        assert consumer.llm_engine.get_stats().kv_transfer["loads"] == before + 1
        producer.llm_engine.release_kv([_hold(c)])
        _drain(producer, consumer, mono)
        if connector == "inproc":  # (torch_p2p releases arrive on the transport's threads)
            # The readers of a's hold with b's token and of b's with a guess, and the two forged releases of b.
            assert producer.llm_engine.get_stats().kv_transfer["refused_releases"] == 4
    finally:
        for llm in (producer, consumer, mono):
            llm.shutdown()
