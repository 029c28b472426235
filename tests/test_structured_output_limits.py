"""Bounds on structured output: grammar bombs are refused before any compile (a ValueError naming the
field) or compile within the caps; compiles run in worker processes, so a compile that never ends is
killed at its time limit and never holds the other workers; the grammar cache is bounded in bytes;
a compile's memory is bounded; JSON with the default whitespace ends on a random-weight model."""

from __future__ import annotations

import os

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.engine.structured_output.compile_pool import CompileError, CompileTimeoutError
from pagedserve.engine.structured_output.grammar import check_spec
from pagedserve.engine.structured_output.limits import DEFAULT_LIMITS, repetition_units
from pagedserve.engine.structured_output.manager import GrammarCache, StructuredOutputManager, _Entry
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from tests.grammar_faults import faulty_compile
from tests.structured_output_checks import SCHEMA, is_valid
from tests.test_engine_parity import assert_all_blocks_free, random_prompts


def _schema_of_depth(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# --------------------------------------------------------------------------- refused before compiling

BOMBS = [
    # 300 alternatives of distinct counted repeats: 26 s and 190 MB to compile on a 49k vocabulary.
    ({"regex": "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 301)) + ")"}, "structured_outputs.regex",
     "repetitions"),
    ({"regex": "".join(f"[a-z]{{{20 + i}}}x" for i in range(500))}, "structured_outputs.regex", "repetitions"),
    ({"grammar": "root ::= " + " ".join(f'[a-z]{{{100 + i}}} "x"' for i in range(40))}, "structured_outputs.grammar",
     "repetitions"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 256 + i} for i in range(20)}}},
     "structured_outputs.json", "repetitions"),
    ({"json": _schema_of_depth(100)}, "structured_outputs.json", "levels deep"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(300)}}},
     "structured_outputs.json", "300 properties"),
    ({"json": {"enum": [f"v{i}" for i in range(2000)]}}, "structured_outputs.json", "enum has 2000 entries"),
    ({"json": {"anyOf": [{"const": i} for i in range(1500)]}}, "structured_outputs.json", "anyOf has 1500"),
]


@pytest.mark.parametrize(("spec", "field", "reason"), BOMBS)
def test_grammar_bombs_are_refused_naming_the_field(spec, field, reason):
    with pytest.raises(ValueError) as info:
        check_spec(StructuredOutputsParams(**spec))
    assert str(info.value).startswith(field + ":"), info.value
    assert reason in str(info.value)


def test_specs_within_the_limits_pass():
    for spec in (
        {"regex": r"[a-z]{2,4}-\d{1,3}"},
        {"regex": "(a{1,1000}){1,1000}"},  # nested counts: two distinct repeats, each counted up to the cap
        {"regex": "[a-z]{1,5000}"},
        {"regex": "(" + "|".join(f"abc{i}x" for i in range(3000)) + ")"},  # many plain alternatives are cheap
        {"json": SCHEMA},
        {"json": _schema_of_depth(30)},
        {"json": {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(256)}}},
        {"json": {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 64} for i in range(40)}}},
        {"choice": [f"choice {i}" for i in range(1024)]},
        {"json_object": True},
    ):
        check_spec(StructuredOutputsParams(**spec))


def test_repetition_units_count_distinct_repeats_up_to_the_cap():
    cap = DEFAULT_LIMITS.repetition_unit_cap
    grammar = ('root ::= ((a{0, 10} b{0, 10} a{0, 10} c{2, -1} d{1, 5000} "x{1, 9999}" [{]))\n'
               'a ::= (([a-z]))\nb ::= (([a-z]))\nc ::= (([0-9]))\nd ::= (("y"))')
    # a and b have one body and one bound: 10 once; c unbounded counts its lower bound; d is capped;
    # the quoted literal and the character class count nothing.
    assert repetition_units(grammar) == 10 + 2 + cap


# --------------------------------------------------------------------------- the compile workers


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


@pytest.fixture()
def manager(tokenizer):
    made: list[StructuredOutputManager] = []

    def make(**kwargs) -> StructuredOutputManager:
        m = StructuredOutputManager(tokenizer, len(tokenizer), **kwargs)
        m.compile_fn = faulty_compile
        made.append(m)
        return m

    yield make
    for m in made:
        m.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_compile_that_never_ends_holds_only_its_own_worker(manager):
    m = manager(max_workers=2, compile_timeout=300.0)
    m.start()
    stuck = m.submit(StructuredOutputsParams(regex="forever"))
    # While one worker is stuck, every well-formed spec still compiles, one after the other, on the other.
    for i in range(6):
        compiled = m.submit(StructuredOutputsParams(regex=f"[a-z]{{{i + 1}}}-{i}")).result(timeout=120)
        assert compiled.memory_size_bytes > 0
    assert not stuck.done()


