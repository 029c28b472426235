"""pagedserve on a real three-node Ray cluster on this machine (`tests/multinode_cluster.py`): a 1-CPU head
(Serve's controller, proxy and the ingress replicas, pinned there by a custom resource) and two 2-CPU
worker nodes `a` and `b`, deployed as a user deploys it: `serve deploy` of a Serve config through the app
builder, against the head's dashboard.

- `dp`: two data-parallel engine replicas of 1.5 CPUs each: no node holds both, so one runs on `a` and
  one on `b` (read back from Ray's state API).
- `tp`: one TP=2 engine whose placement group (the replica's bundle and one per rank) is STRICT_SPREAD
  over the three nodes: its two ranks sit on different nodes and meet over gloo across them; its greedy
  tokens equal the TP=1 engines' (and HF's).
- slow: worker node `b` is killed under load: the requests its dp engine held migrate to the engine on
  `a` and complete with every other (none fails); a node added back brings both apps to full strength
  again.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
import torch

pytest.importorskip("ray")

from pagedserve.cluster.executor.ray_utils import free_port  # noqa: E402
from tests.multinode_cluster import (  # noqa: E402
    LocalCluster, node_resource, serve_deploy, wait_apps_running,
)

MODEL = "tiny"
TIMEOUT = 180.0
PROMPTS = [[(11 * i + 5 * k) % 300 + 20 for k in range(5 + 2 * i)] for i in range(4)]
MAX_TOKENS = 8


def app_config(name: str, model: str, **args) -> dict:
    """One application of the Serve config: the app builder's args, and its ingress pinned to the head."""
    return {
        "name": name,
        "route_prefix": f"/{name}",
        "import_path": "pagedserve.cluster.serve.app:build_app",
        "args": {"model": model, "app_name": name, "served_model_name": MODEL, "dtype": "float32",
                 "kv_cache_memory": "8MiB", "block_size": 4, "max_num_seqs": 16, "routing_stats_period_s": 0.2,
                 "graceful_shutdown_timeout_s": 5, **args},
        "deployments": [{"name": f"{name}-ingress",
                         "ray_actor_options": {"num_cpus": 0, "resources": {node_resource("head"): 0.01}}}],
    }


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def hf_texts(model_path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
            out.append(tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def cluster(model_path):
    with LocalCluster(head_cpus=1, workers={"a": 2, "b": 2}) as running:
        port = free_port()
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [
                app_config("dp", model_path, data_parallel_size=2, num_cpus_per_engine=1.5),
                app_config("tp", model_path, tensor_parallel_size=2, placement_group_strategy="STRICT_SPREAD",
                           num_cpus_per_engine=0.5, num_cpus_per_worker=0.5),
            ],
        }
        serve_deploy(config, running.dashboard_url)
        wait_apps_running(["dp", "tp"])
        running.base_url = f"http://127.0.0.1:{port}"
        yield running


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=TIMEOUT) as client:
        yield client


