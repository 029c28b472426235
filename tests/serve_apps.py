"""A live Serve app of N engine replicas on loopback, for the Serve tests, and what they do to its replicas.

- `serve_app(model, app_name=..., **args)`: a local Ray instance and the app (`start_server`) with the
  tests' small defaults (tiny KV cache, block 4, 0.5 CPU per engine, routing stats every 0.2 s); yields
  its `ServeArgs` (the URL is `server_url(args)`); Serve and Ray stop on exit, whatever the test did.
- `engine_replicas(app)`: the engine replicas' actors, `wait_engines_running(app, n)`.
- `on_engine(actor, fn, *args)`: runs `fn(host, *args)` in an engine replica's process on its
  `EngineHost` (Ray's `__ray_call__`): the real engine, reached as an operator's debugger would, to put
  a fault into it (a full queue, a failing step) or take it out again.
- `deploy_config(args, deployments)`: the app from a Serve config, as `serve deploy` sends it; again with
  changed deployment overrides, an in-place update (say a scale-down of the engines).
- `run(http, body)`: one /v1/completions request, streamed or not, as {status, choices, errors, usage};
  `assert_same(got, want)`: the same text, tokens, logprobs and usage as a reference run.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from pagedserve.cluster.settings import ServeArgs

MODEL = "tiny"
DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "kv_cache_memory": "8MiB", "block_size": 4, "served_model_name": MODEL, "api_key": None,
    "max_num_seqs": 16, "num_cpus_per_engine": 0.5, "routing_stats_period_s": 0.2,
}


@contextmanager
def serve_app(model: str, num_cpus: int = 4, declarative: bool = False, **args: Any) -> Iterator[ServeArgs]:
    """A local Ray instance and the Serve app of `args` (over `DEFAULTS`), up and answering: started as
    `pagedserve serve` starts it, or (`declarative`) deployed from a Serve config (`deploy_config`)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import start_server

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        served = ServeArgs(model=str(model), port=free_port(), **{**DEFAULTS, **args})
        if declarative:
            serve.start(http_options={"host": served.host, "port": served.port})
            deploy_config(served)
            wait_app_running(served.app_name)
        else:
            start_server(served)
        yield served
    finally:
        serve.shutdown()
        ray.shutdown()


def engine_replicas(app: str) -> list[tuple[str, Any]]:
    """(actor name, actor handle) of the live engine replicas of `app` (the replica id ends the name)."""
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{app}-engine#" in a["name"]]
    return [(a["name"], ray.get_actor(a["name"], namespace=a["namespace"])) for a in names]


def replica_id(actor_name: str) -> str:
    """The replica id (as /metrics labels it) in a replica actor's name."""
    return actor_name.rsplit("#", 1)[-1]


def wait_engines_running(app: str, replicas: int, deadline_s: float = 180.0) -> None:
    from ray import serve

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        status = serve.status().applications[app].deployments[f"{app}-engine"]
        if status.replica_states.get("RUNNING", 0) == replicas and status.status == "HEALTHY" \
                and len(engine_replicas(app)) == replicas:
            return
        time.sleep(0.5)
    raise AssertionError(f"not {replicas} running engine replicas: {serve.status().applications[app]}")


def _call_on_host(replica_actor: Any, fn: Callable[..., Any], *args: Any) -> Any:
    host = replica_actor._replica_impl._user_callable_wrapper.user_callable
    return fn(host, *args)


