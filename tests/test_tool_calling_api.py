"""Tool calling through the OpenAI API, in-process (tests/local_serving.py), with the official `openai` client.

- tool_choice "required" and named, over a real engine on a tiny random-weight model whose tokenizer carries
  a Hermes/Qwen-style (and a Llama 3-style) tool template: every call is schema-valid, greedy and sampled,
  streamed and not, n = 2, and a stream adds up to the non-streamed answer; every KV block is free after.
- tool_choice "auto", over a scripted engine that writes fixed model text (each parser's format, split
  into awkward pieces): calls parsed, streamed as OpenAI's deltas, malformed calls returned as text.
- A full tool loop (call -> tool message -> answer), the 400s naming the field, and `LLM.chat(tools=...)`.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.requests import ChatCompletionRequest
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.tokenizer import load_tokenizer
from tests.local_serving import LocalServer, OneIdleEngineClient
from tests.test_serving_errors import assert_openai_error
from tests.tool_fixtures import SCHEMAS, TEMPLATES, TOOLS, with_chat_template

TIMEOUT = 120.0
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_models(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    """A tiny llama (room for the tool prompts) per template style."""
    base = tiny_model_factory("llama", max_position_embeddings=2048)
    root = tmp_path_factory.mktemp("tool-models")
    return {style: str(with_chat_template(base, root / style, template)) for style, template in TEMPLATES.items()}


@pytest.fixture(scope="module")
def local(tool_models):
    with LocalServer(tool_models["hermes"], {"kv_cache_memory": "64MiB"}, max_n=4,
                     enable_auto_tool_choice=True, tool_call_parser="hermes") as server:
        yield server


def _client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0,
                         timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(local):
    with local.test_client() as http:
        yield _client(http)


def _collect_stream(stream) -> dict[int, dict]:
    """Per choice: content, the calls assembled from their deltas, the finish reason, and how the deltas came."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            entry = out.setdefault(choice.index, {"content": None, "calls": {}, "finish": None, "order_ok": True})
            delta = choice.delta
            if delta.content:
                entry["content"] = (entry["content"] or "") + delta.content
            for d in delta.tool_calls or []:
                call = entry["calls"].get(d.index)
                if call is None:  # the first delta of a call carries its id, type and name
                    entry["order_ok"] &= bool(d.id and d.type == "function" and d.function.name)
                    call = entry["calls"][d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    entry["order_ok"] &= d.id is None and d.function.name is None
                call["arguments"] += d.function.arguments or ""
            if choice.finish_reason:
                entry["finish"] = choice.finish_reason
    return {i: {**e, "calls": [e["calls"][k] for k in sorted(e["calls"])]} for i, e in out.items()}


def _answers(client, stream: bool, **kw) -> dict[int, dict]:
    if stream:
        return _collect_stream(client.chat.completions.create(stream=True, **kw))
    resp = client.chat.completions.create(**kw)
    return {c.index: {"content": c.message.content, "finish": c.finish_reason, "order_ok": True,
                      "calls": [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                                for t in c.message.tool_calls or []]}
            for c in resp.choices}


def _assert_valid_calls(answers: dict[int, dict], names: set[str], n: int) -> None:
    assert sorted(answers) == list(range(n))
    for answer in answers.values():
        assert answer["finish"] == "tool_calls", answer
        assert answer["content"] is None and answer["calls"] and answer["order_ok"], answer
        for call in answer["calls"]:
            assert call["name"] in names and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def _assert_idle(local: LocalServer) -> None:
    free, total = local.kv_blocks_when_idle()
    assert free == total


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_schema_valid(client, local, choice, stream):
    tool_choice = NAMED if choice == "named" else "required"
    names = {"get_weather"} if choice == "named" else set(SCHEMAS)
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        answers = _answers(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                           n=2, max_tokens=400, **sampling)
        _assert_valid_calls(answers, names, 2)
    _assert_idle(local)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}])
