"""What KV events cost a decode step: the engine's KV bookkeeping per step with events recorded vs not.

    python benchmarks/kv_events_overhead.py [--requests 64] [--steps 512] [--block-size 16] [--repeats 7]

Each step appends one token to every decoding request, allocates its slot (a full block is registered in
the prefix cache every `block-size` tokens; every 128 steps a quarter of the requests finish and new ones
arrive, evicting cached blocks once the pool is full) and seals the step's event batch. CPU time
(process_time), interleaved runs, medians: the figure is the bookkeeping the events add, independent of
the model's forward pass (which it sits beside in a real step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_events import KVEventLog


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_preemptions: int = 0
    skip_reading_prefix_cache: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _admit(m: KVCacheManager, request: _Request) -> None:
    blocks, num_hit = m.get_computed_blocks(request)
    if m.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is None:
        raise RuntimeError("the pool is too small for the benchmark's requests")
    request.num_computed_tokens = request.num_tokens


def run(events_on: bool, num_requests: int, steps: int, block_size: int, seed: int = 0) -> float:
    """Seconds of CPU time per decode step."""
    log = KVEventLog()
    m = KVCacheManager(num_requests * (100 + steps) // block_size + num_requests, block_size,
                       events=log if events_on else None)
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        requests.append(_Request(f"r{i}", [rng.randrange(1000) for _ in range(100)]))
        _admit(m, requests[-1])
    log.seal()
    start = time.process_time()
    for step in range(steps):
        for request in requests:
            request.all_token_ids.append(step)
            m.allocate_slots(request, 1)
            request.num_computed_tokens += 1
        log.seal()
        if step % 128 == 127:
            for j in range(num_requests // 4):
                m.free(requests[j])
                requests[j] = _Request(f"n{step}-{j}", [rng.randrange(1000) for _ in range(100)])
                _admit(m, requests[j])
    return (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            times[on].append(run(on, args.requests, args.steps, args.block_size))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"KV bookkeeping per decode step of {args.requests} requests: {off * 1e6:.1f} us without events, "
          f"{on * 1e6:.1f} us with them (+{(on - off) * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
