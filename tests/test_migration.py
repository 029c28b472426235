"""`MigratingClient` (cluster/serve/migration.py) over a real engine, without Ray: an inner client whose
streams die on command (`EngineDeadError`, as a replica's death surfaces) is wrapped, and what the
wrapper streams equals an uninterrupted run: the same tokens, text, finish reason and logprobs, no
error, each token once; `final_only` requests (run `OutputKind.CHECKPOINT` as the engine host does:
deltas merged per checkpoint, their text decoded at the end) continue the same way; `max_migrations` bounds it all with
a clean error; the counts reach /metrics."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.cluster.serve.migration import MigratingClient
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, EngineStoppedError
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from tests.structured_output_checks import SPECS, is_valid

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 12]


class FlakyClient:
    """An EngineClient over one AsyncLLM. `faults` is consumed one entry per submitted stream: an int k
    kills that stream (EngineDeadError) once it has delivered k tokens or more and has more to deliver
    (the engine merges steps into one output when its reader lags, so a kill lands between outputs), an
    exception instance is raised before its first output, None lets it run. A `final_only` stream is
    what an engine host sends for one: CHECKPOINT deltas every `checkpoint_s`, texts decoded at the end."""

    checkpoint_s = 0.0

    def __init__(self, engine: AsyncLLM, faults: list | None = None) -> None:
        self.engine = engine
        self.faults = list(faults or [])
        self.submitted: list[tuple[str, dict, bool]] = []
        self.kills = 0

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                       priority: int = 0, final_only: bool = False,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        self.submitted.append((request_id, sampling_params, final_only))
        fault = self.faults.pop(0) if self.faults else None
        if isinstance(fault, BaseException):
            raise fault
        params = SamplingParams(**sampling_params)
        kind = OutputKind.CHECKPOINT if final_only else OutputKind.DELTA
        stream = self.engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, request_id=request_id,
                                      priority=priority, output_kind=kind, checkpoint_interval_s=self.checkpoint_s)
        delivered = 0
        try:
            async for output in stream:
                if fault is not None and delivered >= fault:
                    self.kills += 1
                    raise EngineDeadError(f"replica of {request_id} died")
                delivered += sum(len(c.token_ids) for c in output.outputs)
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def aggregate_stats(self) -> FleetStats:
        return FleetStats(num_engines=1)

    latest_stats = aggregate_stats

    def is_healthy(self) -> bool:
        return True


@pytest.fixture(scope="module")
def engine(tiny_llama):
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, kv_cache_memory="16MiB"))
    yield llm
    llm.shutdown()


async def _collect(client, params: dict, final_only: bool = False, request_id: str = "req") -> dict[int, dict]:
    """index -> {"tokens", "text", "logprobs", "finish_reason", "cumulative"}; checks the stream's ids."""
    got: dict[int, dict] = {}
    finished = False
    async for out in client.generate(request_id, PROMPT, params, final_only=final_only):
        assert out.request_id == request_id and not finished
        assert out.error is None
        finished = out.finished
        for c in out.outputs:
            entry = got.setdefault(c.index, {"tokens": [], "text": "", "logprobs": [], "finish_reason": None})
            entry["tokens"] += c.token_ids
            entry["text"] += c.text
            entry["logprobs"] += c.logprobs or []
            entry["finish_reason"] = c.finish_reason or entry["finish_reason"]
            entry["cumulative"] = c.cumulative_logprob
    assert finished
    return got


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for index in want:
        g, w = got[index], want[index]
        assert g["tokens"] == w["tokens"], f"completion {index}"
        assert g["text"] == w["text"]
        assert g["finish_reason"] == w["finish_reason"]
        assert len(g["logprobs"]) == len(w["logprobs"])
        if w["cumulative"] is not None:
            assert math.isclose(g["cumulative"], w["cumulative"], rel_tol=1e-4, abs_tol=1e-4)


def _blocks_free(engine: AsyncLLM) -> bool:
    stats = engine.get_stats().scheduler
    return stats.num_free_blocks == stats.num_total_blocks


async def _wait_blocks_free(engine: AsyncLLM) -> None:
    for _ in range(200):
        if _blocks_free(engine):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("KV blocks still in use")


