"""No request ever reads KV that a load did not fill: blocks a KV connector is still loading are no
prefix hits for anyone, and a load that fails rolls back every request that read its blocks (vLLM's
invalid-block handling).

The scheduler tests drive the real scheduler, KV cache manager and consumer connector with a fake
runner that models the KV cache slot by slot: a load writes (token, position) into its slots (or
garbage when it fails), each scheduled token writes its own, and every request's computation checks
that all the KV it attends to is its own prompt's, intact. The engine tests run a producer and a
consumer LLM in one process (in-process transport) and compare every output with the monolithic
engine's, logprobs included (the tiny random models' greedy tokens are not sensitive enough alone).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.scheduler_connector import PDConnectorScheduler
from tests.test_kv_cache_manager import Req
from tests.test_scheduler import BS, EOS, FakeRunner, Harness, blocks_for, make_config, make_request, prompt

GARBAGE = ("garbage", -1)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BS)


# ---------------------------------------------------------------------- KV cache manager


def _mgr(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=True)


def test_blocks_being_loaded_are_no_prefix_hits_until_the_load_lands() -> None:
    kv = _mgr()
    tokens = list(range(1, 14))  # 3 full blocks and a tail of 1
    a = Req("a", tokens)
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 13, num_loading_tokens=12)
    a.num_computed_tokens = 13
    b = Req("b", tokens + [99])
    assert kv.get_computed_blocks(b) == ([], 0)  # the load is still in flight
    kv.finish_load(a)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 12 and [x.block_id for x in blocks] == kv.get_block_ids("a")[:3]


def test_a_load_after_local_hits_keeps_the_hits_cached_and_gates_only_the_loaded_blocks() -> None:
    kv = _mgr()
    shared = list(range(1, 9))  # 2 full blocks
    first = Req("first", shared + [50])
    kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    a = Req("a", shared + list(range(20, 29)))  # 17 tokens: 2 hit blocks, 2 loaded full blocks, a tail
    hits, num_hit = kv.get_computed_blocks(a)
    assert num_hit == 8
    kv.allocate_slots(a, 17 - 8, 8, hits, num_loading_tokens=8)
    a.num_computed_tokens = 17
    probe, num_probe = kv.get_computed_blocks(Req("probe", a.all_token_ids + [7]))
    assert num_probe == 8  # the shared prefix, not the blocks being loaded
    kv.free(a)
    assert kv.get_computed_blocks(Req("probe2", a.all_token_ids + [7]))[1] == 8
    kv.free(first)
    assert kv.num_free_blocks == kv.num_blocks


def test_invalidate_blocks_reports_every_holder_from_its_first_invalid_block_and_drops_the_hashes() -> None:
    kv = _mgr()
    base = list(range(1, 13))  # 3 full blocks
    a = Req("a", base + [40])
    kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    b = Req("b", base + list(range(60, 66)))  # hits a's 3 blocks, adds one full block and a tail
    hits, num_hit = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 18 - num_hit, num_hit, hits)
    b.num_computed_tokens = 18
    c = Req("c", list(range(100, 110)))  # unrelated
    kv.allocate_slots(c, 10)
    c.num_computed_tokens = 10
    bad = kv.get_block_ids("a")[1]
    assert kv.invalidate_blocks([bad]) == {"a": 1, "b": 1}
    # The invalid block and every block after it in a holder's chain are gone from the cache; the
    # first block (valid) and the unrelated request's blocks stay hits.
    assert kv.get_computed_blocks(Req("p", b.all_token_ids + [1]))[1] == BS
    assert kv.get_computed_blocks(Req("q", c.all_token_ids + [1]))[1] == 8
    # Recomputing registers them again (the watermark went back to the invalid block).
    assert kv.num_cached_blocks["b"] == 1
    kv.allocate_slots(b, 0)  # (as the scheduler does for the recompute chunk; b's tokens are all known)
    assert kv.get_computed_blocks(Req("r", b.all_token_ids + [1]))[1] == 16
    for r in (a, b, c):
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks and not kv._loading_from


def test_num_loading_tokens_is_validated() -> None:
    kv = _mgr()
    with pytest.raises(ValueError, match="num_loading_tokens"):
        kv.allocate_slots(Req("a", list(range(1, 6))), 4, num_loading_tokens=5)


# ---------------------------------------------------------------------- scheduler, fake KV slots


def remote_params(prompt_len: int, hold: str) -> dict:
    """What a producer hands a reader (the fake runner, not a producer, serves the load)."""
    return {"do_remote_prefill": True, "remote_engine_id": "producer", "remote_request_id": hold,
            "remote_block_ids": [], "remote_num_tokens": prompt_len, "remote_layout": LAYOUT.to_dict(),
            "remote_addresses": ["nowhere"], "kv_connector": "inproc", "expires_at": time.time() + 600,
            "remote_hold_token": "token"}


def pd_request(rid: str, tokens: list[int], hold: str, max_tokens: int = 4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, kv_transfer_params=remote_params(len(tokens), hold))
    return Request(rid, list(tokens), sp, {EOS}, max_tokens)


class SlotRunner(FakeRunner):
    """FakeRunner plus a model of the KV cache's slots: loads fill theirs (garbage when they fail), each
    scheduled token writes its own, and every request must attend to nothing but its own intact KV."""

    def __init__(self, sched: Scheduler, kv: KVCacheManager, failing_holds: set[str]) -> None:
        super().__init__(sched, kv)
        self.failing_holds = failing_holds
        self.slots: dict[int, tuple] = {}
        self.num_computed_by: dict[str, int] = {}  # tokens each request computed itself (not loaded)

    def _slot(self, rid: str, pos: int) -> int:
        ids = self.states[rid].block_ids
        return ids[pos // BS] * BS + pos % BS

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        md = so.kv_connector_metadata
        loads = [] if md is None else md.loads
        starts = {}
        out = super().execute(so)  # applies the diffs, checks the mirror, samples
        failed = set()
        for job in loads:  # (the real runner loads every layer before that layer's attention)
            ok = job.remote["remote_request_id"] not in self.failing_holds
            tokens = self.sched.requests[job.req_id].all_token_ids
            if not ok:
                failed.add(job.req_id)
            for pos in range(job.token_start, job.token_end):
                self.slots[job.block_ids[pos // BS] * BS + pos % BS] = (tokens[pos], pos) if ok else GARBAGE
        for rid, n in so.num_scheduled_tokens.items():
            starts[rid] = self.states[rid].num_computed_tokens - n
            tokens = self.states[rid].token_ids
            for pos in range(starts[rid], starts[rid] + n):  # each layer writes the step's KV before attending
                self.slots[self._slot(rid, pos)] = (tokens[pos], pos) if rid not in failed else GARBAGE
            self.num_computed_by[rid] = self.num_computed_by.get(rid, 0) + n
        for rid, n in so.num_scheduled_tokens.items():
            if rid in failed:
                continue  # it attends to the garbage; the scheduler must drop this result
            tokens = self.states[rid].token_ids
            for pos in range(starts[rid] + n):
                got = self.slots.get(self._slot(rid, pos))
                assert got == (tokens[pos], pos), f"{rid} attends to {got} at position {pos}, not its own KV"
        out.kv_load_failed = failed
        return out


class RollbackHarness(Harness):
    """test_scheduler's Harness, with its block-count invariant widened: a rolled-back request keeps the
    blocks past its valid prefix (it recomputes into them), so it may hold more than its computed tokens
    need, though never more than its known tokens do."""

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        self.num_steps += 1
        kv = self.kv
        running = {r.request_id for r in self.sched.running}
        assert so.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens and set(so.num_scheduled_tokens) <= running
        for r in self.sched.running:
            held = len(kv.get_block_ids(r.request_id))
            assert blocks_for(r.num_computed_tokens, BS) <= held <= blocks_for(r.num_tokens, BS), r.request_id
        for r in self.sched.waiting:
            assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
        owners = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        assert all(b.ref_cnt == owners[b.block_id] for b in kv.block_pool.blocks)
        assert kv.num_free_blocks == sum(1 for b in kv.block_pool.blocks if b.ref_cnt == 0)
        self.note_finished_ids(so)
        for out in self.sched.update_from_output(so, self.runner.execute(so)):
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reason[out.request_id] = out.finish_reason
        return so


def pd_harness(failing_holds: set[str], num_blocks: int = 64, **config) -> Harness:
    h = RollbackHarness(num_blocks=num_blocks, **config)
    connector = PDConnectorScheduler(KVTransferConfig(kv_connector="inproc", kv_role="kv_consumer"), LAYOUT, BS)
    h.sched = Scheduler(make_config(**config), h.kv, kv_connector=connector)
    h.runner = SlotRunner(h.sched, h.kv, failing_holds)
    return h


def finish(h: Harness, expected: dict[str, int]) -> None:
    h.run()
    for rid, n in expected.items():
        assert h.tokens[rid] == h.expected(rid, n), rid
    h.assert_drained()
    connector = h.sched.kv_connector
    assert connector is None or (not connector._in_load and not connector._readers)


SHARED = prompt(16, start=200)  # four full blocks of a shared "system prompt"


@pytest.mark.parametrize("budget", [64, 5])
def test_same_step_a_failed_load_is_read_by_nobody_else(budget: int) -> None:
    h = pd_harness({"hold-a"}, budget=budget)
    h.add(pd_request("a", SHARED + prompt(5, 1), "hold-a"), pd_request("b", SHARED + prompt(6, 50), "hold-b"))
    so = h.step()
    assert set(so.num_scheduled_tokens) == {"a", "b"}  # one step: both load
    assert [job.req_id for job in so.kv_connector_metadata.loads] == ["a", "b"]
    a = h.sched.requests["a"]
    assert a.num_computed_tokens == 0 and a.kv_load_failed  # rolled back to its first loaded block
    finish(h, {"a": 4, "b": 4})
    stats = h.sched.kv_connector.stats
    assert (stats.loads, stats.load_failures, stats.fallbacks) == (1, 1, 1)
    assert stats.loaded_tokens == len(SHARED) + 5  # b loaded its whole prompt but the last token itself


def test_a_failed_load_after_local_hits_recomputes_only_from_the_first_loaded_block() -> None:
    h = pd_harness({"hold-a"})
    h.add(make_request("local", SHARED + [7], max_tokens=1))
    h.run()
    h.add(pd_request("a", SHARED + prompt(9, 1), "hold-a"))
    so = h.step()
    assert so.kv_connector_metadata.loads[0].token_start == len(SHARED)  # the shared blocks were hits
    assert h.sched.requests["a"].num_computed_tokens == len(SHARED)  # rolled back to the hits, not to 0
    h.step()
    assert h.runner.num_computed_by["a"] == 1 + 9  # the failed step's token, then only the unshared 9
    finish(h, {"local": 1, "a": 4})


def test_a_batch_in_flight_never_hits_blocks_whose_load_has_not_come_back() -> None:
    """Pipeline parallelism: step 2 is scheduled while step 1 (the load) still runs."""
    h = pd_harness({"hold-a"})
    h.add(pd_request("a", SHARED + prompt(5, 1), "hold-a"))
    first = h.sched.schedule()
    first_result = h.runner.execute(first)
    h.add(make_request("b", SHARED + prompt(3, 90)))  # a monolithic request with the same prefix
    second = h.sched.schedule()
    assert set(second.num_scheduled_tokens) == {"b"}
    assert h.sched.requests["b"].num_cached_tokens == 0  # a's blocks were still loading: no hit
    second_result = h.runner.execute(second)
    for so, result in ((first, first_result), (second, second_result)):
        for out in h.sched.update_from_output(so, result):
            h.tokens[out.request_id] += out.new_token_ids
    finish(h, {"a": 4, "b": 4})


def test_a_load_that_landed_is_a_prefix_hit_for_the_next_step() -> None:
    h = pd_harness(set())
    h.add(pd_request("a", SHARED + prompt(5, 1), "hold-a"))
    h.step()
    h.add(make_request("b", SHARED + prompt(3, 90)))
    h.step()
    assert h.sched.requests["b"].num_cached_tokens == len(SHARED)
    finish(h, {"a": 4, "b": 4})


@pytest.mark.parametrize("fail", [set(), {"hold-n"}, {"hold-a"}])
def test_n_children_of_one_hold_and_a_failing_neighbour(fail: set[str]) -> None:
    h = pd_harness(fail)
    tokens = SHARED + prompt(6, 1)
    h.add(pd_request("a", SHARED + prompt(5, 30), "hold-a"))
    h.add(*[pd_request(f"n#{i}", tokens, "hold-n") for i in range(3)])
    h.step()
    finish(h, {"a": 4, **{f"n#{i}": 4 for i in range(3)}})


def test_preemption_after_a_failed_load() -> None:
    """A cache too small for everyone: a rolled-back request is preempted and resumes, and still reads
    only intact KV."""
    h = pd_harness({"hold-a", "hold-c"}, num_blocks=14, budget=16)
    h.add(*[pd_request(r, SHARED + prompt(4 + i, 10 * i), f"hold-{r}", max_tokens=8) for i, r in enumerate("abc")])
    finish(h, {r: 8 for r in "abc"})
    assert h.sched.num_preemptions > 0


# ---------------------------------------------------------------------- invalid-block rollback, generally


def test_every_request_reading_an_invalid_block_rolls_back_and_one_in_flight_drops_its_result() -> None:
    """Blocks shared by prefix hits turn out invalid: both holders recompute from the first invalid
    block; their batch in flight is dropped when it returns."""
    h = RollbackHarness()
    h.add(make_request("a", SHARED + prompt(3, 1), max_tokens=6))
    h.step()
    h.add(make_request("b", SHARED + prompt(2, 40), max_tokens=6))
    h.step()  # b hits a's four shared blocks
    assert h.sched.requests["b"].num_cached_tokens == len(SHARED)
    in_flight = h.sched.schedule()  # a and b decode
    result = h.runner.execute(in_flight)  # ... and their result is not back yet
    bad = h.kv.get_block_ids("a")[2]
    assert sorted(h.sched.roll_back_invalid_blocks([bad])) == ["a", "b"]
    for rid in "ab":
        assert h.sched.requests[rid].num_computed_tokens == 2 * BS
    assert h.sched.update_from_output(in_flight, result) == []  # both computed over the invalid block
    left = {rid: h.sched.requests[rid].num_tokens - 2 * BS for rid in "ab"}
    so = h.step()
    assert so.num_scheduled_tokens == left
    assert all(c.resumed_from_preemption for c in so.scheduled_cached_reqs)
    finish(h, {"a": 6, "b": 6})


def test_a_holder_that_never_computed_past_the_invalid_block_is_left_alone() -> None:
    h = RollbackHarness()
    h.add(make_request("a", prompt(10), max_tokens=3))
    h.step()
    last = h.kv.get_block_ids("a")[-1]  # holds a's 10th token and the slot its next token goes to
    before = h.sched.requests["a"].num_computed_tokens
    assert h.sched.roll_back_invalid_blocks([last]) == ["a"]
    assert h.sched.requests["a"].num_computed_tokens == 2 * BS < before
    assert h.sched.roll_back_invalid_blocks([last]) == []  # rolled back already: nothing past it computed
    finish(h, {"a": 3})


# ---------------------------------------------------------------------- engines: producer, consumer, monolithic


def _same_outputs(got, want) -> None:
    """Token for token, and every logprob within float32 noise (chunked recompute reorders sums)."""
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            for gl, wl in zip(gc.logprobs, wc.logprobs):
                assert gl.keys() == wl.keys()
                assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in gl), (g.request_id, gl, wl)


def _engines(tiny_llama, **consumer):
    from tests.test_kv_transfer import _llm

    return _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer", **consumer)


def _released(producer, prompts):
    """Holds for `prompts` that the producer has already freed (and whose blocks it may have reused):
    every read of them fails."""
    from tests.test_kv_transfer import _hold, _prefill, _prompts

    remote = _prefill(producer, prompts)
    producer.llm_engine.release_kv([_hold(r) for r in remote])
    filler = _prefill(producer, _prompts(99, [30]))[0]  # this step frees them (and may reuse their blocks)
    producer.llm_engine.release_kv([_hold(filler)])
    return remote


@pytest.mark.parametrize("consumer", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 24}],
                         ids=["one-step", "chunked", "small-cache"])
def test_two_requests_sharing_a_system_prompt_one_load_failing_equal_the_monolithic_engine(tiny_llama, consumer):
    """The review's case: the first request's hold is gone, the second one's is fine, both are scheduled
    in one step. The second must not decode over the first one's never-filled blocks."""
    from tests.test_kv_transfer import _all_free, _decode, _greedy, _prefill, _prompts

    mono, producer, consumer_llm = _engines(tiny_llama, **consumer)
    system = _prompts(40, [24])[0]
    a, b = _prompts(41, [5, 6], prefix=system)
    gone = _released(producer, [a])[0]
    fine = _prefill(producer, [b])[0]
    got = _decode(consumer_llm, [a, b], [gone, fine], logprobs=1)
    _same_outputs(got, _greedy(mono, [a, b], logprobs=1))
    stats = consumer_llm.llm_engine.get_stats().kv_transfer
    assert stats["load_failures"] == 1 and stats["loads"] == 1
    assert stats["loaded_tokens"] == len(b) - 1  # b loaded all of its own prompt: a's blocks were no hits
    _all_free(mono, producer, consumer_llm)


