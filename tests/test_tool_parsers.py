"""Tool-call parsers (`engine/tool_parsers`) on text in each model family's real format: calls with text
before, between and after them, malformed calls returned as text, and every output streamed in arbitrary
chunks (markers and JSON split anywhere) adding up to exactly the whole-output parse. Plus the tool
definitions' checks and the forced-call schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.tool_parsers import TOOL_PARSERS, collect_deltas, forced_call_parser, get_tool_parser
from pagedserve.engine.tool_parsers.tool_spec import (
    check_tool_schemas,
    forced_call_schema,
    messages_for_template,
    named_choice,
    parse_tools,
    tools_for_template,
)
from tests.tool_fixtures import TOOLS

# (parser, model text, expected content, expected [(name, arguments as an object)])
CASES = [
    # Qwen 2.5 / Hermes 2 Pro: one call per block, newlines around the JSON.
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
               '\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    ("hermes", 'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Tokyo", "unit": "celsius"}}\n</tool_call>',
     "I will look both up.", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                              ("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a <b> \\"c\\" \\u00e9 } ]"}, "name": "search"}\n</tool_call>\n'
               'Searching now.',
     "Searching now.", [("search", {"q": 'a <b> "c" \u00e9 } ]'})]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),  # stopped before the end tag
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})]),  # no arguments: {}
    ("hermes", "The answer is 42. Use a <tool> or <tool_call and more.", "The answer is 42. Use a <tool> or "
                                                                         "<tool_call and more.", []),
    ("hermes", '<tool_call>\n{"name": get_weather}\n</tool_call> done',
     '<tool_call>\n{"name": get_weather}\n</tool_call> done', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', '<tool_call>\n{"name": "f", "arguments": {"a": 1}',
     []),  # cut off
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": 3, "arguments": {}}\n'
                                                                         '</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>', []),  # arguments must be an object
    # Llama 3.1 / 3.2 JSON tool calling.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima", "unit": "fahrenheit"}}', None,
     [("get_weather", {"city": "Lima", "unit": "fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": -2.5e-3}}; '
                    '{"name": "add", "parameters": {"a": [true, false, null], "b": {"c": {}}}}', None,
     [("add", {"a": 1, "b": -2.5e-3}), ("add", {"a": [True, False, None], "b": {"c": {}}})]),
    ("llama3_json", '  {"name": "f", "parameters": {}} That is all.', "That is all.", [("f", {})]),
    ("llama3_json", 'Hello {"name": "f", "parameters": {}}', 'Hello {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42, "why": "json, not a call"}', '{"answer": 42, "why": "json, not a call"}', []),
    # Mistral 7B v0.3 / Nemo: [TOOL_CALLS] then a JSON array.
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "now", "arguments": {}}]', "Let me check.", [("now", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}, oops]', "oops]", [("now", {})]),
    ("mistral", '[TOOL_CALLS]nothing here', "[TOOL_CALLS]nothing here", []),
]


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _stream(parser, pieces: list[str], eager: bool = True):
    stream = parser.stream(eager=eager)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return deltas, collect_deltas(deltas)


def _same(a, b) -> bool:
    return a.content == b.content and [(c.name, c.arguments) for c in a.tool_calls] == \
        [(c.name, c.arguments) for c in b.tool_calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser, text, content, calls):
    parsed = get_tool_parser(parser).extract(text)
    assert parsed.content == content
    assert _calls(parsed) == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


# Streamed, a call's header goes out before the call is complete: this one, cut off after its header,
# stays a call when streamed (test_a_call_that_breaks_after_its_header_ends_there_when_streamed).
CUT_OFF = '<tool_call>\n{"name": "f", "arguments": {"a": 1}'


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_every_two_and_three_chunk_split_adds_up_to_the_whole(parser, text, content, calls):
    p = get_tool_parser(parser)
    whole = p.extract(text)
    streamed_whole = _stream(p, [text])[1] if text == CUT_OFF else whole
    n = len(text)
    for i in range(1, n):
        for j in (i + 1, (i + n) // 2, n - 1):
            if i < j < n:
                for eager, expected in ((True, streamed_whole), (False, whole)):
                    _, got = _stream(p, [text[:i], text[i:j], text[j:]], eager)
                    assert _same(got, expected), (text[:i], text[i:j], text[j:], got, expected)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_random_chunking_adds_up_to_the_whole(case, cuts):
    parser, text = case[0], case[1]
    if text == CUT_OFF:
        return
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert _same(_stream(get_tool_parser(parser), pieces)[1], get_tool_parser(parser).extract(text))


# Pieces of model output that stress the parsers: whole calls in each format (so that cuts land inside
# markers and JSON that matter), every marker alone and a prefix of one, JSON punctuation, escapes, text.
FRAGMENTS = ['<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "x\\"}"}]}}\n</tool_call>',
             '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"c": null}}]',
             '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
             '{"name": "f", "arguments": {"a": -2.5e3}}', '[{"name": "f", "arguments": {}}]',
             "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<tool", "[TOOL", "{", "}", "[", "]",
             ",", ";", ":", '"', "\\", '"name"', '"arguments"', "true", " ", "\n", "x", "\u00e9"]
ALL_PARSERS = [get_tool_parser(name) for name in TOOL_PARSERS] + [forced_call_parser(True), forced_call_parser(False)]


@settings(max_examples=150, deadline=None)
@given(fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8))
def test_any_text_parses_without_error_and_chunking_never_changes_the_answer(fragments, cuts):
    """Whatever the model writes (never a 500): every parsed call's arguments are a JSON object; the
    whole-output parse and a stream that sends calls only once complete agree whatever the chunking; a
    stream that sends headers early sends the same however the text is cut."""
    text = "".join(fragments)
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    for parser in ALL_PARSERS:
        whole = parser.extract(text)
        for call in whole.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
        assert _same(_stream(parser, pieces, eager=False)[1], whole)
        assert _same(_stream(parser, pieces)[1], _stream(parser, [text])[1])


def test_deltas_come_as_openai_sends_them():
    """Character by character: the header (id and name) first, before the arguments are complete, then
    the arguments in growing fragments; content never carries a piece of a marker."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    deltas, whole = _stream(get_tool_parser("hermes"), list(text))
    call_deltas = [(i, d) for i, delta in enumerate(deltas) for d in delta.tool_calls]
    first_at, first = call_deltas[0]
    assert first.id and first.id.startswith("call_") and first.name == "get_weather"
    assert first_at < text.index("}}") + 1  # sent while the arguments were still arriving
    fragments = [d for _, d in call_deltas[1:]]
    assert len(fragments) > 5 and all(d.id is None and d.name is None for d in fragments)
    assert whole.tool_calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    content = [delta.content for delta in deltas if delta.content]
    assert "".join(content) == "Sure." and all("<" not in c for c in content)