CASES = {
    "greedy": dict(temperature=0, max_tokens=20, ignore_eos=True),
    "seeded": dict(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True),
    "n2_seeded_logprobs": dict(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=2),
    "json": dict(structured_outputs=SPECS["json"], temperature=0, max_tokens=40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_killed_twice_equals_an_uninterrupted_one(engine, case):
    params = SamplingParams(**CASES[case]).model_dump()

    async def run() -> None:
        want = await _collect(FlakyClient(engine), params)
        inner = FlakyClient(engine, faults=[4, 3])
        client = MigratingClient(inner, max_migrations=3)
        got = await _collect(client, params)
        _assert_same(got, want)
        assert client.num_migrations == inner.kills >= 1 and client.num_migration_failures == 0
        resumed = [p for _, p, _ in inner.submitted[1:]]
        assert all(p["n"] == 1 and p["prompt_logprobs"] is None for p in resumed)
        assert any(p["resume_output_token_ids"] for p in resumed)
        if case == "json":
            assert is_valid("json", got[0]["text"])
        await _wait_blocks_free(engine)

    asyncio.run(run())


def test_a_stop_string_straddling_the_seam(engine):
    async def run() -> None:
        plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True).model_dump()
        tokens = (await _collect(FlakyClient(engine), plain))[0]["tokens"]
        tokenizer = engine.tokenizer
        start, end = len(tokenizer.decode(tokens[:8])), len(tokenizer.decode(tokens[:10]))
        stop = tokenizer.decode(tokens)[start:end]
        params = {**plain, "stop": [stop]}
        want = await _collect(FlakyClient(engine), params)
        assert want[0]["finish_reason"] == "stop"
        for kill_after in (8, 9):  # about where the stop string's tokens are (an output may carry several)
            got = await _collect(MigratingClient(FlakyClient(engine, faults=[kill_after])), params)
            _assert_same(got, want)
        await _wait_blocks_free(engine)

    asyncio.run(run())


@pytest.mark.parametrize("case", [*CASES, "stop"])
def test_a_final_only_request_killed_twice_continues_to_the_uninterrupted_answer(engine, case):
    """A non-streamed request continues from the tokens its dead engines had sent (not from scratch):
    its answer is the one an uninterrupted run gives, streamed or not."""
    params = SamplingParams(**CASES.get(case, CASES["greedy"])).model_dump()

    async def run() -> None:
        if case == "stop":  # a stop string from where the second kill lands: it straddles a seam
            tokens = (await _collect(FlakyClient(engine), params))[0]["tokens"]
            params["stop"] = [engine.tokenizer.decode(tokens)[len(engine.tokenizer.decode(tokens[:8])):][:3]]
        want = await _collect(FlakyClient(engine), params, final_only=True)
        _assert_same(want, await _collect(FlakyClient(engine), params))
        inner = FlakyClient(engine, faults=[4, 3, EngineStoppedError("draining")])
        client = MigratingClient(inner, max_migrations=3)
        got = await _collect(client, params, final_only=True)
        _assert_same(got, want)
        assert all(final for _, _, final in inner.submitted)
        resumed = [p["resume_output_token_ids"] or [] for _, p, _ in inner.submitted[1:]]
        assert client.num_migrations >= 1 and any(resumed)  # continued, not restarted
        if case == "json":
            assert is_valid("json", got[0]["text"])
        await _wait_blocks_free(engine)

    asyncio.run(run())


@pytest.mark.parametrize("final_only", [False, True], ids=["streamed", "final_only"])
def test_max_migrations_exhausted_is_a_clean_error(engine, final_only, caplog):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True).model_dump()

    async def run() -> None:
        want = (await _collect(FlakyClient(engine), params))[0]["tokens"]
        client = MigratingClient(FlakyClient(engine, faults=[2, 0, 0]), max_migrations=2)
        seen: list[int] = []
        with pytest.raises(EngineDeadError, match="migrated 2 times"):
            async for out in client.generate("req-7", PROMPT, params, final_only=final_only):
                seen += out.outputs[0].token_ids
        assert len(seen) >= 2 and seen == want[:len(seen)]  # what the first attempt delivered, once
        assert client.num_migrations == 2 and client.num_migration_failures == 1
        none = MigratingClient(FlakyClient(engine, faults=[0]), max_migrations=0)
        with pytest.raises(EngineDeadError, match="migrated 0 times"):
            await _collect(none, params, final_only=final_only)
        await _wait_blocks_free(engine)

    with caplog.at_level("WARNING", logger="pagedserve.cluster.serve.migration"):
        asyncio.run(run())
    logged = [r.getMessage() for r in caplog.records]
    assert sum("request req-7:" in m and "migrating it" in m for m in logged) == 2
    assert any("request req-7:" in m and "giving up" in m for m in logged)


