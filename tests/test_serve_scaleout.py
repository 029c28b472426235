"""The scaled-out Serve app, live on loopback: two engine replicas (the DP engines, behind the prefix
affinity request router) and two stateless ingress replicas, on a tiny random-weight model.

One Ray instance and one app for the module; the fault tests run last (they kill replicas). After
every test every KV block on every engine replica is free (read from the replicas' routing stats in
/metrics).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import torch

from pagedserve.cluster.settings import ServeArgs

MODEL = "tiny"
TIMEOUT = 120.0
BLOCK = 4
APP = "scaleout"
PROMPTS = [[(7 * i + 13 * k) % 400 + 10 for k in range(6 + 3 * i)] for i in range(6)]


def metric_samples(text: str, name: str) -> dict[str, float]:
    """label text -> value for one metric of a Prometheus exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


def metric(text: str, name: str) -> float:
    return sum(metric_samples(text, name).values())


def wait_all_blocks_free(http: httpx.Client, replicas: int | None = None, deadline_s: float = 90.0) -> str:
    """Poll /metrics until every engine replica reports every KV block free and nothing running."""
    end = time.monotonic() + deadline_s
    while True:
        text = http.get("/metrics").text
        free = metric_samples(text, "pagedserve:engine_kv_cache_free_blocks")
        total = metric_samples(text, "pagedserve:engine_kv_cache_total_blocks")
        running = metric(text, "pagedserve:engine_num_requests_running") + metric(
            text, "pagedserve:engine_num_requests_waiting")
        ok = bool(total) and free == total and running == 0 and (replicas is None or len(total) == replicas)
        if ok:
            return text
        if time.monotonic() > end:
            raise AssertionError(f"KV blocks not all free: free={free} total={total} running={running}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def hf(tiny_model_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_factory("llama", max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_text(hf, prompt: list[int], max_new: int) -> str:
    model, tokenizer = hf
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    from pagedserve.cluster.serve.app import server_url
    from tests.serve_apps import serve_app

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    with serve_app(model, app_name=APP, block_size=BLOCK, data_parallel_size=2, num_ingress_replicas=2,
                   graceful_shutdown_timeout_s=20) as args:
        yield server_url(args)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(autouse=True)
def blocks_free_after(request):
    yield
    if "http" in request.fixturenames:
        wait_all_blocks_free(request.getfixturevalue("http"))


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0.0, **extra})


def streamed_text(http: httpx.Client, prompt: list[int], max_tokens: int = 8) -> str:
    import json

    text = ""
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0.0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


# --------------------------------------------------------------------------- parity and routing


def test_two_engines_two_ingresses_match_hf(http, hf):
    ingresses: set[str] = set()
    for prompt in PROMPTS:
        response = complete(http, prompt)
        assert response.status_code == 200, response.text
        ingresses.add(response.headers["x-pagedserve-ingress"])
        expected = hf_text(hf, prompt, 8)
        assert response.json()["choices"][0]["text"] == expected
        assert streamed_text(http, prompt) == expected
    for _ in range(30):  # the proxy spreads requests over both ingress replicas
        if len(ingresses) == 2:
            break
        ingresses.add(complete(http, PROMPTS[0], max_tokens=1).headers["x-pagedserve-ingress"])
    assert len(ingresses) == 2
    text = http.get("/metrics").text
    assert metric(text, "pagedserve:num_engines") == 2
    assert len(metric_samples(text, "pagedserve:engine_kv_cache_total_blocks")) == 2


def test_batch_of_prompts_in_one_request(http, hf):
    """The prompts of one HTTP request go out as concurrent handle calls, each routed on its own."""
    response = complete(http, PROMPTS[:3], max_tokens=6)
    assert response.status_code == 200, response.text
    texts = {c["index"]: c["text"] for c in response.json()["choices"]}
    assert texts == {i: hf_text(hf, PROMPTS[i], 6) for i in range(3)}


