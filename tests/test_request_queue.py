"""Unit tests for engine/core/request_queue.py: serving order per policy, lazy removal, rebuilds, victims."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.core.request import Request
from pagedserve.engine.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from pagedserve.engine.sampling_params import SamplingParams


def req(rid: str, arrival: float = 0.0, priority: int = 0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), {0}, 1, arrival_time=arrival, priority=priority)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while len(queue):
        assert queue.peek() is queue.peek()
        out.append(queue.pop().request_id)
    return out


def test_factory_and_unknown_policy() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")


def test_fcfs_order_and_add_front() -> None:
    q = create_request_queue("fcfs")
    a, b, c, p = req("a", 0), req("b", 1), req("c", 2), req("p", 9)
    for r in (a, b, c):
        q.add(r)
    q.add_front(p)  # a preempted request resumes first, whatever its arrival
    assert ids(q) == ["p", "a", "b", "c"] and len(q) == 4 and bool(q)
    assert a in q and req("a") not in q  # membership is by identity
    assert drain(q) == ["p", "a", "b", "c"]
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(IndexError):
        q.pop()


def test_priority_order_ties_by_arrival_then_insertion() -> None:
    q = create_request_queue("priority")
    for rid, arrival, prio in [("r0", 0, 5), ("r1", 1, 1), ("r2", 2, 1), ("r3", 3, 0), ("r4", 1, 1)]:
        q.add(req(rid, arrival, prio))
    q.add_front(req("p", 9, 2))  # preempted: keeps its place in (priority, arrival) order
    expected = ["r3", "r1", "r4", "r2", "p", "r0"]
    assert ids(q) == expected  # iteration is in serving order, not heap layout
    assert drain(q) == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_remove_many_skips_unknown_and_keeps_order(policy: str) -> None:
    q = create_request_queue(policy)
    reqs = [req(f"r{i}", i, i % 2) for i in range(10)]
    for r in reqs:
        q.add(r)
    order = ids(q)
    gone = {reqs[0], reqs[3], reqs[9]}
    q.remove(gone | {req("stranger")})
    q.remove([reqs[3]])  # removing twice is harmless
    assert len(q) == 7
    assert ids(q) == [rid for rid in order if rid not in {"r0", "r3", "r9"}]
    assert all(r not in q for r in gone)
    # A removed request may be queued again; it appears once.
    q.add(reqs[3])
    assert ids(q).count("r3") == 1 and len(q) == 8
    assert sorted(drain(q)) == sorted(f"r{i}" for i in range(10) if i not in (0, 9))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_adding_a_queued_request_twice_is_refused(policy: str) -> None:
    q = create_request_queue(policy)
    a = req("a")
    q.add(a)
    with pytest.raises(ValueError, match="already queued"):
        q.add(a)
    with pytest.raises(ValueError, match="already queued"):
        q.add_front(a)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_dead_entries_are_dropped_so_memory_follows_the_live_count(policy: str) -> None:
    q = create_request_queue(policy)
    reqs = [req(f"r{i}", i) for i in range(5000)]
    for r in reqs:
        q.add(r)
    for i in range(0, 4900, 100):  # many batches of removals from the middle
        q.remove(reqs[i : i + 100])
        assert len(q._ordered()) <= 2 * len(q) + 64 + 100  # noqa: SLF001 - checks the rebuild bound
    assert len(q) == 100
    assert drain(q) == [f"r{i}" for i in range(4900, 5000)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_matches_a_reference_model(policy: str) -> None:
    """Random adds, front adds, pops and removals agree with a plain sorted-list model."""
    rng = random.Random(7)
    q = create_request_queue(policy)
    model: list[tuple[tuple, Request]] = []  # (sort key, request); sorted = serving order
    seq = 0
    front = -1
    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not model:
            r = req(f"q{step}", float(rng.randrange(50)), rng.randrange(3))
            seq += 1
            if policy == "fcfs":
                if rng.random() < 0.2:
                    front -= 1
                    q.add_front(r)
                    key: tuple = (front,)
                else:
                    q.add(r)
                    key = (seq,)
            else:
                (q.add_front if rng.random() < 0.2 else q.add)(r)
                key = (r.priority, r.arrival_time, seq)
            model.append((key, r))
            model.sort(key=lambda kv: kv[0])
        elif op < 0.7:
            assert q.pop() is model.pop(0)[1]
        else:
            picks = rng.sample(model, rng.randrange(1, min(len(model), 40) + 1))
            q.remove([r for _, r in picks])
            model = [kv for kv in model if kv not in picks]
        assert len(q) == len(model)
        if model:
            assert q.peek() is model[0][1]
        if step % 100 == 0:
            assert list(q) == [r for _, r in model]


def test_victims_by_policy() -> None:
    running = [req("old-low", 0, 2), req("mid", 1, 0), req("new", 2, 1), req("newer-low", 3, 2)]
    assert create_request_queue("fcfs").choose_victim(running).request_id == "newer-low"
    assert create_request_queue("priority").choose_victim(running).request_id == "newer-low"
    assert create_request_queue("fcfs").choose_victim(running[:3]).request_id == "new"
    assert create_request_queue("priority").choose_victim(running[:3]).request_id == "old-low"
