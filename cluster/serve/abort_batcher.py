"""Batched aborts: the aborts sent to one engine within one event-loop turn go out as one RPC.

When many clients go away at once (a load balancer drops its connections, a benchmark is cut short),
each closing stream asks for an abort. One `abort_requests(ids)` call per engine for everything that
piled up since the last flush costs one RPC per engine per turn instead of one per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class AbortBatcher:
    """Collects request ids per engine; `flush` (scheduled on the next loop turn) sends one RPC per engine.

    `send(engine_index, request_ids)` makes the call and returns its awaitable result (an ObjectRef);
    it must not block: it runs inside the event loop, often from a closing generator."""

    def __init__(self, send: Callable[[int, list[str]], Any]) -> None:
        self._send = send
        self._pending: dict[int, list[str]] = {}
        # Futures of callers that wait for their abort to be sent (DPCoordinator.abort), per engine.
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._scheduled = False
        self.num_rpcs = 0  # calls made (observability; tests count them)

    def add(self, engine_index: int, request_id: str) -> None:
        """Queue an abort; it is sent on the next event-loop turn (now if no loop runs)."""
        self._pending.setdefault(engine_index, []).append(request_id)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self.flush)

    async def add_and_wait(self, engine_index: int, request_id: str) -> Any:
        """Queue an abort and return the awaitable result of the RPC that carries it."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(engine_index, []).append(waiter)
        self.add(engine_index, request_id)
        return await waiter

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        waiters, self._waiters = self._waiters, {}
        for index, request_ids in pending.items():
            try:
                result: Any = self._send(index, list(dict.fromkeys(request_ids)))
                self.num_rpcs += 1
            except Exception as exc:  # noqa: BLE001 - the actor handle may be unusable while it restarts
                logger.debug("aborts of %d request(s) on engine %d could not be sent: %s", len(request_ids), index, exc)
                result = None
            for waiter in waiters.pop(index, []):
                if not waiter.done():
                    waiter.set_result(result)
        for rest in waiters.values():  # an engine whose ids were all dropped: nothing was sent
            for waiter in rest:
                if not waiter.done():
                    waiter.set_result(None)