def test_a_refused_request_is_retried_then_the_refusal_stands(engine):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True).model_dump()
    full = EngineOverloadedError("queue full")

    async def run() -> None:
        want = await _collect(FlakyClient(engine), params)
        for faults in ([full, full], [0, full], [3, full]):  # refused at the start; where it migrates to
            inner = FlakyClient(engine, faults=faults)
            client = MigratingClient(inner, max_overload_retries=2)
            _assert_same(await _collect(client, params), want)
            refusals = faults.count(full) - inner.faults.count(full)  # (a kill after 3 tokens may not land)
            assert client.num_overload_retries == refusals and (refusals >= 1 or faults[0] == 3)
        refused = MigratingClient(FlakyClient(engine, faults=[full] * 3), max_overload_retries=2)
        with pytest.raises(EngineOverloadedError):
            await _collect(refused, params)
        assert refused.num_overload_retries == 2 and refused.num_migrations == 0
        await _wait_blocks_free(engine)

    asyncio.run(run())


def test_migrations_are_on_metrics(engine):
    client = MigratingClient(FlakyClient(engine), max_migrations=1)
    client.num_migrations, client.num_migration_failures, client.num_overload_retries = 5, 1, 2
    text = ServingMetrics("tiny", client.latest_stats).render()[0].decode()
    assert 'pagedserve:request_migrations_total{model_name="tiny"} 5.0' in text
    assert 'pagedserve:request_migration_failures_total{model_name="tiny"} 1.0' in text
    assert 'pagedserve:overload_retries_total{model_name="tiny"} 2.0' in text
    assert client.is_healthy() and client.aggregate_stats().num_engines == 1


class TwoEngines(FlakyClient):
    """Submissions go to the first engine not shut down (a router that stopped routing to a drained one)."""

    def __init__(self, draining: AsyncLLM, survivor: AsyncLLM) -> None:
        super().__init__(draining)
        self.draining, self.survivor = draining, survivor

    def generate(self, *args, **kwargs) -> AsyncIterator[RequestOutput]:
        self.engine = self.survivor if self.draining._stopped.is_set() else self.draining
        return super().generate(*args, **kwargs)


def test_a_draining_engine_hands_its_unfinished_requests_over(engine, tiny_llama):
    params = SamplingParams(temperature=0.7, seed=42, max_tokens=300, ignore_eos=True, logprobs=1).model_dump()
    draining = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, kv_cache_memory="16MiB"))

    async def run() -> None:
        want = await _collect(FlakyClient(engine), params)
        client = MigratingClient(TwoEngines(draining, engine))
        got: dict = {"tokens": [], "text": ""}
        async for out in client.generate("drained", PROMPT, params):
            got["tokens"] += out.outputs[0].token_ids
            got["text"] += out.outputs[0].text
            if len(got["tokens"]) >= 5 and not draining._stopped.is_set():
                await asyncio.to_thread(draining.shutdown)  # the replica's graceful window is over
        assert got["tokens"] == want[0]["tokens"] and got["text"] == want[0]["text"]
        assert client.num_migrations == 1
        await _wait_blocks_free(engine)

    try:
        asyncio.run(run())
    finally:
        draining.shutdown()


def test_a_final_only_request_that_failed_after_some_outputs_continues_after_them():
    """A PD request streams its first-token delta even for a caller that reads only the end: when such a
    try dies after it, the next try continues from that token, which reaches the caller once."""
    from pagedserve.engine.outputs import CompletionOutput

    def delta(tokens: list[int], finished: bool) -> RequestOutput:
        completion = CompletionOutput(index=0, text="".join(f"<{t}>" for t in tokens), token_ids=tokens,
                                      cumulative_logprob=None, logprobs=None,
                                      finish_reason="length" if finished else None)
        return RequestOutput(request_id="x", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                             outputs=[completion], finished=finished)

    class DiesOnce:
        params: list[dict] = []

        async def generate(self, request_id, prompt_token_ids, params, priority=0, final_only=False,
                           cache_salt=None):
            assert final_only
            DiesOnce.params.append(params)
            if len(DiesOnce.params) == 1:
                yield delta([7], False)
                raise EngineDeadError("the decode replica died")
            yield delta([8, 9], True)

    async def run():
        client = MigratingClient(DiesOnce(), max_migrations=2)
        return [o async for o in client.generate("x", [1, 2], {"max_tokens": 3}, final_only=True)]

    outputs = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outputs] == [[7], [8, 9]]
    assert all(o.request_id == "x" for o in outputs)
    assert [p.get("resume_output_token_ids") for p in DiesOnce.params] == [None, [7]]
