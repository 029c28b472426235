"""Aborts in bulk: a mass disconnect with thousands of queued requests costs work proportional to the
requests aborted, never to the length of the waiting queue, and leaves every KV block free."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from tests.test_scheduler import EOS, Harness, prompt


class CountingRequest(Request):
    """A Request that counts how often any container hashes or compares one (the work an abort does)."""

    touches = 0

    def __hash__(self) -> int:
        CountingRequest.touches += 1
        return object.__hash__(self)

    def __eq__(self, other: object) -> bool:
        CountingRequest.touches += 1
        return self is other


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_mass_abort_work_is_proportional_to_the_aborted_not_the_queue(policy: str) -> None:
    num_aborted = 500
    work = {}
    for num_waiting in (2_000, 20_000):
        h = Harness(num_blocks=64, max_num_seqs=4, budget=64, policy=policy)
        for i in range(num_waiting + 4):
            sp = SamplingParams(max_tokens=4)
            h.sched.add_request(CountingRequest(f"r{i}", prompt(4, 1 + i % 50), sp, {EOS}, 4, arrival_time=float(i),
                                                priority=i % 3))
        h.sched.schedule()  # the first four run and hold blocks; the rest wait
        assert len(h.sched.running) == 4 and h.kv.num_free_blocks < h.kv.num_blocks
        waiting_ids = [r.request_id for r in h.sched.waiting]
        victims = waiting_ids[::3][:num_aborted] + [h.sched.running[1].request_id]
        CountingRequest.touches = 0
        done = h.sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
        work[num_waiting] = CountingRequest.touches
        assert len(done) == num_aborted + 1
        assert len(h.sched.waiting) == num_waiting - num_aborted and len(h.sched.running) == 3
        aborted = set(victims)
        assert [r.request_id for r in h.sched.waiting] == [rid for rid in waiting_ids if rid not in aborted]
        # Everything else can be aborted in one call too: every block is free again.
        rest = list(h.sched.requests)
        h.sched.finish_requests(rest, RequestStatus.FINISHED_ABORTED)
        assert not h.sched.has_unfinished_requests() and len(h.sched.waiting) == 0 and not h.sched.running
        assert h.kv.num_free_blocks == h.kv.num_blocks and not h.kv.req_to_blocks
    # The same aborts cost the same, whether 2,000 or 20,000 requests wait; a few touches per request.
    assert work[2_000] == work[20_000] <= 4 * (num_aborted + 1) + 4 * 4