def test_n_children_sharing_a_prefix_with_a_failed_load_equal_the_monolithic_engine(tiny_llama):
    from tests.test_kv_transfer import _all_free, _greedy, _prefill, _prompts
    from pagedserve.engine import SamplingParams

    mono, producer, consumer = _engines(tiny_llama)
    system = _prompts(42, [20])[0]
    a, b, c = _prompts(43, [3, 7, 5], prefix=system)
    gone_a, gone_c = _released(producer, [a, c])
    fine_b = _prefill(producer, [b])[0]
    common = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    got = consumer.generate([{"prompt_token_ids": p} for p in (a, b, c)],
                            [SamplingParams(kv_transfer_params=gone_a, **common),
                             SamplingParams(n=3, kv_transfer_params=fine_b, **common),
                             SamplingParams(n=2, kv_transfer_params=gone_c, **common)], use_tqdm=False)
    want = mono.generate([{"prompt_token_ids": p} for p in (a, b, c)],
                         [SamplingParams(**common), SamplingParams(n=3, **common), SamplingParams(n=2, **common)],
                         use_tqdm=False)
    _same_outputs(got, want)
    assert _greedy(mono, [b], max_tokens=6)[0].outputs[0].token_ids == got[1].outputs[2].token_ids
    stats = consumer.llm_engine.get_stats().kv_transfer
    assert stats["load_failures"] == 3 and stats["loads"] == 3  # a, c's two children; b's three children
    _all_free(mono, producer, consumer)


def test_a_request_arriving_after_a_failed_load_equals_the_monolithic_engine(tiny_llama):
    """Across steps: the first request's load fails in step 1 and it recomputes; a request with the same
    prefix that arrives afterwards hits only blocks computed here."""
    from tests.test_kv_transfer import _all_free, _greedy, _prefill, _prompts
    from pagedserve.engine import SamplingParams

    mono, producer, consumer = _engines(tiny_llama)
    system = _prompts(44, [28])[0]
    a, b = _prompts(45, [4, 9], prefix=system)
    gone, fine = _released(producer, [a])[0], _prefill(producer, [b])[0]
    engine = consumer.llm_engine
    common = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request("a", {"prompt_token_ids": a}, SamplingParams(kv_transfer_params=gone, **common))
    engine.step()  # a's load fails
    engine.add_request("b", {"prompt_token_ids": b}, SamplingParams(kv_transfer_params=fine, **common))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    _same_outputs([finished["a"], finished["b"]], _greedy(mono, [a, b], **common))
    _all_free(mono, producer, consumer)