def test_shared_prefix_lands_on_one_replica(http):
    wait_all_blocks_free(http, replicas=2)
    before = settled_samples(http, "pagedserve:engine_prefix_cache_hits")
    shared = [(5 * k) % 300 + 20 for k in range(8 * BLOCK)]  # 8 full blocks
    reported = {}  # ingress replica -> prefixes reported over all engines, before
    for _ in range(40):
        response = http.get("/metrics")
        reported.setdefault(response.headers["x-pagedserve-ingress"],
                            metric(response.text, "pagedserve:engine_prefixes_reported"))
    assert complete(http, shared + [1, 2, 3]).status_code == 200
    wait_prefixes_known(http, reported, 8)
    for tail in range(6):
        assert complete(http, shared + [tail + 7, 3, 2, 1]).status_code == 200
    # Routing stats lag behind the engines: poll until the hits show (or the deadline says they never will).
    expected = 6 * 8 * BLOCK  # every follower hit the 8 shared blocks on the replica that holds them
    end = time.monotonic() + 60
    while True:
        after = metric_samples(wait_all_blocks_free(http), "pagedserve:engine_prefix_cache_hits")
        gained = sorted(after[k] - before.get(k, 0.0) for k in after)
        if gained[-1] >= expected or time.monotonic() > end:
            break
        time.sleep(0.3)
    # ... and no follower hit the shared blocks elsewhere (stats lag: the previous test's hits may still
    # trickle into the other replica's figures, so "none" is "less than one follower's worth").
    assert gained[-1] >= expected and gained[0] < 8 * BLOCK, gained
    affine: dict[str, float] = {}  # per ingress replica: each router counts its own decisions
    while len(affine) < 2:
        response = http.get("/metrics")
        decisions = metric_samples(response.text, "pagedserve:routing_decisions_total")
        affine[response.headers["x-pagedserve-ingress"]] = sum(
            value for labels, value in decisions.items() if "prefix_affine" in labels or "exact_hit" in labels)
    assert sum(affine.values()) >= 6


def settled_samples(http: httpx.Client, name: str, deadline_s: float = 60.0) -> dict[str, float]:
    """One metric's per-engine samples once every ingress replica's router reports the same figures.

    Each ingress's router refreshes the engines' stats on its own clock, so right after a test one ingress
    may still show an engine's figures from before that test's requests: a baseline read from such a stale
    view would credit the earlier test's prefix hits to this one.
    """
    end = time.monotonic() + deadline_s
    views: dict[str, dict[str, float]] = {}
    agreeing = 0
    while True:
        response = http.get("/metrics")
        samples = metric_samples(response.text, name)
        views[response.headers["x-pagedserve-ingress"]] = samples
        agreeing = agreeing + 1 if len(views) == 2 and all(v == samples for v in views.values()) else 0
        if agreeing >= 6:  # several reads over both ingresses and a few stats periods, all the same
            return samples
        assert time.monotonic() < end, f"ingress views of {name} never agreed: {views}"
        time.sleep(0.1)


def wait_prefixes_known(http: httpx.Client, before: dict[str, float], more: int, deadline_s: float = 60.0) -> None:
    """Until every ingress replica's router has the engines' newer routing stats (`more` new prefixes)."""
    known: set[str] = set()
    end = time.monotonic() + deadline_s
    while known != set(before):
        assert time.monotonic() < end, f"routing stats did not reach every ingress: {known} of {set(before)}"
        response = http.get("/metrics")
        ingress = response.headers["x-pagedserve-ingress"]
        if metric(response.text, "pagedserve:engine_prefixes_reported") >= before.get(ingress, 0) + more:
            known.add(ingress)
        time.sleep(0.1)


def test_client_disconnect_aborts_in_engine(http):
    """A client that goes away mid-stream aborts its request in the engine: generation stops long before
    max_tokens and every block comes back (checked by blocks_free_after). Read from the engines' own token
    counter, not a client timeout, so a machine fast enough to finish the request in a second still tests it."""
    import json

    max_tokens = 2048 - len(PROMPTS[3]) - 1
    generated_before = metric(wait_all_blocks_free(http), "pagedserve:generation_tokens_total")
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=TIMEOUT) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert "error" not in json.loads(line[len("data: "):])
                    break
    # The connection is closed: the engines stop generating for it. A view with the request's tokens counted
    # and nothing running is one taken after the request ended, so it holds every token it generated.
    end = time.monotonic() + 90.0
    generated = 0.0
    while generated <= 0 and time.monotonic() < end:
        generated = metric(wait_all_blocks_free(http), "pagedserve:generation_tokens_total") - generated_before
        time.sleep(0.2)
    assert 0 < generated < max_tokens, generated


# --------------------------------------------------------------------------- faults (these kill replicas)


def _replica_actors(kind: str, replica_id: str = "") -> list:
    """Handles of a deployment's replica actors (named `SERVE_REPLICA::<app>#<deployment>#<replica id>`)."""
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if f"#{APP}-{kind}#" in a["name"] and a["name"].endswith(replica_id)]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


