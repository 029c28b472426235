"""The load generator of `bench serve` and `tune`: streamed /v1/completions requests against a live
OpenAI-compatible endpoint, arriving as a Poisson process (or all at once), timed from SSE chunk arrival.
The streams are read with aiohttp (as vLLM's serving benchmark does): the client shares the server's cores
when both run on one machine, and httpx spent about 2.5x its CPU per SSE event.

TTFT is the time to the first chunk with a choice; ITL the gaps between such chunks; TPOT
(e2e - TTFT) / (output tokens - 1); e2e the whole request. Prompts are token ids drawn from the
server's own tokenization of a text (so every id is in the vocabulary), with `ignore_eos` so output
lengths are exact.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import numpy as np
from tqdm.auto import tqdm

from pagedserve.bench.slo import RequestLatency
from pagedserve.bench.workload import BenchRequest

SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed-size "
    "blocks; prefix caching reuses them across requests. def fibonacci(n): return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2). import os, sys; class Engine: def step(self): pass. "
)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() of each streamed token event

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.ok and self.output_tokens > 1 else None

    def latency(self) -> RequestLatency:
        if not self.ok:
            return RequestLatency(ok=False)
        return RequestLatency(ok=True, ttft=self.ttft, tpot=self.tpot, max_itl=max(self.itls, default=None),
                              e2e=self.e2e)


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration_s: float


@dataclass(frozen=True)
class ServerInfo:
    model: str
    token_ids: list[int]
    max_model_len: int


def server_info(base_url: str, headers: dict[str, str], timeout: float) -> ServerInfo:
    """The served model's name, ordinary token ids (from /tokenize of a text) and max_model_len."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
        try:
            card = client.get("/v1/models").raise_for_status().json()["data"][0]
            tokens = client.post("/tokenize", json={"prompt": SEED_TEXT, "add_special_tokens": False})
            ids = sorted(set(tokens.raise_for_status().json()["tokens"]))
        except httpx.HTTPError as exc:
            raise ValueError(f"--base-url: {base_url} does not answer as a pagedserve server: {exc!r}") from None
    return ServerInfo(card["id"], ids, int(card.get("max_model_len") or 0))


async def one_request(session: aiohttp.ClientSession, model: str, request: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_tokens=len(request.prompt_token_ids))
    start = time.perf_counter()
    last = None
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", "error"))
                    return result
                now = time.perf_counter()
                if event.get("choices"):
                    result.token_times.append(now)
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: not JSON
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "the stream ended without a token"
    return result


async def _run_load(base_url: str, model: str, workload: list[BenchRequest], rate: float,
                    max_concurrency: int | None, seed: int, headers: dict[str, str], timeout: float,
                    desc: str) -> LoadRun:
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc=desc, leave=False, dynamic_ncols=True)

    async def guarded(session: aiohttp.ClientSession, request: BenchRequest) -> RequestResult:
        try:
            if sem is None:
                return await one_request(session, model, request)
            async with sem:
                return await one_request(session, model, request)
        finally:
            bar.update(1)

    try:
        async with aiohttp.ClientSession(base_url=base_url, headers=headers, connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout,
                                                                       sock_read=timeout)) as session:
            tasks = []
            start = time.perf_counter()
            for request in workload:
                tasks.append(asyncio.create_task(guarded(session, request)))
                if math.isfinite(rate):
                    await asyncio.sleep(float(rng.exponential(1.0 / rate)))
            results = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - start
    finally:
        bar.close()
    return LoadRun(results, duration)


def run_load(base_url: str, model: str, workload: list[BenchRequest], rate: float, max_concurrency: int | None,
             seed: int, headers: dict[str, str], timeout: float, desc: str = "requests") -> LoadRun:
    """Send the workload at `rate` requests/s (Poisson; inf: all at once), at most `max_concurrency`
    in flight; a request fails when its connection or its stream is silent for `timeout` seconds."""
    return asyncio.run(_run_load(base_url, model, workload, rate, max_concurrency, seed, headers, timeout, desc))


def warm_up(base_url: str, model: str, workload: list[BenchRequest], num: int, seed: int, headers: dict[str, str],
            timeout: float) -> None:
    """Send `num` warm-up requests, all at once, and wait for them (counted nowhere): the first ones of the
    workload at their own lengths, their prompts reversed so that they leave the timed requests no prefix-cache
    hits. A fresh server's first requests pay one-off costs (connections, thread pools, first shapes) that
    `bench throughput` keeps out of its timed run the same way; a failed warm-up request is reported, and the
    timed runs show whether the server works."""
    n = min(num, len(workload))
    if n == 0:
        return
    warm = [BenchRequest(r.prompt_token_ids[::-1], r.output_len) for r in workload[:n]]
    load = run_load(base_url, model, warm, math.inf, None, seed, headers, timeout, desc="warm-up")
    failed = [r for r in load.results if not r.ok]
    if failed:
        print(f"warm-up: {len(failed)} of {n} requests failed (first: {failed[0].error})", file=sys.stderr, flush=True)
