"""The scheduler's waiting queue, one class per scheduling policy.

Both classes share one interface (add, add_front, peek, pop, remove, len, iteration
in scheduling order) and the policy's choice of a preemption victim, so the
scheduler never asks which policy it runs.

Removal is lazy: `remove` marks the requests' entries dead in O(1) each, and
`peek`/`pop` drop dead entries when they reach the front. When dead entries
outnumber live ones the container is rebuilt once, which costs no more than the
removals that caused it, so a mass abort of k requests is O(k) amortized however
long the queue is (a client disconnect storm must not stall the engine).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagedserve.engine.core.request import Request

# Dead entries tolerated before a rebuild is considered (keeps small queues from rebuilding often).
_MIN_DEAD_FOR_REBUILD = 64


class _Entry:
    """A request's place in a queue; `alive` turns False when it is removed."""

    __slots__ = ("request", "alive")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.alive = True


class RequestQueue(ABC):
    """Waiting requests in the order a policy serves them, with O(1) amortized removal."""

    def __init__(self) -> None:
        # request -> its live entry (Request compares by identity).
        self._live: dict[Request, _Entry] = {}
        self._num_dead = 0

    # ---- what each policy defines -------------------------------------------------------

    @abstractmethod
    def _push(self, entry: _Entry) -> None:
        """Place a new entry in policy order."""

    @abstractmethod
    def _push_front(self, entry: _Entry) -> None:
        """Place a preempted request's entry where it resumes first (as far as the policy allows)."""

    @abstractmethod
    def _front(self) -> _Entry:
        """The first entry, dead or alive (the container is not empty)."""

    @abstractmethod
    def _pop_front(self) -> _Entry:
        """Take the first entry out, dead or alive (the container is not empty)."""

    @abstractmethod
    def _ordered(self) -> list[_Entry]:
        """Every held entry, dead ones included, in serving order (O(n); not on the hot path)."""

    @abstractmethod
    def _drop_dead(self) -> None:
        """Rebuild the container from its live entries."""

    @abstractmethod
    def choose_victim(self, candidates: list[Request]) -> Request:
        """The running request this policy preempts first, of `candidates` (in scheduling order)."""

    # ---- the interface ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._push(self._new_entry(request))

    def add_front(self, request: Request) -> None:
        """Re-queue a preempted request so that it resumes before later arrivals."""
        self._push_front(self._new_entry(request))

    def peek(self) -> Request:
        """The next request to schedule; IndexError when the queue is empty."""
        self._skip_dead()
        return self._front().request

    def pop(self) -> Request:
        """Take the next request out; IndexError when the queue is empty."""
        self._skip_dead()
        entry = self._pop_front()
        del self._live[entry.request]
        return entry.request

    def remove(self, requests: Iterable[Request]) -> None:
        """Take the given requests out wherever they are (requests not queued are ignored); O(1) each."""
        for request in requests:
            entry = self._live.pop(request, None)
            if entry is not None:
                entry.alive = False
                self._num_dead += 1
        if self._num_dead > max(_MIN_DEAD_FOR_REBUILD, len(self._live)):
            self._drop_dead()
            self._num_dead = 0

    def __contains__(self, request: object) -> bool:
        return request in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Queued requests in the order they would be scheduled (a snapshot)."""
        return iter([e.request for e in self._ordered() if e.alive])

    # ---- helpers ------------------------------------------------------------------------

    def _new_entry(self, request: Request) -> _Entry:
        if request in self._live:
            raise ValueError(f"request: {request.request_id!r} is already queued")
        entry = self._live[request] = _Entry(request)
        return entry

    def _skip_dead(self) -> None:
        if not self._live:
            raise IndexError("the waiting queue is empty")
        while not self._front().alive:
            self._pop_front()
            self._num_dead -= 1


class FCFSRequestQueue(RequestQueue):
    """First come, first served: arrival order; a preempted request goes back to the very front.
    The victim of a preemption is the newest running request."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[_Entry] = deque()

    def _push(self, entry: _Entry) -> None:
        self._queue.append(entry)

    def _push_front(self, entry: _Entry) -> None:
        self._queue.appendleft(entry)

    def _front(self) -> _Entry:
        return self._queue[0]

    def _pop_front(self) -> _Entry:
        return self._queue.popleft()

    def _ordered(self) -> list[_Entry]:
        return list(self._queue)

    def _drop_dead(self) -> None:
        self._queue = deque(e for e in self._queue if e.alive)

    def choose_victim(self, candidates: list[Request]) -> Request:
        return candidates[-1]


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival_time) first, as in vLLM; a preempted request keeps its place in that
    order. The victim of a preemption is the least important running request (then the newest)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, _Entry]] = []
        self._counter = itertools.count()  # ties: insertion order; never compares entries

    def _push(self, entry: _Entry) -> None:
        r = entry.request
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._counter), entry))

    _push_front = _push

    def _front(self) -> _Entry:
        return self._heap[0][3]

    def _pop_front(self) -> _Entry:
        return heapq.heappop(self._heap)[3]

    def _ordered(self) -> list[_Entry]:
        return [item[3] for item in sorted(self._heap, key=lambda item: item[:3])]

    def _drop_dead(self) -> None:
        self._heap = [item for item in self._heap if item[3].alive]
        heapq.heapify(self._heap)

    def choose_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))


_POLICIES: dict[str, type[RequestQueue]] = {"fcfs": FCFSRequestQueue, "priority": PriorityRequestQueue}


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    try:
        return _POLICIES[policy]()
    except KeyError:
        raise ValueError(f"scheduling_policy: unknown policy {policy!r}; use one of {sorted(_POLICIES)}") from None