def test_stream_adds_up_to_the_whole_answer(client, local, parallel, sampling):
    """Streamed deltas add up byte for byte to the non-streamed answer: content, names, arguments, finish
    reason, for the single-call object and the parallel list form (seed 11 makes one choice write calls
    until max_tokens cuts the last one off: that one is content, in both)."""
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2, max_tokens=400,
              parallel_tool_calls=parallel, **sampling)
    whole, streamed = _answers(client, False, **kw), _answers(client, True, **kw)

    def strip(answer: dict) -> tuple:
        return (answer["content"], answer["finish"], [(c["name"], c["arguments"]) for c in answer["calls"]])

    assert sorted(whole) == sorted(streamed) == [0, 1]
    for i in range(2):
        assert strip(whole[i]) == strip(streamed[i]) and streamed[i]["order_ok"]
        assert whole[i]["calls"], whole[i]
        if not parallel:
            assert len(whole[i]["calls"]) == 1  # parallel_tool_calls=false: one call object
    _assert_idle(local)


def test_llama3_template_forced_call(tool_models):
    with LocalServer(tool_models["llama3_json"], {"kv_cache_memory": "64MiB"}, max_n=4) as server:
        with server.test_client() as http:
            client = _client(http)
            for stream in (False, True):
                answers = _answers(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS,
                                   tool_choice="required", n=2, max_tokens=400, temperature=1.0, seed=3)
                _assert_valid_calls(answers, set(SCHEMAS), 2)
        _assert_idle(server)


def test_full_tool_loop(client, local):
    """call -> tool result -> answer, with the openai client's own types carried back in the history."""
    messages: list = list(MESSAGES)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=400, temperature=0.0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) >= 1
    messages.append(message)
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"22 degrees {args['unit']}"})
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0.0)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    _assert_idle(local)


def test_history_renders_calls_and_results(tool_models):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]
    request = ChatCompletionRequest(messages=history, tools=TOOLS, tool_choice="none")
    for style, expected_call in (("hermes", '"arguments": {"city": "Paris", "unit": "celsius"}'),
                                 ("llama3_json", '"parameters": {"city": "Paris", "unit": "celsius"}')):
        tokenizer = load_tokenizer(tool_models[style])
        text = tokenizer.apply_chat_template(request.conversation(), tools=[t for t in TOOLS], tokenize=False,
                                             add_generation_prompt=True)
        assert expected_call in text and "22 degrees" in text and '"name": "add"' in text, text


def test_offline_chat_renders_tools_and_forces_a_call(tool_models, local):
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.engine.tool_parsers import forced_call_parser
    from pagedserve.engine.tool_parsers.tool_spec import FORCED_CALL_WHITESPACE, forced_call_schema, parse_tools

    served = asyncio.run(local.serving.encode_chat(MESSAGES, None, True, tools=TOOLS))
    llm = LLM(tool_models["hermes"], dtype="float32", kv_cache_memory="16MiB")
    try:
        assert llm.render_chat(MESSAGES, tools=TOOLS) == served
        schema = forced_call_schema(parse_tools(TOOLS), "add", parallel=False)
        params = SamplingParams(max_tokens=200, temperature=0.0,
                                structured_outputs={"json": schema, "whitespace_pattern": FORCED_CALL_WHITESPACE})
        text = llm.chat(MESSAGES, params, tools=TOOLS, use_tqdm=False)[0].outputs[0].text
        calls = forced_call_parser(parallel=False).extract(text).tool_calls
        assert [c.name for c in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["add"])
        with pytest.raises(ValueError, match=r"tools\[0\]\.function"):
            llm.chat(MESSAGES, params, tools=[{"type": "function"}], use_tqdm=False)
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------- auto, over scripted model text


