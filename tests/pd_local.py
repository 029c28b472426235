"""Helpers for the prefill/decode tests: the PD app in-process (engine actors not wrapped by Ray, the
in-process KV transport), comparing HTTP answers, and reading the PD figures from /metrics."""

from __future__ import annotations

import gc
import json
import re
import time
from typing import Any

from starlette.testclient import TestClient

from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.tokenizer import load_tokenizer
from tests.local_serving import LocalHandle

MODEL_NAME = "tiny"
VOLATILE = {"id", "created", "system_fingerprint"}


def wait_engines_idle(engines: list[EngineHost], timeout_s: float = 30.0) -> list[tuple[int, int, int]]:
    """(free, total, held) per engine host once every block is free and no hold is left (or the deadline passed)."""
    gc.collect()
    deadline = time.monotonic() + timeout_s
    while True:
        figures = []
        for engine in engines:
            stats = engine.engine.get_stats().scheduler
            figures.append((stats.num_free_blocks, stats.num_total_blocks,
                            int((stats.kv_transfer or {}).get("held_requests", 0))))
        if all(free == total and held == 0 for free, total, held in figures) or time.monotonic() > deadline:
            return figures
        time.sleep(0.05)


class LocalPD:
    """A prefill engine and a decode engine in this process behind the real PD client and HTTP app."""

    def __init__(self, model: str, engine_kwargs: dict | None = None, hold_timeout_s: float = 120.0,
                 prefill_kwargs: dict | None = None, decode_kwargs: dict | None = None) -> None:
        base = {"model": model, "dtype": "float32", "kv_cache_memory": "16MiB", "block_size": 4, **(engine_kwargs or {})}
        extra = {"hold_timeout_s": hold_timeout_s}
        self.prefill = EngineHost({**base, **(prefill_kwargs or {}), "kv_transfer_config": {
            "kv_connector": "inproc", "kv_role": "kv_producer", "engine_id": "prefill-0",
            "kv_connector_extra_config": extra}}, 0, max_pending_requests=64)
        self.decode = EngineHost({**base, **(decode_kwargs or {}), "kv_transfer_config": {
            "kv_connector": "inproc", "kv_role": "kv_consumer", "kv_connector_extra_config": extra}},
            1, max_pending_requests=64)
        self.prefill_handle = LocalHandle(self.prefill)
        self.decode_handle = LocalHandle(self.decode)
        self.client = PDClient.over_actors([self.prefill_handle], [self.decode_handle], ["prefill-0"],
                               prefill_block_size=self.prefill.engine.config.block_size,
                               decode_block_size=self.decode.engine.config.block_size, stats_interval_s=0.05)
        self.client.start()
        self.args = ServeArgs(model=model, served_model_name=MODEL_NAME, api_key=None)
        max_model_len = self.decode.engine.config.max_model_len
        self.serving = OpenAIServing(self.client, load_tokenizer(model), self.args, max_model_len)
        self.app = build_fastapi_app(self.serving)

    def engines(self) -> list[EngineHost]:
        return [self.prefill, self.decode]

    def kv_stats(self, engine: EngineHost) -> dict:
        return dict(engine.engine.get_stats().scheduler.kv_transfer)

    def wait_idle(self, timeout_s: float = 30.0) -> list[tuple[int, int, int]]:
        """(free, total, held) per engine once every block of both is free and nothing is held."""
        return wait_engines_idle(self.engines(), timeout_s)

    def close(self) -> None:
        for engine in self.engines():
            engine.shutdown()

    def test_client(self) -> TestClient:
        return TestClient(self.app, raise_server_exceptions=False)


def normalized(body: Any) -> Any:
    """A response body without the fields that differ between any two answers (ids, timestamps)."""
    if isinstance(body, dict):
        return {k: normalized(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [normalized(v) for v in body]
    return body


def same_answer(left: Any, right: Any, path: str = "", tol: float = 1e-4) -> list[str]:
    """Where two answers differ: exact for everything but floats (logprobs), which may differ in
    their last bits when a prompt's KV was computed in other chunks (as under chunked prefill)."""
    if isinstance(left, float) and isinstance(right, float):
        return [] if abs(left - right) <= tol else [f"{path}: {left!r} != {right!r}"]
    if type(left) is not type(right):
        return [f"{path}: {left!r} != {right!r}"]
    if isinstance(left, dict):
        diffs = [f"{path}.{k}: only on one side" for k in set(left) ^ set(right)]
        for key in sorted(set(left) & set(right), key=str):
            diffs += same_answer(left[key], right[key], f"{path}.{key}", tol)
        return diffs
    if isinstance(left, list):
        if len(left) != len(right):
            return [f"{path}: {len(left)} items != {len(right)}"]
        return [d for i, (a, b) in enumerate(zip(left, right)) for d in same_answer(a, b, f"{path}[{i}]", tol)]
    return [] if left == right else [f"{path}: {left!r} != {right!r}"]


def sse_summary(client: TestClient, path: str, body: dict) -> dict:
    """A streamed answer reduced to what must not depend on chunking: per choice its text (or
    content), finish reason and logprob tokens; the usage chunk; any error event."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "errors": []}
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                entry = out["choices"].setdefault(choice["index"], {"text": "", "finish_reason": None, "tokens": []})
                entry["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                entry["finish_reason"] = choice.get("finish_reason") or entry["finish_reason"]
                logprobs = choice.get("logprobs") or {}
                entry["tokens"] += logprobs.get("tokens") or [c["token"] for c in logprobs.get("content") or []]
    return out


def metric_samples(text: str, name: str) -> dict[str, float]:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


def metric(text: str, name: str) -> float:
    return sum(metric_samples(text, name).values())
