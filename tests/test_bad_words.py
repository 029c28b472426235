"""bad_words: bounded in characters and in tokens (a ValueError naming the field), tokenized off the
engine thread by AsyncLLM (and once for all n children), and matched each step by a walk of a
token-id trie that bans exactly what scanning every word would."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.sample.bad_words import BadWordsTrie
from pagedserve.engine.sampling_params import (
    MAX_BAD_WORDS_CHARS,
    MAX_BAD_WORDS_TOKENS,
    SamplingParams,
    bad_words_token_ids,
)
from tests.test_request_validation import _process, _processor


def _reference_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """Every word's last token whose earlier tokens end the output (the scan the trie replaces)."""
    return {w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:]
                                                     == w[:-1])}


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), max_size=12),
    output=st.lists(st.integers(0, 6), max_size=10),
    drafts=st.lists(st.integers(0, 6), max_size=3),
)
def test_trie_bans_what_a_scan_of_every_word_bans(words, output, drafts):
    trie = BadWordsTrie(words)
    assert set(trie.banned(output)) == _reference_bans(words, output)
    assert set(trie.banned(output, drafts)) == _reference_bans(words, output + drafts)


def test_trie_walk_stops_at_the_longest_word():
    words = [[i, i + 1, 5000 + i] for i in range(0, 4000, 2)]
    trie = BadWordsTrie(words)
    assert trie.banned([7, 7, 7, 10, 11]) == [5010]
    assert trie.banned([9] * 100_000) == []


def test_bad_words_over_the_character_limit_are_refused():
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["x" * 1024] * (MAX_BAD_WORDS_CHARS // 1024 + 1))
    SamplingParams(bad_words=["x" * 1024] * (MAX_BAD_WORDS_CHARS // 1024))


def test_bad_words_over_the_token_limit_are_refused():
    # The test tokenizer encodes one id per character; each word counts twice (bare and after a space).
    words = ["a" * 1000 + str(i) for i in range(MAX_BAD_WORDS_TOKENS // 2000 + 1)]
    with pytest.raises(ValueError, match="^bad_words: they encode to more than"):
        bad_words_token_ids(words, _processor().tokenizer)
    with pytest.raises(ValueError, match="^bad_words:"):
        _process(SamplingParams(bad_words=words))
    # Ids tokenized elsewhere are held to the same limit.
    with pytest.raises(ValueError, match="^bad_words:"):
        _processor().process("r", {"prompt_token_ids": [5]}, SamplingParams(bad_words=["a"]),
                             bad_words_ids=[[5] * (MAX_BAD_WORDS_TOKENS + 1)])


def test_processor_uses_bad_words_tokenized_elsewhere():
    processor = _processor()
    _, request = processor.process("r", {"prompt_token_ids": [5, 6]}, SamplingParams(bad_words=["ab"]),
                                   bad_words_ids=[[7, 8]])
    assert request.bad_words_token_ids == [[7, 8]]
    with pytest.raises(ValueError, match="bad_words"):  # still inside the vocabulary
        processor.process("r2", {"prompt_token_ids": [5, 6]}, SamplingParams(bad_words=["ab"]),
                          bad_words_ids=[[7, 1000]])


class _RecordingTokenizer:
    """Records the thread of every encode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.threads: list[str] = []

    def encode(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_async_llm_tokenizes_bad_words_off_the_engine_thread(tiny_llama):
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="8MiB"))
    try:
        recorder = _RecordingTokenizer(engine.tokenizer)
        engine.tokenizer = recorder
        engine.engine.processor.tokenizer = recorder
        params = SamplingParams(temperature=0, max_tokens=4, n=3, bad_words=["fox", "the lazy dog"])

        async def run():
            outputs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params,
                                                      output_kind=OutputKind.CUMULATIVE)]
            return outputs[-1]

        final = asyncio.run(run())
        assert final.finished and len(final.outputs) == 3
        assert len(recorder.threads) == 4  # two words, each bare and after a space: once for all three children
        assert "pagedserve-engine" not in recorder.threads
        with pytest.raises(ValueError, match="^bad_words:"):
            asyncio.run(run_one(engine, SamplingParams(bad_words=["x" * 1000 + str(i) for i in range(3)])))
    finally:
        engine.shutdown()


async def run_one(engine: AsyncLLM, params: SamplingParams) -> None:
    async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
        pass
