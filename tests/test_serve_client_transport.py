"""`ServeEngineClient`'s two transports: plain streams over Serve's gRPC transport (written with plain
pickle, not cloudpickle), requests that may outgrow a gRPC message (prompt logprobs, logprobs, embeddings,
very long prompts) over Ray's; and a replica's exception read the same way whether it arrives wrapped in a
RayTaskError (Ray) or as itself (gRPC)."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import pytest

pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402
from ray.exceptions import RayTaskError  # noqa: E402

from pagedserve.cluster.serve import router_registry  # noqa: E402
from pagedserve.cluster.serve.client import GRPC_PROMPT_TOKENS, ServeEngineClient, too_large_for_grpc  # noqa: E402
from pagedserve.cluster.serve.engine_host import EngineHost  # noqa: E402
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError  # noqa: E402
from pagedserve.engine.outputs import Logprob  # noqa: E402
from tests.serve_handle_fakes import FakeHandle  # noqa: E402

GRPC_MESSAGE_CAP = 4 * 1024 * 1024  # RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH's default


def test_prompt_logprobs_of_a_long_prompt_outgrow_a_grpc_message():
    """Why such requests stay on Ray's transport: 20 prompt logprobs of 5,000 positions pickle past the cap."""
    positions = [None] + [{p * 21 + j: Logprob(-1.5, j + 1, f" t{j}") for j in range(21)} for p in range(5000)]
    assert len(cloudpickle.dumps(positions)) > GRPC_MESSAGE_CAP
    assert too_large_for_grpc(5000, {"prompt_logprobs": 20}, None)


def test_the_longest_prompt_sent_over_grpc_fits_a_message_with_room_to_spare():
    worst = [2**31 - 1] * GRPC_PROMPT_TOKENS  # ids of a huge vocabulary pickle largest
    assert len(pickle.dumps(worst, protocol=pickle.HIGHEST_PROTOCOL)) < GRPC_MESSAGE_CAP * 2 // 3
    assert not too_large_for_grpc(GRPC_PROMPT_TOKENS, {"max_tokens": 4}, None)
    assert too_large_for_grpc(GRPC_PROMPT_TOKENS + 1, {"max_tokens": 4}, None)


@pytest.mark.parametrize("params, large", [
    ({"max_tokens": 4}, False),
    ({"max_tokens": 4, "logprobs": None, "prompt_logprobs": None}, False),
    ({"max_tokens": 4, "logprobs": 0}, True),
    ({"max_tokens": 4, "logprobs": 5}, True),
    ({"max_tokens": 4, "prompt_logprobs": 0}, True),
])
def test_which_requests_may_send_large_outputs(params, large):
    assert too_large_for_grpc(100, params, None) is large
    assert too_large_for_grpc(100, params, {"pooling": "mean"}) is True


def test_plain_streams_go_over_grpc_and_logprob_streams_over_ray(tiny_llama):
    replica = EngineHost({"model": str(tiny_llama), "dtype": "float32", "kv_cache_memory": "8MiB", "block_size": 4})
    handle = FakeHandle(replica)
    client = ServeEngineClient(handle, "app", "engine")
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def tokens(rid: str, params: dict) -> list[int]:
        return [t async for o in client.generate(rid, [5, 6, 7, 8], params) for t in o.outputs[0].token_ids]

    try:
        plain = asyncio.run(tokens("plain", greedy))
        with_logprobs = asyncio.run(tokens("logprobs", {**greedy, "logprobs": 2}))
        with_prompt_logprobs = asyncio.run(tokens("prompt", {**greedy, "prompt_logprobs": 1}))
    finally:
        replica.shutdown()
    assert handle.transports == ["grpc", "ray", "ray"]
    assert len(plain) == 5 and plain == with_logprobs == with_prompt_logprobs