def test_stuck_compiles_are_killed_and_their_workers_replaced(manager):
    m = manager(max_workers=2, compile_timeout=2.0)
    m.start()
    pids = m.pool.worker_pids()
    stuck = [m.submit(StructuredOutputsParams(regex="forever")), m.submit(StructuredOutputsParams(regex="sleep:600"))]
    for future in stuck:  # both workers held: only the kill at the time limit frees them
        with pytest.raises(CompileTimeoutError, match="longer than 2 s"):
            future.result(timeout=120)
    assert m.pool.num_killed == 2
    assert not any(_alive(pid) for pid in pids)
    assert m.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120).memory_size_bytes > 0
    assert not set(m.pool.worker_pids()) & set(pids)  # fresh workers
    # A killed spec fails again at once: resending it costs no worker.
    compiles = m.num_compiles
    with pytest.raises(CompileTimeoutError):
        m.submit(StructuredOutputsParams(regex="forever")).result(timeout=1)
    assert m.num_compiles == compiles


def test_a_compile_over_the_memory_limit_fails_alone(manager):
    m = manager(max_workers=2, compile_memory_bytes=1024**3)
    # The hook allocates 3 GiB inside the worker: the worker's data limit turns it into a MemoryError.
    big = StructuredOutputsParams(regex="alloc:3221225472")
    with pytest.raises(CompileError, match="MemoryError"):
        m.submit(big).result(timeout=120)
    assert m.submit(StructuredOutputsParams(regex="[0-9]+")).result(timeout=120).memory_size_bytes > 0


def test_failed_compiles_are_cached_as_failed(manager):
    m = manager(max_workers=2)
    boom = StructuredOutputsParams(regex="boom")
    with pytest.raises(CompileError, match="injected compile failure"):
        m.submit(boom).result(timeout=120)
    assert m.submit(boom).exception(timeout=1) is not None and m.num_compiles == 1


def test_grammar_cache_is_bounded_in_bytes():
    from concurrent.futures import Future

    cache = GrammarCache(max_entries=100, max_bytes=1000)
    entries = {key: _Entry(Future(), 0.0) for key in "abcd"}
    for key, entry in entries.items():
        cache.add(key, entry)
    cache.set_size("a", entries["a"], 400)
    cache.set_size("b", entries["b"], 400)
    assert len(cache) == 4 and cache.nbytes == 800
    cache.get("a")  # a is now the most recently used
    cache.set_size("c", entries["c"], 400)  # 1200 > 1000: the least recently used sized entry goes
    assert cache.get("b") is None and cache.get("a") is entries["a"] and cache.nbytes == 800
    cache.set_size("d", entries["d"], 5000)  # larger than the whole budget: not kept
    assert cache.get("d") is None and cache.nbytes <= 1000


def test_real_compiles_are_sized_in_the_cache(manager):
    m = manager(max_workers=2, cache_bytes=1)  # every grammar is larger than the budget
    first = m.submit(StructuredOutputsParams(regex="[a-z]+")).result(timeout=120)
    assert first.memory_size_bytes > 1 and len(m.cache) == 0 and m.cache.nbytes == 0
    m.submit(StructuredOutputsParams(regex="[a-z]+")).result(timeout=120)
    assert m.num_compiles == 2  # not kept, so compiled again


# --------------------------------------------------------------------------- JSON ends on any model


def test_json_at_temperature_0_ends_with_valid_json(tiny_llama):
    """With any whitespace allowed this random-weight model emits whitespace until max_tokens; with the
    default (at most 16 in a row) every completion of this bounded schema ends, valid."""
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=512, max_model_len=256)
    try:
        prompts = [{"prompt_token_ids": p} for p in random_prompts(11, [5 + 3 * i for i in range(6)])]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200,
                                                    structured_outputs={"json": SCHEMA}), use_tqdm=False)
        for out in outs:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            assert is_valid("json", out.outputs[0].text)
        # The request may still allow any run (whitespace_pattern): this model then never stops.
        unbounded = llm.generate(prompts[:2], SamplingParams(
            temperature=0, max_tokens=200, structured_outputs={"json": SCHEMA, "whitespace_pattern": "[ \n\t]*"}),
            use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in unbounded] == ["length", "length"]
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
