"""Unit tests for engine/core/scheduler.py, driven step by step with a fake model runner.

The fake runner plays the worker side of the diff protocol exactly as the real model
runner does (NewRequestData creates its state, CachedRequestData extends it, a resumed
request replaces its block table, finished ids drop it), checks that its mirror agrees
with the scheduler and the KV cache manager, and samples a deterministic token for every
request whose scheduled tokens reach the end of its known tokens. Because a token is a
pure function of (request id, output index), recomputation after a preemption must give
the same output as an undisturbed run; any lost or duplicated token shows up.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

BS = 4
EOS = 0


# ---------------------------------------------------------------------- building blocks


def make_config(
    *,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    chunked: bool = True,
    policy: str = "fcfs",
) -> EngineConfig:
    """A validated config with the resolved fields set directly (no model is loaded)."""
    return EngineConfig(
        model="no-model-loaded",
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
    )


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    **params,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(prompt), sp, {EOS}, max_tokens, arrival_time=arrival, priority=priority)


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def default_token(rid: str, index: int) -> int:
    """Deterministic fake sample for output position `index` of request `rid` (never EOS)."""
    return 100 + (zlib.crc32(rid.encode()) + 7 * index) % 500


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """The worker side: applies the scheduler's diffs and samples like the real model runner."""

    def __init__(self, sched: Scheduler, kv: KVCacheManager, scripts: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.kv = kv
        self.scripts = scripts or {}
        self.states: dict[str, WorkerState] = {}

    def token_for(self, rid: str, index: int) -> int:
        script = self.scripts.get(rid, [])
        return script[index] if index < len(script) else default_token(rid, index)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = WorkerState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

        diff_ids = [d.req_id for d in so.scheduled_new_reqs] + [d.req_id for d in so.scheduled_cached_reqs]
        assert sorted(diff_ids) == sorted(so.num_scheduled_tokens), "one diff per scheduled request"

        sampled: dict[str, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            request = self.sched.requests[rid]
            # The mirror built from diffs alone must equal the scheduler's truth.
            assert state.token_ids == request.all_token_ids
            assert state.block_ids == self.kv.get_block_ids(rid)
            assert state.num_computed_tokens + n <= len(state.token_ids), "scheduled past the known tokens"
            assert len(state.block_ids) * self.kv.block_size >= state.num_computed_tokens + n, "no slot for a token"
            state.num_computed_tokens += n
            assert state.num_computed_tokens == request.num_computed_tokens
            if state.num_computed_tokens == len(state.token_ids):
                assert request.num_computed_tokens == request.num_tokens
                sampled[rid] = self.token_for(rid, len(state.token_ids) - len(request.prompt_token_ids))
        return ModelRunnerOutput(sampled_token_ids=sampled)


def check_invariants(sched: Scheduler, kv: KVCacheManager, so: SchedulerOutput) -> None:
    """What must hold right after every schedule()."""
    counts = so.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == sum(counts.values()) <= sched.max_num_batched_tokens
    assert all(n > 0 for n in counts.values())
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert len(running) <= sched.max_num_seqs
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
    assert not set(running) & set(waiting), "a request is both waiting and running"
    assert set(running) | set(waiting) == set(sched.requests)
    assert set(counts) <= set(running)
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # A running request owns exactly the blocks that hold its computed (or scheduled) tokens.
        assert len(kv.get_block_ids(r.request_id)) == blocks_for(r.num_computed_tokens, kv.block_size)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    assert set(kv.req_to_blocks) <= set(running)
    # Block ownership: ref counts equal the number of owners; free blocks are exactly those with ref 0.
    owners: Counter[int] = Counter()
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
        owners.update(ids)
    pool = kv.block_pool
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id]
    assert kv.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)


