"""`pagedserve serve --stream-interval 4` (and `auto`) end to end (Ray Serve on loopback, one tiny engine): a streamed
completion arrives in at most one SSE event per 4 generated tokens (the first token alone), and its
events add up to exactly what the same request gives unstreamed (text, tokens, logprobs, finish reason,
usage), which is what interval 1 streams (tests/test_stream_interval.py compares the two intervals on
one engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve_apps import MODEL, serve_app, sse_lines

pytestmark = pytest.mark.timeout(600)

INTERVAL = 4


def _streamed(http: httpx.Client, body: dict) -> tuple[int, dict[int, dict], int]:
    """(events with a choice, the choices joined, completion tokens from the usage event)."""
    choices: dict[int, dict] = {}
    events, usage = 0, None
    with http.stream("POST", "/v1/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for line in sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                events += 1
                got = choices.setdefault(choice["index"], {"text": "", "tokens": [], "logprobs": [], "finish": []})
                got["text"] += choice["text"]
                got["tokens"] += choice["logprobs"]["tokens"]
                got["logprobs"] += choice["logprobs"]["token_logprobs"]
                if choice["finish_reason"] is not None:
                    got["finish"].append(choice["finish_reason"])
    return events, choices, usage["completion_tokens"]


@pytest.mark.parametrize("interval", [INTERVAL, "auto"])
def test_a_stream_interval_sends_fewer_events_that_add_up_to_the_same_completion(tiny_llama, interval):
    """With "auto" and one request streaming, the interval is 1: an event per token (fewer only if the
    reader falls behind), the same completion."""
    from pagedserve.cluster.serve.app import server_url

    with serve_app(str(tiny_llama), num_cpus=2, stream_interval=interval) as args:
        with httpx.Client(base_url=server_url(args), timeout=120) as http:
            for n, params in ((1, {"temperature": 0}), (2, {"temperature": 0.8, "seed": 11})):
                body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 13, "ignore_eos": True,
                        "logprobs": 1, "n": n, **params}
                whole = http.post("/v1/completions", json=body)
                assert whole.status_code == 200, whole.text
                answer = whole.json()
                events, streamed, completion_tokens = _streamed(http, body)
                assert completion_tokens == answer["usage"]["completion_tokens"] == 13 * n
                for choice in answer["choices"]:
                    got = streamed[choice["index"]]
                    assert got["text"] == choice["text"]
                    assert got["tokens"] == choice["logprobs"]["tokens"]
                    assert got["logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
                    assert got["finish"] == [choice["finish_reason"]] == ["length"]
                # Interval 1 sends an event per token (13 per choice); interval 4: each choice's first token
                # alone, then one event per 4 tokens, the finish with the last of them.
                if interval == "auto":
                    assert events <= 13 * n
                else:
                    assert events <= n * (1 + -(-12 // interval)) < 13 * n