def test_a_call_that_breaks_after_its_header_ends_there_when_streamed():
    """Streamed, a call whose header went out cannot be withdrawn: the text from the break on is content.
    Parsed whole, the same output is all text."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1,, }}\n</tool_call>'
    p = get_tool_parser("hermes")
    _, streamed = _stream(p, [text[:35], text[35:]])
    assert [c.name for c in streamed.tool_calls] == ["f"] and streamed.tool_calls[0].arguments == '{"a": 1,'
    assert streamed.content == ", }}\n</tool_call>"
    assert p.extract(text).tool_calls == [] and p.extract(text).content == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    p = get_tool_parser("mistral")
    parsed = p.extract(text, max_calls=1)
    assert _calls(parsed) == [("a", {})] and parsed.content is None
    stream = p.stream(max_calls=1)
    assert _same(collect_deltas([stream.feed(text[:50]), stream.feed(text[50:]), stream.finish()]), parsed)


def test_mistral_ids_are_nine_alphanumerics():
    parsed = get_tool_parser("mistral").extract('[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert len(parsed.tool_calls[0].id) == 9 and parsed.tool_calls[0].id.isalnum()


def test_forced_call_output_parses_with_any_whitespace():
    text = '[ {\n"name"\r:"add"\t,"arguments"\t:{ "a"\r:9\t, "b"\n:3}\r}\r,\t{"name": "add", "arguments": {"a": 1, "b": 2}} ]'
    parsed = forced_call_parser(parallel=True).extract(text)
    assert _calls(parsed) == [("add", {"a": 9, "b": 3}), ("add", {"a": 1, "b": 2})] and parsed.content is None
    single = forced_call_parser(parallel=False).extract(' {"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert _calls(single) == [("add", {"a": 1, "b": 2})]


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'nope'.*hermes"):
        get_tool_parser("nope")
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral"}


# --------------------------------------------------------------------------- tool definitions


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"type": "function"}], r"tools\[0\]\.function: Field required"),
        ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\]\.type"),
        ([{"type": "function", "function": {"name": "has space"}}], r"tools\[0\]\.function\.name: a function name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], r"tools\[0\]\.function\.parameters"),
        ([TOOLS[0], TOOLS[0]], r"tools\[1\]\.function\.name: 'get_weather' is defined twice"),
        ({"type": "function"}, "tools: must be a list"),
    ],
)
def test_bad_tool_definitions_name_the_field(tools, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)


def test_schemas_that_do_not_compile_name_the_tool():
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters: "):
        check_tool_schemas(parse_tools([TOOLS[0], bad]))
    check_tool_schemas(parse_tools(TOOLS))


def test_named_choice():
    tools = parse_tools(TOOLS)
    assert named_choice("required", tools) is None
    assert named_choice({"type": "function", "function": {"name": "add"}}, tools) == "add"
    with pytest.raises(ValueError, match="tool_choice: function 'mul' is not among"):
        named_choice({"type": "function", "function": {"name": "mul"}}, tools)
    with pytest.raises(ValueError, match="tool_choice: must be"):
        named_choice("sometimes", tools)


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_schema_accepts_calls_and_only_calls(parallel):
    schema = forced_call_schema(parse_tools(TOOLS), None, parallel)
    good = {"name": "add", "arguments": {"a": 1, "b": 2}}
    wrap = (lambda x: [x]) if parallel else (lambda x: x)
    jsonschema.validate(wrap(good), schema)
    for bad in ({"name": "add", "arguments": {"a": 10, "b": 2}}, {"name": "get_weather", "arguments": {"a": 1, "b": 2}},
                {"name": "mul", "arguments": {}}, {"name": "add"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrap(bad), schema)
    if parallel:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([], schema)
    named = forced_call_schema(parse_tools(TOOLS), "get_weather", parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrap(good), named)


def test_template_inputs():
    assert tools_for_template(parse_tools([{"type": "function", "function": {"name": "f"}}])) == \
        [{"type": "function", "function": {"name": "f"}}]
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    out = messages_for_template(history)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert history[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's copy is untouched