class Harness:
    """A scheduler, its KV cache manager and a fake runner, stepped as EngineCore.step does."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = BS,
        caching: bool = True,
        scripts: dict[str, list[int]] | None = None,
        **config,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(make_config(**config), self.kv)
        self.runner = FakeRunner(self.sched, self.kv, scripts)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish_reason: dict[str, str] = {}
        self.stop_reason: dict[str, int | str | None] = {}
        # Finished ids seen by the workers; `carried` once a non-empty step has carried them.
        self.reported_finished: set[str] = set()
        self.carried: set[str] = set()
        self.aborted: set[str] = set()
        self.num_steps = 0
        self.max_running = 0

    def note_finished_ids(self, so: SchedulerOutput) -> None:
        """Finished ids go out with the next step; an empty step (which may not reach pipeline
        workers) repeats them, but once a non-empty step carried an id it is never sent again."""
        for rid in so.finished_req_ids:
            assert rid not in self.carried, f"finished id {rid} sent again after a non-empty step carried it"
            assert rid not in self.sched.requests
        self.reported_finished.update(so.finished_req_ids)
        if so.num_scheduled_tokens:
            self.carried.update(so.finished_req_ids)

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.sched.add_request(r)

    def abort(self, *rids: str) -> list[Request]:
        done = self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        self.aborted.update(r.request_id for r in done)
        return done

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        self.num_steps += 1
        check_invariants(self.sched, self.kv, so)
        self.max_running = max(self.max_running, len(self.sched.running))
        self.note_finished_ids(so)
        runner_output = self.runner.execute(so)
        for out in self.sched.update_from_output(so, runner_output):
            rid = out.request_id
            assert rid not in self.finish_reason, f"output for {rid} after it finished"
            self.tokens[rid].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reason[rid] = out.finish_reason
                self.stop_reason[rid] = out.stop_reason
        return so

    def run(self, max_steps: int = 500) -> None:
        while self.sched.has_unfinished_requests():
            assert self.num_steps < max_steps, "the scheduler stopped making progress"
            self.step()

    def expected(self, rid: str, n: int) -> list[int]:
        return [self.runner.token_for(rid, i) for i in range(n)]

    def assert_drained(self) -> None:
        """Everything finished, every block free, every finished id sent to the workers."""
        assert not self.sched.has_unfinished_requests()
        assert not self.sched.running and len(self.sched.waiting) == 0
        so = self.sched.schedule()  # flushes the ids finished by the last step
        assert so.total_num_scheduled_tokens == 0
        self.note_finished_ids(so)
        self.runner.execute(so)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert not self.kv.req_to_blocks
        assert not self.runner.states, "workers still hold state of finished requests"
        done = set(self.finish_reason) | self.aborted
        assert self.reported_finished == done


# ---------------------------------------------------------------------- budget and ordering


def test_token_budget_and_max_num_seqs_cap() -> None:
    h = Harness(budget=16, max_num_seqs=3)
    h.add(*(make_request(rid, prompt(10, 20 * i + 1), 3, arrival=i) for i, rid in enumerate("ABCDE")))
    per_step = []
    while h.sched.has_unfinished_requests():
        so = h.step()
        per_step.append(dict(so.num_scheduled_tokens))
        if len(per_step) == 3:
            # Budget is left (13 tokens) but three requests run: D and E must wait.
            assert [r.request_id for r in h.sched.waiting] == ["D", "E"]
    assert per_step == [
        {"A": 10, "B": 6},  # B's prompt is chunked to the 6 tokens left
        {"A": 1, "B": 4, "C": 10},
        {"A": 1, "B": 1, "C": 1},  # seq cap: D waits although 13 tokens of budget are unused
        {"B": 1, "C": 1, "D": 10},  # A finished at step 3, freeing a seat
        {"D": 1, "E": 10},
        {"D": 1, "E": 1},
        {"E": 1},
    ]
    assert all(sum(s.values()) <= 16 for s in per_step)
    assert h.max_running == 3
    for rid in "ABCDE":
        assert h.tokens[rid] == h.expected(rid, 3) and h.finish_reason[rid] == "length"
    h.assert_drained()


def test_decodes_first_then_prefill_chunk_in_one_step() -> None:
    h = Harness(budget=8)
    h.add(make_request("A", prompt(4), 5))
    assert h.step().num_scheduled_tokens == {"A": 4}
    h.add(make_request("B", prompt(20, 50), 2, arrival=1.0))
    so = h.step()
    # The decode goes first and gets its token; the new prompt fills what is left.
    assert list(so.num_scheduled_tokens.items()) == [("A", 1), ("B", 7)]
    assert [d.req_id for d in so.scheduled_cached_reqs] == ["A"]
    assert [d.req_id for d in so.scheduled_new_reqs] == ["B"]
    assert list(h.step().num_scheduled_tokens.items()) == [("A", 1), ("B", 7)]
    assert h.tokens["B"] == []  # mid-prompt: nothing sampled
    assert list(h.step().num_scheduled_tokens.items()) == [("A", 1), ("B", 6)]
    assert h.tokens["A"] == h.expected("A", 4) and h.tokens["B"] == h.expected("B", 1)
    h.run()
    assert h.tokens["A"] == h.expected("A", 5) and h.tokens["B"] == h.expected("B", 2)
    h.assert_drained()


def test_chunked_prefill_splits_prompt_into_budget_sized_chunks() -> None:
    h = Harness(budget=8)
    req = make_request("A", prompt(30), 2)
    h.add(req)
    chunks, computed, new_blocks = [], [], []
    for _ in range(4):
        so = h.step()
        chunks.append(so.num_scheduled_tokens["A"])
        computed.append(req.num_computed_tokens)
        if so.scheduled_new_reqs:
            new_blocks.append(len(so.scheduled_new_reqs[0].block_ids))
        else:
            new_blocks.append(len(so.scheduled_cached_reqs[0].new_block_ids))
        if len(chunks) < 4:
            assert h.tokens["A"] == [] and req.num_output_tokens == 0
    assert chunks == [8, 8, 8, 6]
    assert computed == [8, 16, 24, 30]
    assert new_blocks == [2, 2, 2, 2]  # 30 tokens -> 8 blocks of 4
    assert h.tokens["A"] == h.expected("A", 1)  # sampled only after the last chunk
    so = h.step()
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.scheduled_cached_reqs[0].new_block_ids == []  # position 30 lies in block 7
    assert h.finish_reason["A"] == "length" and h.tokens["A"] == h.expected("A", 2)
    h.assert_drained()


@pytest.mark.parametrize("chunked, first_step", [(False, {"A": 10}), (True, {"A": 10, "B": 6})])
def test_prompt_over_remaining_budget_waits_without_chunking(chunked: bool, first_step: dict[str, int]) -> None:
    h = Harness(budget=16, max_model_len=16, chunked=chunked)
    h.add(make_request("A", prompt(10), 3), make_request("B", prompt(8, 40), 3, arrival=1.0))
    assert h.step().num_scheduled_tokens == first_step
    expected_second = {"A": 1, "B": 8} if not chunked else {"A": 1, "B": 2}
    assert h.step().num_scheduled_tokens == expected_second
    h.run()
    assert h.tokens["A"] == h.expected("A", 3) and h.tokens["B"] == h.expected("B", 3)
    h.assert_drained()


# ---------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_hits_full_blocks_never_the_whole_prompt(caching: bool) -> None:
    h = Harness(caching=caching)
    base = prompt(18)  # 4 full blocks + 2 tokens
    a = make_request("A", base, 2)
    h.add(a)
    h.step()
    a_blocks = h.kv.get_block_ids("A")
    b = make_request("B", base[:16] + [200, 201, 202], 2, arrival=1.0)  # shares 4 full blocks
    c = make_request("C", base, 2, arrival=2.0)  # identical prompt
    d = make_request("D", base[:16], 2, arrival=3.0)  # the prompt is exactly 4 cached blocks
    h.add(b, c, d)
    so = h.step()
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    if caching:
        assert so.num_scheduled_tokens == {"A": 1, "B": 3, "C": 2, "D": 4}
        assert {rid: new[rid].num_computed_tokens for rid in "BCD"} == {"B": 16, "C": 16, "D": 12}
        assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (16, 16, 12)
        assert new["B"].block_ids[:4] == a_blocks[:4] and new["C"].block_ids[:4] == a_blocks[:4]
        assert new["D"].block_ids[:3] == a_blocks[:3] and new["D"].block_ids[3] != a_blocks[3]
    else:
        assert so.num_scheduled_tokens == {"A": 1, "B": 19, "C": 18, "D": 16}
        assert all(new[rid].num_computed_tokens == 0 for rid in "BCD")
        assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (0, 0, 0)
    h.run()
    for rid in "ABCD":
        assert h.tokens[rid] == h.expected(rid, 2)
    h.assert_drained()


# ---------------------------------------------------------------------- preemption


@pytest.mark.parametrize("caching", [True, False])
def test_fcfs_preempts_newest_and_resumes_it_first(caching: bool) -> None:
    # 6 blocks of 4 tokens; A and B each grow to 4 blocks, so both cannot finish together.
    h = Harness(num_blocks=6, max_num_seqs=2, caching=caching)
    a = make_request("A", prompt(8, 1), 8, arrival=0.0)
    b = make_request("B", prompt(8, 21), 8, arrival=1.0)
    c = make_request("C", prompt(8, 41), 1, arrival=2.0)
    h.add(a, b, c)
    for step in range(1, 6):
        so = h.step()
        assert set(so.num_scheduled_tokens) == {"A", "B"}  # C waits for a seat
        assert h.sched.num_preemptions == 0
    assert h.kv.num_free_blocks == 0  # both hold 3 blocks, 12 tokens computed

    so = h.step()  # step 6: A needs a 4th block -> B, the newest, is preempted
    assert so.num_scheduled_tokens == {"A": 1}
    assert h.sched.num_preemptions == 1
    assert [r.request_id for r in h.sched.running] == ["A"]
    assert [r.request_id for r in h.sched.waiting] == ["B", "C"]  # back at the front
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert h.kv.get_block_ids("B") == [] and h.kv.num_free_blocks == 2
    assert h.tokens["B"] == h.expected("B", 5)

    assert h.step().num_scheduled_tokens == {"A": 1}  # B does not fit yet; C may not overtake it
    assert [r.request_id for r in h.sched.waiting] == ["B", "C"]
    so = h.step()
    assert so.num_scheduled_tokens == {"A": 1} and h.finish_reason["A"] == "length"

    so = h.step()  # step 9: A's blocks are back; B resumes, then C
    cached_hit = 8 if caching else 0  # B's first two blocks survive in the prefix cache
    assert so.num_scheduled_tokens == {"B": 13 - cached_hit, "C": 8}
    (resumed,) = so.scheduled_cached_reqs
    assert resumed.req_id == "B" and resumed.resumed_from_preemption
    assert resumed.new_block_ids == h.kv.get_block_ids("B") and len(resumed.new_block_ids) == 4
    assert resumed.num_computed_tokens == cached_hit
    assert resumed.new_token_ids == h.expected("B", 5)[4:]  # only the token sampled after the last send
    assert [n.req_id for n in so.scheduled_new_reqs] == ["C"]

    h.run()
    for rid, n in (("A", 8), ("B", 8), ("C", 1)):
        assert h.tokens[rid] == h.expected(rid, n) and h.finish_reason[rid] == "length"
    assert h.sched.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert h.sched.make_stats().num_preemptions == 1
    h.assert_drained()


def test_prefix_cache_stats_count_each_prompt_once_across_preemption() -> None:
    h = Harness(num_blocks=6, max_num_seqs=2)
    h.add(make_request("A", prompt(8, 1), 8), make_request("B", prompt(8, 21), 8, arrival=1.0))
    h.run()
    assert h.sched.num_preemptions == 1  # B resumed and hit its own two surviving blocks
    stats = h.sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16, 0)
    total = h.kv.total_prefix_cache_stats
    assert (total.preempted_requests, total.preempted_queries, total.preempted_hits) == (1, 13, 8)
    h.assert_drained()


def test_priority_waiting_queue_serves_lowest_value_first() -> None:
    order = {}
    for policy in ("priority", "fcfs"):
        h = Harness(budget=8, policy=policy)
        for i, (rid, prio) in enumerate([("R0", 5), ("R1", 1), ("R2", 1), ("R3", 0)]):
            h.add(make_request(rid, prompt(8, 20 * i + 1), 1, arrival=float(i), priority=prio))
        order[policy] = [next(iter(h.step().num_scheduled_tokens)) for _ in range(4)]
        h.run()
        h.assert_drained()
    assert order["priority"] == ["R3", "R1", "R2", "R0"]  # ties broken by arrival
    assert order["fcfs"] == ["R0", "R1", "R2", "R3"]


@pytest.mark.parametrize("policy, victim, step7", [
    ("priority", "Y", {"X": 1, "Z": 1}),  # Y was already scheduled this step: its share is undone
    ("fcfs", "Z", {"Y": 1, "X": 1}),
])
def test_preemption_victim_by_policy(policy: str, victim: str, step7: dict[str, int]) -> None:
    h = Harness(num_blocks=6, max_num_seqs=3, policy=policy)
    # Y is the least important (highest value) but the oldest; Z is the newest.
    y = make_request("Y", prompt(2, 1), 20, arrival=0.0, priority=2)
    h.add(y)
    h.step()
    h.add(
        make_request("X", prompt(4, 21), 8, arrival=1.0, priority=0),
        make_request("Z", prompt(4, 41), 8, arrival=2.0, priority=1),
    )
    for _ in range(5):  # steps 2..6: the cache fills up
        h.step()
    assert h.sched.num_preemptions == 0 and h.kv.num_free_blocks == 0
    so = h.step()  # step 7: X needs a third block
    assert so.num_scheduled_tokens == step7
    assert h.sched.num_preemptions == 1
    assert [r.request_id for r in h.sched.waiting] == [victim]
    assert h.sched.requests[victim].num_preemptions == 1
    assert so.total_num_scheduled_tokens == 2
    h.run()
    for rid, n in (("Y", 20), ("X", 8), ("Z", 8)):
        assert h.tokens[rid] == h.expected(rid, n) and h.finish_reason[rid] == "length"
    h.assert_drained()


# ---------------------------------------------------------------------- requests that can never fit


def test_prompt_larger_than_cache_finishes_with_length() -> None:
    h = Harness(num_blocks=4, budget=8)  # 16 token slots
    h.add(make_request("U", prompt(20), 4), make_request("N", prompt(4, 40), 2, arrival=1.0))
    assert h.step().num_scheduled_tokens == {"U": 8}
    assert h.step().num_scheduled_tokens == {"U": 8}
    so = h.step()  # U needs a 5th block and holds the whole cache
    assert so.num_scheduled_tokens == {}
    assert "U" in so.finished_req_ids
    assert h.finish_reason["U"] == "length" and h.tokens["U"] == []
    h.run(max_steps=20)
    assert h.tokens["N"] == h.expected("N", 2)
    h.assert_drained()


def test_output_outgrowing_cache_finishes_with_length() -> None:
    h = Harness(num_blocks=4, budget=8)
    h.add(make_request("G", prompt(8), 20))
    h.run(max_steps=20)
    # 16 slots hold the prompt and 8 decoded tokens; the 9th sampled token needs no slot.
    assert h.finish_reason["G"] == "length"
    assert h.tokens["G"] == h.expected("G", 9)
    h.assert_drained()


def test_waiting_request_that_cannot_fit_is_finished_and_others_go_on() -> None:
    h = Harness(num_blocks=4, budget=32, max_model_len=32, chunked=False)
    h.add(make_request("U", prompt(20), 4), make_request("N", prompt(4, 40), 2, arrival=1.0))
    so = h.step()
    assert so.num_scheduled_tokens == {"N": 4}
    assert h.finish_reason["U"] == "length" and h.tokens["U"] == []
    h.run(max_steps=20)
    assert h.tokens["N"] == h.expected("N", 2)
    h.assert_drained()


# ---------------------------------------------------------------------- stop conditions


@pytest.mark.parametrize(
    "params, script, expected, reason, stop_reason",
    [
        pytest.param({"max_tokens": 10}, [5, 6, EOS, 7], [5, 6, EOS], "stop", None, id="eos"),
        pytest.param({"max_tokens": 4, "ignore_eos": True}, [5, 6, EOS, 7], [5, 6, EOS, 7], "length", None,
                     id="ignore_eos"),
        pytest.param({"max_tokens": 10, "stop_token_ids": [6]}, [5, 6, 7], [5, 6], "stop", 6, id="stop_token_ids"),
        pytest.param({"max_tokens": 10, "min_tokens": 3}, [5, EOS, EOS, 8], [5, EOS, EOS], "stop", None,
                     id="min_tokens_delays_eos"),
        pytest.param({"max_tokens": 10, "min_tokens": 2, "stop_token_ids": [6]}, [6, 6, 7], [6, 6], "stop", 6,
                     id="min_tokens_delays_stop_token"),
        pytest.param({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], "length", None, id="max_tokens"),
    ],
)
def test_stop_conditions(params: dict, script: list[int], expected: list[int], reason: str, stop_reason) -> None:
    h = Harness(scripts={"S": script})
    params = dict(params)
    max_tokens = params.pop("max_tokens")
    h.add(make_request("S", prompt(5), max_tokens, **params))
    h.run(max_steps=20)
    assert h.tokens["S"] == expected
    assert h.finish_reason["S"] == reason and h.stop_reason["S"] == stop_reason
    h.assert_drained()


def test_max_model_len_finishes_with_length() -> None:
    h = Harness(max_model_len=10)
    h.add(make_request("M", prompt(6), 100))
    h.run(max_steps=20)
    assert h.tokens["M"] == h.expected("M", 4) and h.finish_reason["M"] == "length"
    h.assert_drained()


# ---------------------------------------------------------------------- aborts


def test_abort_waiting_and_running_frees_blocks_and_reports_once() -> None:
    h = Harness(num_blocks=16, max_num_seqs=1)
    a = make_request("A", prompt(10), 8)
    w = make_request("W", prompt(6, 50), 8, arrival=1.0)
    h.add(a, w)
    h.step()
    assert h.kv.get_block_ids("A") and h.kv.num_free_blocks == 16 - 3

    assert h.abort("W") == [w]  # from waiting
    assert w.status == RequestStatus.FINISHED_ABORTED and w.status.finish_reason == "abort"
    so = h.step()
    assert so.finished_req_ids == {"W"} and so.num_scheduled_tokens == {"A": 1}

    assert h.abort("A") == [a]  # from running
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert h.kv.get_block_ids("A") == [] and h.kv.num_free_blocks == 16
    assert not h.sched.has_unfinished_requests()
    assert h.abort("A", "never-added") == []
    # Empty steps (which pipeline mode may never send) repeat the id ...
    for _ in range(2):
        so = h.step()
        assert so.finished_req_ids == {"A"} and so.total_num_scheduled_tokens == 0
    # ... until a non-empty step carries it; after that it is gone.
    h.add(make_request("B", prompt(3, 80), 1, arrival=2.0))
    so = h.step()
    assert so.finished_req_ids == {"A"} and so.num_scheduled_tokens == {"B": 3}
    assert h.finish_reason["B"] == "length"
    so = h.step()
    assert so.finished_req_ids == {"B"} and so.total_num_scheduled_tokens == 0
    assert "A" not in h.finish_reason and "W" not in h.tokens
    h.assert_drained()


def test_abort_preempted_request() -> None:
    h = Harness(num_blocks=6, max_num_seqs=2)
    h.add(make_request("A", prompt(8, 1), 8), make_request("B", prompt(8, 21), 8, arrival=1.0))
    while h.sched.num_preemptions == 0:
        h.step()
    assert h.sched.requests["B"].status == RequestStatus.PREEMPTED
    h.abort("B")
    h.run()
    assert h.tokens["A"] == h.expected("A", 8)
    h.assert_drained()


def test_abort_with_duplicate_ids() -> None:
    h = Harness()
    h.add(make_request("A", prompt(6), 4))
    h.step()
    assert [r.request_id for r in h.abort("A", "A")] == ["A"]
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_duplicate_request_id_is_rejected() -> None:
    h = Harness()
    h.add(make_request("A", prompt(6), 4))
    with pytest.raises(ValueError, match="request_id"):
        h.add(make_request("A", prompt(3), 4))


# ---------------------------------------------------------------------- diffs to the workers


def test_worker_diffs_new_then_only_new_tokens_and_blocks() -> None:
    h = Harness()
    req = make_request("A", prompt(6), 5)
    h.add(req)
    so = h.step()
    assert so.scheduled_cached_reqs == []
    (new,) = so.scheduled_new_reqs
    assert isinstance(new, NewRequestData)
    assert new.prompt_token_ids == prompt(6) and new.output_token_ids == []
    assert new.block_ids == h.kv.get_block_ids("A") and len(new.block_ids) == 2
    assert new.num_computed_tokens == 0 and new.eos_token_ids == {EOS}
    assert new.sampling_params is req.sampling_params

    out = h.expected("A", 5)
    diffs: list[CachedRequestData] = []
    for _ in range(3):
        so = h.step()
        assert so.scheduled_new_reqs == []
        diffs.extend(so.scheduled_cached_reqs)
    blocks = h.kv.get_block_ids("A")
    assert [(d.new_token_ids, d.new_block_ids, d.num_computed_tokens, d.resumed_from_preemption) for d in diffs] == [
        ([out[0]], [], 6, False),  # position 6 lies in block 1
        ([out[1]], [], 7, False),
        ([out[2]], [blocks[2]], 8, False),  # position 8 opens block 2
    ]
    h.run()
    assert h.tokens["A"] == out
    h.assert_drained()


# ---------------------------------------------------------------------- randomized stress


@pytest.mark.parametrize("seed", range(24))
def test_randomized_invariants(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    chunked = rng.random() < 0.7
    max_model_len = 48
    budget = rng.randint(4, 40) if chunked else rng.randint(max_model_len, 80)
    policy = rng.choice(["fcfs", "priority"])
    num_blocks = rng.randint(4, 24)
    prefixes = [[rng.randint(1, 90) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    scripts: dict[str, list[int]] = {}
    pending: list[Request] = []
    for i in range(rng.randint(8, 16)):
        rid = f"r{i}"
        toks = rng.choice(prefixes) + [rng.randint(1, 90) for _ in range(rng.randint(1, 16))]
        toks = toks[: max_model_len - 1]
        params = {}
        if rng.random() < 0.3:
            params["ignore_eos"] = True
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randint(100, 600)]
        max_tokens = min(rng.randint(1, 12), max_model_len - len(toks))
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.3:  # this request samples EOS somewhere
            script = [default_token(rid, k) for k in range(max_tokens)]
            script[rng.randrange(max_tokens)] = EOS
            scripts[rid] = script
        pending.append(
            make_request(rid, toks, max_tokens, arrival=float(i), priority=rng.randint(0, 3), **params)
        )
    h = Harness(
        num_blocks=num_blocks,
        block_size=block_size,
        caching=rng.random() < 0.8,
        scripts=scripts,
        budget=budget,
        max_num_seqs=rng.randint(1, 6),
        max_model_len=max_model_len,
        chunked=chunked,
        policy=policy,
    )
    requests = {r.request_id: r for r in pending}
    while pending or h.sched.has_unfinished_requests():
        assert h.num_steps < 3000, "the scheduler stopped making progress"
        while pending and rng.random() < 0.5:
            h.add(pending.pop(0))
        if h.sched.requests and rng.random() < 0.04:
            h.abort(rng.choice(sorted(h.sched.requests)))
        h.step()
    h.assert_drained()

    for rid, req in requests.items():
        toks = h.tokens.get(rid, [])
        # Whatever happened (preemption, recompute), the outputs are the undisturbed sequence's prefix.
        assert toks == h.expected(rid, len(toks))
        assert req.output_token_ids == toks
        if rid in h.aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED and rid not in h.finish_reason
            continue
        reason = h.finish_reason[rid]
        sp = req.sampling_params
        if reason == "stop":
            last = toks[-1]
            assert (last == EOS and not sp.ignore_eos) or last in sp.stop_token_ids
            assert len(toks) >= sp.min_tokens
        else:
            assert reason == "length"
            fits = blocks_for(req.num_prompt_tokens + req.max_tokens - 1, block_size) <= num_blocks
            if fits:
                assert len(toks) == req.max_tokens or req.num_tokens == max_model_len