def _load(http: httpx.Client, n: int, max_tokens: int, results: list) -> list[threading.Thread]:
    def one(i: int) -> None:
        try:
            response = complete(http, PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
            ok = response.headers.get("content-type", "").startswith("application/json")
            results.append((response.status_code, response.json() if ok else response.text))
        except httpx.HTTPError as exc:
            results.append((None, repr(exc)))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    return threads


def _wait_running(app: str, deployment: str, replicas: int, deadline_s: float = 180.0) -> None:
    from ray import serve

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        status = serve.status().applications[app].deployments[deployment]
        if status.replica_states.get("RUNNING", 0) == replicas and status.status == "HEALTHY":
            return
        time.sleep(0.5)
    raise AssertionError(f"{deployment}: not {replicas} running replicas: {serve.status().applications[app]}")


def _busy_engine(http: httpx.Client, deadline_s: float = 60.0) -> str:
    """The replica id of an engine that reports running requests."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        running = metric_samples(http.get("/metrics").text, "pagedserve:engine_num_requests_running")
        busy = [labels for labels, value in running.items() if value > 0]
        if busy:
            return re.search(r'engine_index="([^"]+)"', busy[0]).group(1)
        time.sleep(0.2)
    raise AssertionError("no engine replica reports running requests")


def test_engine_replica_killed_its_requests_finish_elsewhere(http):
    import ray

    results: list = []
    threads = _load(http, 8, 1000, results)
    victim_id = _busy_engine(http)
    [victim] = _replica_actors("engine", victim_id)
    ray.kill(victim, no_restart=True)
    for thread in threads:
        thread.join(TIMEOUT)
    # The killed replica's requests migrate to the survivor (cluster/serve/migration.py): none fails.
    assert len(results) == 8 and all(status == 200 for status, _ in results), results
    _wait_running(APP, f"{APP}-engine", 2)
    wait_all_blocks_free(http, replicas=2)
    assert complete(http, PROMPTS[0]).status_code == 200


def test_new_requests_right_after_an_engine_replica_dies_succeed(http):
    """The engine streams travel over Serve's gRPC transport, where a dead replica shows first as
    "unavailable" and Serve's router keeps it until its controller drops it: a request routed there meanwhile
    must go to the survivor (the client's migration and circuit breaker), streamed or not."""
    import ray

    _wait_running(APP, f"{APP}-engine", 2)
    [victim, *_] = _replica_actors("engine")
    ray.kill(victim, no_restart=True)
    for i in range(8):
        if i % 2:
            streamed_text(http, PROMPTS[i % len(PROMPTS)], max_tokens=3)  # 200, and no error event
        else:
            response = complete(http, PROMPTS[i % len(PROMPTS)], max_tokens=3)
            assert response.status_code == 200, response.text
    _wait_running(APP, f"{APP}-engine", 2)
    wait_all_blocks_free(http, replicas=2)


def test_ingress_replica_killed_other_keeps_serving(http):
    import ray

    victim = _replica_actors("ingress")[0]
    results: list = []
    threads = _load(http, 6, 100, results)
    time.sleep(1.0)
    ray.kill(victim, no_restart=True)
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(results) == 6 and any(r[0] == 200 for r in results)
    for _ in range(10):  # new requests are served (by the survivor, then by its replacement too)
        assert complete(http, PROMPTS[1], max_tokens=2).status_code == 200
    _wait_running(APP, f"{APP}-ingress", 2)


# --------------------------------------------------------------------------- TP inside an engine replica


def test_tp_ranks_live_in_the_replicas_placement_group(server, hf, tiny_model_factory):
    """An engine replica with TP = 2: its rank actors go into the replica's own placement group (bundle 0
    the replica, then one per rank), so no other placement group exists; output still equals HF's."""
    import ray
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from pagedserve.cluster.serve.app import build_app

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    args = ServeArgs(model=str(model), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                     served_model_name=MODEL, api_key=None, max_num_seqs=8, tensor_parallel_size=2,
                     num_cpus_per_engine=0.25, num_cpus_per_worker=0.25, app_name="tp", routing_stats_period_s=0.2)
    serve.run(build_app(args.to_dict()), name="tp", route_prefix="/tp", blocking=False)
    try:
        deadline = time.monotonic() + 240
        while serve.status().applications["tp"].status != "RUNNING":
            assert time.monotonic() < deadline and serve.status().applications["tp"].status != "DEPLOY_FAILED", \
                serve.status().applications["tp"]
            time.sleep(0.5)
        with httpx.Client(base_url=f"{server}/tp", timeout=TIMEOUT) as tp_http:
            response = complete(tp_http, PROMPTS[2], max_tokens=6)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == hf_text(hf, PROMPTS[2], 6)
            created = [pg for pg in placement_group_table().values() if pg["state"] == "CREATED"]
            assert len(created) == 1 and len(created[0]["bundles"]) == 3, created
            wait_all_blocks_free(tp_http, replicas=1)
    finally:
        serve.delete("tp")
    assert ray.is_initialized()
