"""The load generator's reading of a server's SSE streams (bench/loadgen.py): token timing, usage, and
every way a request can fail, against a small aiohttp server on loopback (no engine)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from pagedserve.bench.loadgen import run_load
from pagedserve.bench.workload import BenchRequest


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(text: str) -> bytes:
    return _event({"id": "cmpl-1", "object": "text_completion",
                   "choices": [{"index": 0, "text": text, "finish_reason": None}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Authorization") not in (None, "Bearer sk-test"):
        return web.json_response({"error": {"message": "bad key"}}, status=401)
    body = await request.json()
    behaviour = body["prompt"][0]
    if behaviour == 400:
        return web.json_response({"error": {"message": "max_tokens: too large", "type": "invalid_request_error"}},
                                 status=400)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if behaviour == 1:  # an ordinary stream: max_tokens chunks, usage, [DONE]
        for i in range(body["max_tokens"]):
            await response.write(_chunk(f" t{i}"))
            await asyncio.sleep(0.005)
        await response.write(_event({"id": "cmpl-1", "choices": [], "usage": {
            "prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}))
    elif behaviour == 2:  # one chunk, then an error event mid-stream
        await response.write(_chunk(" a"))
        await response.write(_event({"error": {"message": "engine died", "code": 500}}))
    elif behaviour == 3:  # a stream with no token at all
        pass
    elif behaviour == 4:  # one chunk longer than a 64 KiB read buffer
        await response.write(_chunk("x" * 200_000))
        await response.write(_event({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 1}}))
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def _run(url: str, requests: list[BenchRequest]):
    return run_load(url, "m", requests, math.inf, None, 0, {}, 30.0)


def test_an_ordinary_stream_is_timed_token_by_token(server_url):
    (result,) = _run(server_url, [BenchRequest([1, 7, 7], 5)]).results
    assert result.ok and result.error == ""
    assert result.output_tokens == 5 and result.prompt_tokens == 3
    assert len(result.token_times) == 5 and len(result.itls) == 4
    assert 0 < result.ttft <= result.e2e
    assert result.tpot is not None and result.tpot > 0


def test_many_streams_at_once(server_url):
    run = _run(server_url, [BenchRequest([1], 3 + i % 4) for i in range(24)])
    assert all(r.ok for r in run.results)
    assert [r.output_tokens for r in run.results] == [3 + i % 4 for i in range(24)]
    assert run.duration_s > 0


def test_failures_are_reported_per_request_and_do_not_stop_the_others(server_url):
    bad_status, error_event, no_token, fine = _run(
        server_url, [BenchRequest([400], 3), BenchRequest([2], 3), BenchRequest([3], 3), BenchRequest([1], 2)]).results
    assert not bad_status.ok and bad_status.error.startswith("HTTP 400") and "max_tokens" in bad_status.error
    assert not error_event.ok and error_event.error == "engine died"
    assert not no_token.ok and no_token.error == "the stream ended without a token"
    assert fine.ok and fine.output_tokens == 2


def test_a_chunk_longer_than_a_read_buffer(server_url):
    (result,) = _run(server_url, [BenchRequest([4], 1)]).results
    assert result.ok and result.output_tokens == 1


def test_an_unreachable_server_fails_each_request():
    (result,) = run_load("http://127.0.0.1:9", "m", [BenchRequest([1], 2)], math.inf, None, 0, {}, 5.0).results
    assert not result.ok and result.error


def test_the_caller_s_headers_go_with_every_request(server_url):
    requests = [BenchRequest([1], 2)]
    (good,) = run_load(server_url, "m", requests, math.inf, None, 0, {"Authorization": "Bearer sk-test"}, 30.0).results
    (bad,) = run_load(server_url, "m", requests, math.inf, None, 0, {"Authorization": "Bearer wrong"}, 30.0).results
    assert good.ok and good.output_tokens == 2
    assert not bad.ok and bad.error.startswith("HTTP 401")


def test_a_poisson_rate_with_a_concurrency_cap(server_url):
    run = run_load(server_url, "m", [BenchRequest([1], 2) for _ in range(6)], 200.0, 2, 0, {}, 30.0)
    assert all(r.ok and r.output_tokens == 2 for r in run.results)