class TextScript(OneIdleEngineClient):
    """The engine client's API over fixed model text, sent in the given pieces (one token id each)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.params: list[dict] = []

    async def generate(self, request_id, prompt_token_ids, sampling_params, priority=0, final_only=False,
                       cache_salt=None):
        from pagedserve.engine.outputs import CompletionOutput, RequestOutput

        self.params.append(sampling_params)
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            out = CompletionOutput(0, piece, [10 + k], None, None, "stop" if last else None)
            yield RequestOutput(request_id, None, list(prompt_token_ids), None, [out], last)


def _scripted_client(model: str, pieces: list[str], **overrides) -> tuple[openai.OpenAI, TextScript, TestClient]:
    script = TextScript(pieces)
    args = ServeArgs(model=model, served_model_name="tiny", api_key=None, **overrides)
    app = build_fastapi_app(OpenAIServing(script, load_tokenizer(model), args, max_model_len=2048))
    http = TestClient(app, raise_server_exceptions=False)
    return _client(http), script, http


def _split(text: str, points: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


HERMES_TEXT = ('Checking both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
               '</tool_call>')
AUTO_CASES = [
    ("hermes", HERMES_TEXT, "Checking both cities.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 9}}', None, [("add", {"a": 1, "b": 9})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 4, "b": 4}}]', "Sure.",
     [("add", {"a": 4, "b": 4})]),
    ("hermes", 'Hm <tool_call>\n{"name": "add" "arguments": {"a": 4}}\n</tool_call>',  # malformed: text
     'Hm <tool_call>\n{"name": "add" "arguments": {"a": 4}}\n</tool_call>', []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AUTO_CASES)
def test_auto_parses_the_model_text(tool_models, parser, text, content, calls):
    pieces = _split(text, [3, 9, 12, 15, 40, 41, 60, 75, 90])  # markers and JSON cut in the middle
    client, script, _ = _scripted_client(tool_models["hermes"], pieces, enable_auto_tool_choice=True,
                                         tool_call_parser=parser)
    whole = _answers(client, False, model="tiny", messages=MESSAGES, tools=TOOLS)[0]
    streamed = _answers(client, True, model="tiny", messages=MESSAGES, tools=TOOLS)[0]
    for answer in (whole, streamed):
        assert answer["content"] == content and answer["order_ok"]
        assert [(c["name"], json.loads(c["arguments"])) for c in answer["calls"]] == calls
        assert answer["finish"] == ("tool_calls" if calls else "stop")
    assert [c["arguments"] for c in whole["calls"]] == [c["arguments"] for c in streamed["calls"]]
    assert all(p["skip_special_tokens"] is (parser != "mistral") for p in script.params)


def test_tool_choice_none_returns_text(tool_models):
    client, _, _ = _scripted_client(tool_models["hermes"], _split(HERMES_TEXT, [20, 50]),
                                    enable_auto_tool_choice=True, tool_call_parser="hermes")
    for stream in (False, True):
        answer = _answers(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none")[0]
        assert answer["content"] == HERMES_TEXT and answer["calls"] == [] and answer["finish"] == "stop"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # auto is the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice",
         "'mul' is not among"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "none"}, "tools", "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "none"}, "tools",
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools",
         "a function name is"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "only one output constraint"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages",
         "arguments"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tool_models, body, param, message):
    _, script, http = _scripted_client(tool_models["hermes"], ["x"])
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    error = assert_openai_error(response, 400, param)
    assert message in error["message"], error
    assert script.params == []  # nothing reached the engine


def test_serve_args_tool_flags():
    with pytest.raises(ValueError, match="enable_auto_tool_choice: needs tool_call_parser"):
        ServeArgs(model=None, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'xml'"):
        ServeArgs(model=None, enable_auto_tool_choice=True, tool_call_parser="xml")
    # Accepted as vLLM accepts it, with a warning: without enable_auto_tool_choice the parser is unused.
    assert ServeArgs(model=None, tool_call_parser="hermes").tool_call_parser == "hermes"


def test_cli_tool_flags_reach_serve_args(tool_models):
    from pagedserve.cluster.cli import build_parser, serve_args_from

    ns = build_parser().parse_args(["serve", tool_models["hermes"], "--enable-auto-tool-choice",
                                    "--tool-call-parser", "mistral"])
    args = serve_args_from(ns)
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "mistral"
    plain = serve_args_from(build_parser().parse_args(["serve", tool_models["hermes"]]))
    assert plain.enable_auto_tool_choice is False and plain.tool_call_parser is None
    with pytest.raises(SystemExit):  # argparse refuses a parser it does not know
        build_parser().parse_args(["serve", tool_models["hermes"], "--tool-call-parser", "xml"])


def test_models_list_tool_capabilities(local, tool_models):
    """/v1/models: tools (required, named, none) on every server; auto tool choice only where it was enabled."""
    with local.test_client() as http:
        card = http.get("/v1/models").json()["data"][0]
    assert {"chat", "tools", "auto_tool_choice"} <= set(card["capabilities"])
    _, _, plain = _scripted_client(tool_models["hermes"], ["x"])
    capabilities = plain.get("/v1/models").json()["data"][0]["capabilities"]
    assert "tools" in capabilities and "auto_tool_choice" not in capabilities
