"""Multi-LoRA routing: the Serve request router prefers replicas that report the request's adapter resident
(then load), over fake replicas (no Ray, no Serve app)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.cluster.serve.engine_calls import adapter_of
from tests.test_serve_router import make_router


def pending_for(adapter: str | None, prompt: list[int]) -> Any:
    params: dict = {"max_tokens": 4}
    if adapter is not None:
        params["lora_request"] = {"lora_name": adapter, "lora_int_id": 3, "lora_path": "/adapters/x"}
    return SimpleNamespace(metadata=SimpleNamespace(call_method="generate"), args=["req", prompt, params, 0], kwargs={})


def test_requests_go_to_the_replica_holding_their_adapter_unless_it_is_overloaded():
    router, replicas = make_router(4)
    replicas[2].routing_stats["lora_adapters"] = ["sql"]
    replicas[3].routing_stats["lora_adapters"] = ["chat"]
    for i in range(8):  # different prompts: no prefix affinity, only the adapter
        prompt = [i * 7 + k for k in range(3)]
        choice = asyncio.run(router.choose_replicas(replicas, pending_for("sql", prompt)))[0][0]
        assert choice is replicas[2]
        assert asyncio.run(router.choose_replicas(replicas, pending_for("chat", prompt)))[0][0] is replicas[3]
    # a holder far more loaded than the others (past imbalance_factor * least + slack) is passed over
    replicas[2].routing_stats["num_running"] = 40
    assert router.choose(replicas, [1, 2, 3], adapter="sql") is not replicas[2]
    # an adapter nobody holds: load decides among all
    chosen = {router.choose(replicas, [k, k + 1], adapter="new").replica_id for k in range(20)}
    assert len(chosen) > 1


def test_the_adapter_is_read_from_the_generate_calls_sampling_params():
    assert adapter_of(pending_for("sql", [1, 2])) == "sql"
    assert adapter_of(pending_for(None, [1, 2])) is None
    other = pending_for("sql", [1])
    other.metadata.call_method = "get_stats"
    assert adapter_of(other) is None


def test_the_adapter_rides_to_both_prefill_and_decode_legs_and_back_out_at_the_engine_host():
    """PD: the prefill leg's params are the user's (adapter included), and the engine host takes the adapter out of
    the params it hands to SamplingParams."""
    from pagedserve.cluster.serve.pd_client import prefill_params
    from pagedserve.engine.lora.request import LoRARequest, pop_lora_request

    user = pending_for("sql", [1, 2]).args[2]
    leg = prefill_params(user)
    assert leg["lora_request"] == user["lora_request"] and leg["kv_transfer_params"] == {"do_remote_decode": True}
    rest, lora = pop_lora_request(leg)
    assert lora == LoRARequest("sql", 3, "/adapters/x") and "lora_request" not in rest
    with pytest.raises(ValueError, match="lora_request: expected an object"):
        pop_lora_request({"lora_request": {"lora_name": "x"}})
