"""Faults put into a live engine replica, run there on its `EngineHost` (`serve_apps.on_engine`).

- `fill_queue(host, n)`: `n` requests of the replica's own (long, restarted while held) occupy the
  engine, and its bound on pending requests shrinks to `n`: its queue is full, and it refuses every
  further request with `EngineOverloadedError`, as an engine at its `max_pending_requests` does.
  `free_queue(host)` ends them and restores the bound.
- `fail_requests(host, on)`: every request fails in the engine's sampling step (the model runner's
  fault injector), as a broken engine that still answers its health check would fail them.
- `slow_steps(host, seconds)`: every step takes `seconds` longer per request in it (0: no longer), as on a
  slower machine or a bigger model: a long request then outlives a graceful window on any machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

from pagedserve.engine.sampling_params import SamplingParams

HOLD_PROMPT = [17, 23, 29, 31, 37, 41, 43, 47]


@dataclass
class _Held:
    stop: threading.Event
    thread: threading.Thread
    limit: int


def fill_queue(host, n: int, timeout_s: float = 30.0) -> int:
    """Occupy `n` slots of the engine's queue and make `n` its bound; returns the bound it had."""
    engine = host.engine
    started = [threading.Event() for _ in range(n)]
    stop = threading.Event()

    async def hold(i: int) -> None:
        round_ = 0
        while not stop.is_set():
            params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
            stream = engine.generate({"prompt_token_ids": HOLD_PROMPT}, params, request_id=f"held-{i}-{round_}")
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    started[i].set()
                    if stop.is_set():
                        break
            round_ += 1

    async def hold_all() -> None:
        await asyncio.gather(*(hold(i) for i in range(n)))

    thread = threading.Thread(target=asyncio.run, args=(hold_all(),), name="held-requests", daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s
    for event in started:
        if not event.wait(max(0.0, end - time.monotonic())):
            stop.set()
            raise TimeoutError("the held requests did not start")
    held = _Held(stop, thread, engine.max_pending_requests)
    host._test_held = held
    engine.max_pending_requests = n
    return held.limit


def free_queue(host) -> None:
    held: _Held = host._test_held
    host.engine.max_pending_requests = held.limit
    held.stop.set()
    held.thread.join(30.0)
    del host._test_held


def _fail(stage: str, request_id: str) -> None:
    if stage == "sample":
        raise RuntimeError("injected sampling failure")


def fail_requests(host, on: bool) -> None:
    host.engine.engine.engine_core.executor.worker.set_fault_injector(_fail if on else None)


def slow_steps(host, seconds: float) -> None:
    def slow(stage: str, request_id: str) -> None:
        if stage == "forward":
            time.sleep(seconds)

    host.engine.engine.engine_core.executor.worker.set_fault_injector(slow if seconds > 0 else None)