def test_grpc_streams_are_written_with_plain_pickle(tiny_llama):
    """cloudpickle's per-object hook made writing one delta ~3x slower than pickle's C writer (18 against
    6 us measured); what travels on these streams (the call's arguments, RequestOutput deltas and the
    replica's exceptions) is importable, which is all plain pickle needs. The fake handle puts a whole
    stream through Serve's serializer as the options name it, so a delta that pickle could not write
    fails here."""
    replica = EngineHost({"model": str(tiny_llama), "dtype": "float32", "kv_cache_memory": "8MiB", "block_size": 4})
    handle = FakeHandle(replica)
    client = ServeEngineClient(handle, "app", "engine")
    assert client.stream_handle.serialization == {"request_serialization": "pickle",
                                                  "response_serialization": "pickle"}
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def outputs() -> list:
        return [o async for o in client.generate("pickled", [5, 6, 7, 8], params)]

    try:
        streamed = asyncio.run(outputs())
    finally:
        replica.shutdown()
    assert handle.transports == ["grpc"]
    assert sum(len(o.outputs[0].token_ids) for o in streamed) == 4 and streamed[-1].finished
    assert all(o.prompt_token_ids == [5, 6, 7, 8] for o in streamed)  # the elided prompt restored


class RaisingReplica:
    """A replica whose `generate` raises `error` before its first output."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def generate(self, *args, **kwargs):
        raise self.error
        yield  # (an async generator)


class RecordingRouter:
    def __init__(self) -> None:
        self.outcomes: list[bool] = []
        self.refusals = 0

    def record_outcome(self, internal_id: str, ok: bool) -> None:
        self.outcomes.append(ok)

    def record_refusal(self, internal_id: str) -> None:
        self.refusals += 1


def ray_wrapped(error: BaseException) -> BaseException:
    """How Ray's transport delivers a replica's exception: a RayTaskError that is also an instance of it."""
    return RayTaskError("generate", "traceback", error).as_instanceof_cause()


# (how the replica's exception arrives, and a request that takes that transport: logprobs go over Ray's)
TRANSPORTS = {"grpc": (lambda e: e, {"max_tokens": 2}), "ray": (ray_wrapped, {"max_tokens": 2, "logprobs": 1})}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("error, raised, outcomes, refusals", [
    (EngineOverloadedError("the engine has 1 unfinished requests (limit 1)"), EngineOverloadedError, [], 1),
    (EngineDeadError("the engine loop died"), EngineDeadError, [False], 0),
    (ValueError("max_tokens: must be at least 1"), ValueError, [], 0),
])
def test_a_replicas_exception_means_the_same_over_either_transport(transport, error, raised, outcomes, refusals):
    router = RecordingRouter()
    app = f"app-{transport}-{raised.__name__}"
    router_registry.register(app, "engine", router)
    arrives_as, params = TRANSPORTS[transport]
    handle = FakeHandle(RaisingReplica(arrives_as(error)))
    client = ServeEngineClient(handle, app, "engine")

    async def run() -> None:
        async for _ in client.generate("r", [1, 2, 3], params):
            pass

    with pytest.raises(raised) as caught:
        asyncio.run(run())
    assert handle.transports == [transport]
    assert not isinstance(caught.value, RayTaskError)  # the cause itself reaches the caller
    assert (router.outcomes, router.refusals) == (outcomes, refusals)


@pytest.mark.parametrize("code, raised, outcomes", [
    (grpc.StatusCode.UNAVAILABLE, EngineDeadError, [False]),  # the replica's process went away mid-stream
    (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.AioRpcError, []),  # not the engine's doing: as it came
])
def test_a_broken_grpc_stream_is_a_dead_engine_only_when_unavailable(code, raised, outcomes):
    router = RecordingRouter()
    app = f"app-grpc-{code.name}"
    router_registry.register(app, "engine", router)
    broken = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="from the test")
    client = ServeEngineClient(FakeHandle(RaisingReplica(broken)), app, "engine")

    async def run() -> None:
        async for _ in client.generate("r", [1, 2, 3], {"max_tokens": 2}):
            pass

    with pytest.raises(raised):
        asyncio.run(run())
    assert (router.outcomes, router.refusals) == (outcomes, 0)