def completion_text(http: httpx.Client, app: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    """The greedy completion of one prompt (ignoring EOS, so every engine generates max_tokens)."""
    response = http.post(f"/{app}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_data_parallel_engines_run_on_different_nodes(cluster, http, hf_texts):
    nodes = cluster.replica_nodes("dp", "dp-engine")
    assert len(nodes) == 2 and set(nodes) == {cluster.node_id("a"), cluster.node_id("b")}, (
        nodes, cluster.node_names())
    # The ingress (and Serve's proxy) stay on the head, where the config put them.
    assert cluster.replica_nodes("dp", "dp-ingress") == [cluster.node_id("head")]
    for prompt, expected in zip(PROMPTS, hf_texts):
        assert completion_text(http, "dp", prompt) == expected


def test_tp2_ranks_on_two_nodes_match_tp1(cluster, http, hf_texts):
    from ray import serve

    info = serve.get_deployment_handle("tp-ingress", app_name="tp").get_engine_info.remote().result()[0]
    assert info["tensor_parallel_size"] == 2
    ranks = info["rank_node_ids"]
    assert len(ranks) == 2 and len(set(ranks)) == 2, ranks  # two ranks, two nodes
    assert set(ranks) <= set(cluster.node_names()), (ranks, cluster.node_names())
    tp1 = [completion_text(http, "dp", prompt) for prompt in PROMPTS]
    tp2 = [completion_text(http, "tp", prompt) for prompt in PROMPTS]
    assert tp2 == tp1 == hf_texts


# --------------------------------------------------------------------------- a node dies under load


def stream_until_done(base_url: str, app: str, prompt: list[int], max_tokens: int, started) -> dict:
    """One streamed completion; the outcome: tokens received, and the error (an error event or a 5xx body)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    result: dict = {"tokens": 0, "error": None, "finish_reason": None, "status": None}
    with httpx.Client(base_url=base_url, timeout=TIMEOUT) as client:
        with client.stream("POST", f"/{app}/v1/completions", json=body) as response:
            result["status"] = response.status_code
            if response.status_code != 200:
                response.read()
                result["error"] = response.json().get("error")
                started.release()
                return result
            first = True
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result["error"] = chunk["error"]
                    break
                if first:
                    started.release()
                    first = False
                choice = chunk["choices"][0]
                result["tokens"] += 1 if choice["text"] or choice.get("finish_reason") is None else 0
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    if first:
        started.release()
    return result


def wait_both_engines_busy(http: httpx.Client, deadline_s: float = 60.0) -> None:
    """Until the ingress's /metrics shows both dp engines running requests (routing spread the load)."""
    from tests.test_serve_scaleout import metric_samples

    end = time.monotonic() + deadline_s
    while True:
        running = metric_samples(http.get("/dp/metrics").text, "pagedserve:engine_num_requests_running")
        if len(running) == 2 and all(value > 0 for value in running.values()):
            return
        assert time.monotonic() < end, f"the load did not reach both engines: {running}"
        time.sleep(0.2)


@pytest.mark.slow
def test_worker_node_killed_under_load_fails_no_request_and_recovers(cluster, http):
    import threading


    victim = cluster.node_id("b")
    names = cluster.node_names()
    assert victim in cluster.replica_nodes("dp", "dp-engine")
    started = threading.Semaphore(0)
    requests = [("dp", [(7 * i + k) % 200 + 30 for k in range(6)]) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(stream_until_done, cluster.base_url, app, prompt, 400, started)
                   for app, prompt in requests]
        for _ in requests:  # every request is streaming (or failed) before the node goes
            assert started.acquire(timeout=TIMEOUT)
        wait_both_engines_busy(http)
        cluster.kill_worker("b")
        outcomes = [f.result(timeout=2 * TIMEOUT) for f in futures]
    done = [o for o in outcomes if o["error"] is None]
    failed = [o for o in outcomes if o["error"] is not None]
    # The killed node's requests migrated to the engine on `a` (cluster/serve/migration.py).
    assert not failed, f"requests failed although the engine on node a could finish them: {failed}"
    for outcome in done:
        assert outcome["finish_reason"] == "length", outcome
    # While node b is gone the surviving engine (on a) keeps serving dp.
    assert completion_text(http, "dp", PROMPTS[0])
    # Capacity returns: a new node with b's resources; Serve places the replacement replicas there.
    cluster.add_worker("b")
    cluster.wait_nodes(3)
    deadline = time.monotonic() + 420
    while True:
        nodes = cluster.replica_nodes("dp", "dp-engine")
        if len(nodes) == 2 and set(nodes) == {cluster.node_id("a"), cluster.node_id("b")}:
            break
        assert time.monotonic() < deadline, (nodes, cluster.node_names())
        time.sleep(1.0)
    assert cluster.node_id("b") != victim and victim in names
    expected = completion_text(http, "dp", PROMPTS[1])
    for _ in range(6):  # both dp engines answer the same
        assert completion_text(http, "dp", PROMPTS[1]) == expected
    # The TP=2 engine lost a rank: its requests fail cleanly until Serve's health check replaces the replica
    # (a new placement group over the three nodes), then it answers as before.
    deadline = time.monotonic() + 420
    while True:
        response = http.post("/tp/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                        "temperature": 0.0, "ignore_eos": True})
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == expected
            break
        assert response.status_code >= 500 and response.json()["error"]["message"], response.text
        assert time.monotonic() < deadline, response.text
        time.sleep(2.0)
    wait_apps_running(["dp", "tp"])
