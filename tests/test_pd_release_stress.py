"""Many PD requests (greedy and seeded, n == 1 continuations and n > 1) over the in-process PD client
(one prefill engine, two decode engines) while the prefill's hold of a random share of them is released
just before their decode leg starts: those decode engines' loads fail (or the hold is still readable,
by timing) and they compute the prompt themselves. Every answer equals the one an undisturbed run
gives, token for token, and every KV block is free afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from tests.test_pd_faults import PD, next_id

PARAMS = [
    dict(temperature=0, max_tokens=14, ignore_eos=True),
    dict(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True),
    dict(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
]


@pytest.fixture(scope="module")
def pd(tiny_model_factory):
    running = PD(str(tiny_model_factory("llama", max_position_embeddings=512)))
    yield running
    running.close()


async def _run(client, prompt: list[int], params: dict, delay_s: float = 0.0) -> dict[int, list[int]]:
    await asyncio.sleep(delay_s)  # (staggered: releases land at every point of the other requests' steps)
    got: dict[int, list[int]] = {}
    async for out in client.generate(next_id(), prompt, params):
        assert out.error is None
        for c in out.outputs:
            got.setdefault(c.index, []).extend(c.token_ids)
    return got


def test_decode_legs_whose_hold_goes_first_answer_as_undisturbed_ones(pd):
    rng = random.Random(7)
    system = [rng.randrange(20, 400) for _ in range(12)]  # a shared prefix: prefix hits on both sides
    prompts = [(system if i % 2 else []) + [rng.randrange(20, 400) for _ in range(rng.randrange(4, 30))]
               for i in range(10)]
    cases = [(p, SamplingParams(**params).model_dump()) for p in prompts for params in PARAMS]
    client = pd.client
    decode_leg = client._decode

    def releasing_first(request_id, prompt_token_ids, params, *args, **kwargs):
        remote = params.get("kv_transfer_params")
        if remote and rng.random() < 0.6:
            client._release(remote)  # what a decode retry after a reader released it meets
        return decode_leg(request_id, prompt_token_ids, params, *args, **kwargs)

    async def run() -> None:
        want = [await _run(client, p, params) for p, params in cases]
        failures = sum(int(pd.kv(e).get("load_failures", 0)) for e in pd.decodes)
        client._decode = releasing_first
        try:
            for _ in range(3):
                got = await asyncio.gather(*(_run(client, p, params, rng.random() * 0.1) for p, params in cases))
                assert got == want
        finally:
            client._decode = decode_leg
        return failures

    failures = asyncio.run(run())
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)
    assert sum(int(pd.kv(e).get("load_failures", 0)) for e in pd.decodes) > failures, "no load ever failed"
