"""Prefill and decode pools with different layouts, through the Ray transport, driven by the PD client
(no Serve): a TP=2 or PP=2 producer feeding a TP=1 consumer, and the reverse, give the monolithic
engine's tokens; a producer killed between its prefill and the consumer's read makes the consumer
compute the prompt itself. After every test every block on every engine is free and nothing is held.
"""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.cluster.serve.pd_pools import PoolSpec, deployment_kv_secret, start_pool, wait_pool_ready

PROMPTS = [[(19 * i + 7 * k) % 470 + 20 for k in range(n)] for i, n in enumerate((3, 9, 21, 34))]
KILL_PROMPT = [(23 * k) % 470 + 20 for k in range(29)]  # seen by no engine before the kill test
# For the forged-params test: prompts of one length (a hold of one passes the consumer's length check for any
# other) that no engine saw before (a decode engine's prefix cache would spare it the read).
FORGE_PROMPTS = [[(31 * i + 11 * k) % 470 + 20 for k in range(16)] for i in range(7)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama", max_position_embeddings=512))


@pytest.fixture(scope="module")
def ray_local():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # The engines of one deployment share a KV secret: the Ray transport's reads are signed with it.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDSERVE_KV_SECRET": secrets.token_hex(32)}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    llm = LLM(model=model, dtype="float32", num_kv_blocks=64, block_size=4)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, *FORGE_PROMPTS, KILL_PROMPT]],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


def engine_kwargs(model: str, **overrides) -> dict:
    return {"model": model, "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64,
            **overrides}


def start_pools(model: str, prefill: dict, decode: dict, connector: str = "ray") -> tuple:
    extra = {"read_timeout_s": 20}
    secret = deployment_kv_secret()  # both pools share one, as the PD app's do
    return tuple(start_pool(PoolSpec(role, 1, engine_kwargs(model, **kwargs), num_cpus_per_engine=0.5,
                                     kv_connector=connector, kv_connector_extra_config=extra, kv_secret=secret),
                            f"layouts-{connector}")
                 for role, kwargs in (("prefill", prefill), ("decode", decode)))


class PD:
    """A PD client over a prefill pool and a decode pool (one engine each); checks on exit that every
    block is free and nothing held; shuts the pools down on exit when it owns them."""

    def __init__(self, prefill, decode, owned: bool = False) -> None:
        self.prefill, self.decode, self.owned = prefill, decode, owned
        self.dead: list = []  # engines a test killed for good (not checked when idle)

    async def __aenter__(self) -> "PD":
        await wait_pool_ready(self.prefill, 300)
        await wait_pool_ready(self.decode, 300)
        self.client = PDClient.over_actors(self.prefill.handles, self.decode.handles, self.prefill.names,
                               prefill_block_size=4, decode_block_size=4, stats_interval_s=0.1)
        self.client.start()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                await self.assert_idle()
        finally:
            await self.client.stop()
            if self.owned:
                self.prefill.shutdown()
                self.decode.shutdown()

    async def tokens(self, request_id: str, prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for output in self.client.generate(request_id, prompt, {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                                      "ignore_eos": True}):
            out += output.outputs[0].token_ids
        return out

    async def stats(self, handle) -> EngineStats:
        return await handle.get_stats.remote()

    async def assert_idle(self, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            figures = [await self.stats(h) for h in (*self.prefill.handles, *self.decode.handles)
                       if not any(h is d for d in self.dead)]
            idle = [(s.num_free_blocks, s.num_total_blocks, s.kv_transfer.get("held_requests", 0))
                    for s in figures]
            if all(free == total and held == 0 for free, total, held in idle):
                return
            assert loop.time() < deadline, f"not idle (free, total, held): {idle}"
            await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def tp2_tp1(ray_local, model):
    """A TP=2 prefill engine and a TP=1 decode engine for the module (the kill test runs last)."""
    pools = start_pools(model, {"tensor_parallel_size": 2}, {})
    try:
        yield pools
    finally:
        for pool in pools:
            pool.shutdown()


async def _check_parity(pd: PD, expected: list[list[int]]) -> None:
    got = await asyncio.gather(*(pd.tokens(f"r{i}", p) for i, p in enumerate(PROMPTS)))
    assert list(got) == expected[:len(PROMPTS)]
    kv = (await pd.stats(pd.decode.handles[0])).kv_transfer
    assert kv["loads"] >= len(PROMPTS) and kv["fallbacks"] == 0 and kv["loaded_bytes"] > 0


def _parity_on_new_pools(model: str, expected: list[list[int]], prefill: dict, decode: dict,
                         connector: str = "ray") -> None:
    async def run() -> None:
        async with PD(*start_pools(model, prefill, decode, connector), owned=True) as pd:
            await _check_parity(pd, expected)

    asyncio.run(run())


def test_tp2_prefill_feeds_tp1_decode(tp2_tp1, expected):
    async def run() -> None:
        async with PD(*tp2_tp1) as pd:
            await _check_parity(pd, expected)

    asyncio.run(run())


@pytest.mark.slow
def test_pp2_prefill_feeds_pp1_decode(ray_local, model, expected):
    _parity_on_new_pools(model, expected, {"pipeline_parallel_size": 2}, {})


@pytest.mark.slow
def test_tp1_prefill_feeds_pp2_decode(ray_local, model, expected):
    _parity_on_new_pools(model, expected, {}, {"pipeline_parallel_size": 2})


@pytest.mark.slow
def test_block_size_8_prefill_feeds_tp2_block_size_4_decode(ray_local, model, expected):
    _parity_on_new_pools(model, expected, {"block_size": 8}, {"tensor_parallel_size": 2})


@pytest.mark.slow
def test_torch_p2p_connector_between_pools(ray_local, model, expected):
    """The pools and the router work over the torch.distributed transport too (a TP=2 producer's
    reader releases reach its engine through the router)."""
    _parity_on_new_pools(model, expected, {"tensor_parallel_size": 2}, {}, connector="torch_p2p")


async def _prefill(producer, request_id: str, prompt: list[int]) -> dict:
    params = None
    async for ref in producer.generate.remote(request_id, {"prompt_token_ids": prompt},
                                              {"max_tokens": 1, "temperature": 0,
                                               "kv_transfer_params": {"do_remote_decode": True}}):
        params = (await ref).kv_transfer_params or params
    assert params is not None
    return params


async def _decode(consumer, request_id: str, prompt: list[int], params: dict) -> list[int]:
    tokens: list[int] = []
    async for ref in consumer.generate.remote(request_id, {"prompt_token_ids": prompt},
                                              {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                               "kv_transfer_params": params}):
        tokens += (await ref).outputs[0].token_ids
    return tokens


def test_forged_kv_transfer_params_over_ray_get_no_foreign_kv(tp2_tp1, expected):
    """A decode engine handed forged params (another hold's token, a guessed token, a made-up hold id, a
    released hold) reads nothing from the TP=2 producer's rank actors: it computes the prompt itself and
    answers the monolithic tokens; a forged release leaves the victim's hold intact; nothing leaks."""
    want = dict(zip(map(tuple, FORGE_PROMPTS), expected[len(PROMPTS):]))

    async def run() -> None:
        async with PD(*tp2_tp1) as pools:
            producer, consumer = pools.prefill.handles[0], pools.decode.handles[0]

            async def decode(name: str, prompt: list[int], params: dict) -> None:
                assert await _decode(consumer, name, prompt, params) == want[tuple(prompt)], name

            a = await _prefill(producer, "forge-a", FORGE_PROMPTS[0])
            b = await _prefill(producer, "forge-b", FORGE_PROMPTS[1])
            before = (await pools.stats(consumer)).kv_transfer
            await decode("a's hold, b's token", FORGE_PROMPTS[2], {**a, "remote_hold_token": b["remote_hold_token"]})
            await decode("b's hold, a guess", FORGE_PROMPTS[3], {**b, "remote_hold_token": "guessed-" + "x" * 35})
            await decode("a made-up hold", FORGE_PROMPTS[4], {**a, "remote_request_id": "made-up@0"})
            await producer.kv_release.remote(b["remote_request_id"], "guessed")  # does not free b
            await decode("a", FORGE_PROMPTS[0], a)
            await producer.kv_release.remote(a["remote_request_id"], a["remote_hold_token"])  # (as the router does)
            c = await _prefill(producer, "forge-c", FORGE_PROMPTS[5])  # its step revokes a at the rank actors
            await decode("a released hold", FORGE_PROMPTS[6], a)
            await decode("b", FORGE_PROMPTS[1], b)  # the victim's hold was intact
            await producer.kv_release.remote(c["remote_request_id"], c["remote_hold_token"])
            kv = (await pools.stats(consumer)).kv_transfer
            assert (kv["fallbacks"] - before["fallbacks"], kv["loads"] - before["loads"]) == (4, 2)

    asyncio.run(run())


def test_producer_killed_before_the_read_makes_the_consumer_recompute(tp2_tp1, expected):
    """The prefill finished and handed out its KV's address; then its (TP=2) engine dies. The decode
    engine's read fails and it computes the prompt itself: same tokens, counted as a fallback."""
    import ray
    from ray.exceptions import RayActorError

    async def run() -> None:
        async with PD(*tp2_tp1) as pools:
            producer = pools.prefill.handles[0]
            params = None
            async for ref in producer.generate.remote("pre", {"prompt_token_ids": KILL_PROMPT},
                                                      {"max_tokens": 1, "temperature": 0,
                                                       "kv_transfer_params": {"do_remote_decode": True}}):
                params = (await ref).kv_transfer_params or params
            assert params is not None and len(params["remote_addresses"]) == 2
            ranks = await producer.kv_rank_endpoints.remote()
            ray.kill(producer, no_restart=True)  # its rank actors die with it
            pools.dead.append(producer)
            for actor, call in [(producer, "get_stats"), *((rank, "ping") for rank in ranks)]:
                while True:  # ray.kill returns at once: wait until the engine and its ranks are really gone
                    try:
                        await asyncio.wait_for(getattr(actor, call).remote(), 10)
                    except RayActorError:
                        break
                    await asyncio.sleep(0.05)
            consumer = pools.decode.handles[0]
            before = (await pools.stats(consumer)).kv_transfer
            tokens: list[int] = []
            async for ref in consumer.generate.remote("dec", {"prompt_token_ids": KILL_PROMPT},
                                                      {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                                                       "kv_transfer_params": params}):
                tokens += (await ref).outputs[0].token_ids
            assert tokens == expected[-1]
            kv = (await pools.stats(consumer)).kv_transfer
            assert (kv["fallbacks"] - before["fallbacks"], kv["loads"] - before["loads"]) == (1, 0)

    asyncio.run(run())