def on_engine(actor: Any, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> Any:
    """`fn(host, *args)` run in the engine replica `actor` on its `EngineHost`; its return value."""
    import ray

    return ray.get(actor.__ray_call__.remote(_call_on_host, fn, *args), timeout=timeout_s)


def deploy_config(args: ServeArgs, deployments: list[dict] | None = None, **config: Any) -> None:
    """Deploy `args`'s app from a Serve config, as `serve deploy` does (the controller's `apply_config`):
    the app builder, its args and per-deployment overrides. Deployed again with only `deployments`
    changed (say the engine's `num_replicas`), Serve updates that deployment in place (a scale-down
    drains the removed replicas) and leaves the others running. `config`: more top-level keys of the
    config (`proxy_location`)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = {
        **config,
        "http_options": {"host": args.host, "port": args.port},
        "applications": [{"name": args.app_name, "route_prefix": "/",
                          "import_path": "pagedserve.cluster.serve.app:build_app", "args": args.to_dict(),
                          "deployments": deployments or []}],
    }
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def wait_app_running(app: str, timeout_s: float = 300.0) -> None:
    from ray import serve

    end = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"app {app} failed to deploy: {status.message}")
        if time.monotonic() > end:
            raise TimeoutError(f"app {app} not RUNNING after {timeout_s:.0f}s: {status}")
        time.sleep(0.5)


def run(http: httpx.Client, body: dict, progress: threading.Event | None = None) -> dict:
    """One /v1/completions request, streamed or not: {"status", "choices": {index: {text, tokens,
    logprobs, finish_reason}}, "completion_tokens", "errors"}. `progress` is set once a streamed
    request has received a few chunks with text."""
    body = {"model": MODEL, "logprobs": 1, **body}
    choices: dict[int, dict] = {}

    def add(choice: dict) -> None:
        got = choices.setdefault(choice["index"], {"text": "", "tokens": [], "logprobs": [], "finish_reason": None})
        got["text"] += choice["text"]
        if choice.get("logprobs"):
            got["tokens"] += choice["logprobs"]["tokens"]
            got["logprobs"] += choice["logprobs"]["token_logprobs"]
        got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]

    if not body.get("stream"):
        response = http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return {"status": response.status_code, "errors": [response.text], "choices": {}}
        answer = response.json()
        for choice in answer["choices"]:
            add(choice)
        return {"status": 200, "choices": choices, "errors": [], "completion_tokens": answer["usage"]["completion_tokens"]}
    errors: list = []
    usage = None
    chunks = 0
    with http.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "errors": [response.read().decode()], "choices": {}}
        for line in sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event)
                continue
            for choice in event.get("choices", []):
                add(choice)
            usage = event.get("usage") or usage
            chunks += 1
            if progress is not None and chunks >= 3:
                progress.set()
    return {"status": 200, "choices": choices, "errors": errors,
            "completion_tokens": usage["completion_tokens"] if usage else None}


def run_in_background(http: httpx.Client, bodies: list[dict], timeout_s: float
                      ) -> tuple[list[threading.Thread], dict[int, dict]]:
    """Start one `run` per body in a thread and return (the threads, their results by index, filled as
    they finish; an exception becomes a result with status None), once every streamed request has made
    progress: the requests are then in their engines, mid-generation."""
    results: dict[int, dict] = {}
    progress = [threading.Event() for _ in bodies]

    def one(index: int) -> None:
        try:
            results[index] = run(http, bodies[index], progress[index])
        except Exception as exc:  # noqa: BLE001 - reported by the caller's assertions
            results[index] = {"status": None, "errors": [repr(exc)], "choices": {}}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for index, body in enumerate(bodies):
        if body.get("stream"):
            assert progress[index].wait(timeout_s), f"request {index}: no progress"
    return threads, results


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The lines of an event stream, split where SSE splits them: at "\n" only (httpx's `iter_lines` also
    splits at U+2028, U+0085 and the like, which a JSON string may carry unescaped in a random model's text)."""
    pending = b""
    for chunk in response.iter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")
    if pending:
        yield pending.decode().rstrip("\r")


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["status"] == 200 and not got["errors"], (what, got)
    assert got["choices"].keys() == want["choices"].keys(), what
    for index, w in want["choices"].items():
        g = got["choices"][index]
        assert g["text"] == w["text"], (what, index)
        assert g["tokens"] == w["tokens"], (what, index)
        assert g["finish_reason"] == w["finish_reason"], (what, index)
        assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3) for a, b in zip(g["logprobs"], w["logprobs"]))
    assert got["completion_tokens"] == want["completion_tokens"], what
