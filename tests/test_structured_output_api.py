"""Structured output through the OpenAI API, in-process over a real engine on the bundled default
model: response_format (json_object, json_schema) and vLLM's guided_* fields, streamed and not, with
the official `openai` client; bad specs are 400s naming the field; every KV block is free afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.local_serving import LocalServer
from tests.test_serving_errors import assert_openai_error

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default-model"
TIMEOUT = 60.0
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def local():
    with LocalServer(str(DEFAULT_MODEL), {"kv_cache_memory": "64MiB", "block_size": 16}, max_n=4) as server:
        yield server


@pytest.fixture(scope="module")
def http(local):
    with local.test_client() as c:
        yield c


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0,
                         timeout=TIMEOUT)


def assert_idle(local: LocalServer) -> None:
    free, total = local.kv_blocks_when_idle()
    assert free == total


def _stream_text(stream, n: int) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {i: "" for i in range(n)}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            texts[choice.index] += (delta.content or "") if delta is not None else (choice.text or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_is_valid(client, local, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=64, n=3, temperature=0.8, seed=5)
    if stream:
        texts, reasons = _stream_text(client.chat.completions.create(stream=True, **kw), 3)
    else:
        resp = client.chat.completions.create(**kw)
        texts = {c.index: c.message.content for c in resp.choices}
        reasons = {c.index: c.finish_reason for c in resp.choices}
    assert len(texts) == 3
    stopped = [texts[i] for i in texts if reasons[i] == "stop"]
    assert len(stopped) >= 2, (texts, reasons)
    for text in stopped:
        jsonschema.validate(json.loads(text), PERSON)
    assert_idle(local)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_guided_fields_on_completions(client, local, stream):
    cases = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_regex": r"\d{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[A-Z]{2}", t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[a-z]{4}"}}, lambda t: re.fullmatch("[a-z]{4}", t)),
    ]
    results = []
    for extra, check in cases:
        kw = dict(model="tiny", prompt="The answer is", max_tokens=64, temperature=0, extra_body=extra)
        if stream:
            texts, reasons = _stream_text(client.completions.create(stream=True, **kw), 1)
            text, reason = texts[0], reasons[0]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, reason = choice.text, choice.finish_reason
        results.append((extra, reason, text))
        if reason == "stop":
            assert check(text), (extra, text)
        else:  # cut by max_tokens: only open-ended JSON may run that long
            assert reason == "length" and ("guided_json" in extra or "response_format" in extra), results
    assert sum(r[1] == "stop" for r in results) >= 5, results
    assert_idle(local)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}],
                                  "tool_choice": "none"}, "tools"),
    ],
)
def test_bad_specs_are_400s_naming_the_field(http, local, path, body, param):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    assert_openai_error(http.post(path, json={**base, "max_tokens": 4, **body}), 400, param)
    assert_idle(local)
