"""Migration over the PD client (in-process PD app, no Ray): a decode engine that dies mid-stream makes
the PD client raise EngineDeadError; `MigratingClient` resubmits the continuation through the PD client,
which computes it on a decode engine alone (recompute), and the stream equals an uninterrupted one."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from pagedserve.cluster.serve.migration import MigratingClient
from pagedserve.engine.sampling_params import SamplingParams
from tests.local_serving import LocalHandle
from tests.pd_local import LocalPD

PROMPT = [(13 * k) % 400 + 20 for k in range(30)]


class _DiesOnce:
    """A decode handle whose first generate stream dies (RayActorError) after `after_outputs` outputs."""

    def __init__(self, inner: LocalHandle, after_outputs: int) -> None:
        self.inner, self.after_outputs, self.died = inner, after_outputs, False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def generate(self):
        outer = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                inner = outer.inner.generate.remote(*args, **kwargs)
                if outer.died:
                    return inner

                async def stream():
                    outer.died = True
                    produced = 0
                    async for ref in inner:
                        yield ref
                        produced += 1
                        if produced >= outer.after_outputs:
                            break
                    await inner.aclose()
                    raise RayActorError()

                return stream()

        return _Method()


@pytest.fixture(scope="module")
def pd(tiny_model_factory):
    local = LocalPD(str(tiny_model_factory("llama", max_position_embeddings=512)))
    yield local
    local.close()


async def _collect(client, params: dict) -> dict[int, tuple[list[int], str]]:
    got: dict[int, tuple[list[int], str]] = {}
    async for out in client.generate("req", PROMPT, params):
        assert out.error is None
        for c in out.outputs:
            tokens, text = got.get(c.index, ([], ""))
            got[c.index] = (tokens + c.token_ids, text + c.text)
    return got


@pytest.mark.parametrize("params", [
    dict(temperature=0, max_tokens=24, ignore_eos=True),
    dict(n=2, temperature=1.0, seed=4, max_tokens=16, ignore_eos=True, logprobs=1),
], ids=["greedy", "n2_seeded"])
def test_a_dead_decode_engine_migrates_through_the_pd_client(pd, params):
    params = SamplingParams(**params).model_dump()
    state = pd.client.decode.engines[0]

    async def run() -> None:
        want = await _collect(MigratingClient(pd.client), params)
        decode_only = pd.client.counters.decode_only
        state.handle = dying = _DiesOnce(pd.decode_handle, after_outputs=2)
        try:
            client = MigratingClient(pd.client)
            got = await _collect(client, params)
        finally:
            state.handle = pd.decode_handle
            state.available = True
        assert dying.died and client.num_migrations == 1
        assert got == want
        assert pd.client.counters.decode_only > decode_only  # the continuation skipped the prefill

    asyncio.run(run())
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)
