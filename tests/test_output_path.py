"""The output path does text work only for outputs someone reads: a FINAL_ONLY request without stop
strings is decoded once when it finishes (batched, and exactly the text incremental detokenization
gives), a multi-token step stops at the same token as one-token steps would, and logprob tokens are
decoded in one batched call per step."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedserve.engine import detokenizer as detokenizer_module
from pagedserve.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, detokenize_finished
from pagedserve.engine.output_processor import OutputKind, OutputProcessor
from pagedserve.engine.outputs import EngineCoreOutput
from pagedserve.engine.sampling_params import SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default-model"
CORPUS = [
    "héllo wörld 你好 🙂 the quick brown fox jumps over the lazy dog",
    "stop here STOP now, then END. naïve café 日本語 😀🙂 ###",
    "def step(self):\n    return [x * 2 for x in range(10)]\n",
] * 30
TEXTS = ["The quick brown fox 你好 jumps.\n", "naïve café 😀 END. more words", "x = [1, 2]\n  return x", "日本語🙂 ok"]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def _wrap(tok: Tokenizer, **extra) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", **extra)


def _metaspace_tok() -> PreTrainedTokenizerFast:
    """Sentencepiece style: '▁' for spaces, the decoder drops a leading space; one added non-special token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + ["<unk>"]))
    wrapped = _wrap(tok)
    wrapped.add_tokens(["<tool>"])  # spaced from its neighbours by spaces_between_special_tokens
    return wrapped


def _byte_fallback_tok() -> PreTrainedTokenizerFast:
    """Llama-2 style: byte-fallback BPE, decoder Replace('▁', ' ') + ByteFallback + Fuse + Strip(1 leading space)."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(["the quick brown fox jumps over the lazy dog stop here now"] * 20,
                             trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS + ["<unk>"]))
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


@pytest.fixture(scope="module")
def tokenizers_under_test(tokenizer_dir) -> dict[str, PreTrainedTokenizerFast]:
    return {
        "default-model": AutoTokenizer.from_pretrained(str(DEFAULT_MODEL)),
        "tiny-byte-level": AutoTokenizer.from_pretrained(str(tokenizer_dir)),
        "metaspace": _metaspace_tok(),
        "byte-fallback": _byte_fallback_tok(),
    }


def incremental_text(tok, prompt: list[int], output: list[int], params: SamplingParams) -> str:
    """Today's path: one token per step, the full text at the end."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    for t in output:
        detok.update([t])
    return detok.get_next_output_text(finished=True, delta=False)


def _random_ids(rng: random.Random, tok, length: int) -> list[int]:
    kind = rng.random()
    if kind < 0.5:  # natural text, sometimes cut mid-character
        ids = tok.encode(" ".join(rng.choices(TEXTS, k=3)), add_special_tokens=False)
        start = rng.randrange(len(ids))
        return ids[start : start + length]
    specials = list(tok.all_special_ids) + list(tok.get_added_vocab().values())
    pool = range(len(tok))
    return [rng.choice(specials) if rng.random() < 0.05 else rng.choice(pool) for _ in range(length)]


def test_whole_decode_at_the_end_equals_incremental_text(tokenizers_under_test, monkeypatch):
    rng = random.Random(1234)
    for name, tok in tokenizers_under_test.items():
        info = TokenizerInfo(tok)
        assert info.whole_decode_exact, name  # every decoder here is one that whole decodes handle
        requests = []
        for _ in range(300):
            params = SamplingParams(skip_special_tokens=rng.random() < 0.7,
                                    spaces_between_special_tokens=rng.random() < 0.5)
            prompt = _random_ids(rng, tok, rng.choice([0, 1, 3, 8]))
            output = _random_ids(rng, tok, rng.randint(1, 40))
            if rng.random() < 0.2:
                output.append(tok.eos_token_id)
            requests.append((prompt, output, params))
        expected = [incremental_text(tok, p, o, s) for p, o, s in requests]
        assert detokenize_finished(info, requests) == expected, name

        # Plain text (no split characters, no spaced added tokens) takes one whole decode, no replay.
        replays = 0
        real_update = IncrementalDetokenizer.update

        def counting_update(self, ids):
            nonlocal replays
            replays += 1
            return real_update(self, ids)

        texts = [t for t in TEXTS if tok.decode(tok.encode(t, add_special_tokens=False)) == t]  # no <unk>
        assert len(texts) >= 2, name
        plain = []
        for i in range(50):
            prompt = tok.encode(texts[i % len(texts)], add_special_tokens=False)
            output = tok.encode(" ".join(rng.choices(texts, k=2)), add_special_tokens=False) + [tok.eos_token_id]
            plain.append((prompt, output, SamplingParams()))
        expected = [incremental_text(tok, p, o, s) for p, o, s in plain]
        monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "update", counting_update)
        assert detokenize_finished(info, plain) == expected, name
        monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "update", real_update)
        assert replays == 0, (name, replays)


def test_tokenizer_that_cleans_up_spaces_is_replayed(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.clean_up_tokenization_spaces = True
    info = TokenizerInfo(tok)
    assert not info.whole_decode_exact
    ids = tok.encode("a , b . c n't", add_special_tokens=False)
    requests = [([], ids, SamplingParams()), (ids[:2], ids[2:], SamplingParams())]
    assert detokenize_finished(info, requests) == [incremental_text(tok, p, o, s) for p, o, s in requests]


class CountingBackend:
    """Wraps a Rust tokenizer and counts its decode calls."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.decode_calls = 0
        self.batch_calls: list[int] = []  # sequences per decode_batch call

    def decode(self, ids, skip_special_tokens=True):
        self.decode_calls += 1
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences, skip_special_tokens=True):
        self.batch_calls.append(len(sequences))
        return self._backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.fixture()
def counted(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    backend = CountingBackend(tok._tokenizer)
    tok._tokenizer = backend
    return tok, backend


def step(processor: OutputProcessor, tokens: dict[str, list[int]], finish: set[str] = frozenset(), logprobs=False):
    outs = [EngineCoreOutput(rid, ids, new_logprobs=[[(t, -0.5, 1), (t + 1, -1.5, 2)] for t in ids] if logprobs else None,
                             finish_reason="length" if rid in finish else None) for rid, ids in tokens.items()]
    return processor.process_outputs(outs)


def test_final_only_is_not_detokenized_until_it_finishes_then_in_one_batch(counted):
    tok, backend = counted
    processor = OutputProcessor(tok)
    text = "The quick brown fox jumps over the lazy dog. Héllo wörld 你好 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("def step", add_special_tokens=False)
    for rid in "abc":
        processor.add_request(rid, None, prompt, SamplingParams(), 0.0, OutputKind.FINAL_ONLY)
    for i, t in enumerate(ids[:-1]):
        outputs, _ = step(processor, {rid: [t] for rid in "abc"})
        assert outputs == []
    assert backend.decode_calls == 0 and backend.batch_calls == []  # no text work while nobody reads
    outputs, _ = step(processor, {"a": [ids[-1]], "b": [ids[-1]], "c": [ids[-1]]}, finish={"a", "b"})
    assert backend.batch_calls == [4] and backend.decode_calls == 0  # a and b: one call, two sequences each
    assert [o.request_id for o in outputs] == ["a", "b"]
    for o in outputs:
        assert o.finished and o.outputs[0].text == incremental_text(tok, prompt, ids, SamplingParams()) == text
        assert o.outputs[0].token_ids == ids and o.outputs[0].finish_reason == "length"
    (c,), _ = step(processor, {"c": []}, finish={"c"})
    assert c.outputs[0].text == text and c.outputs[0].token_ids == ids
    assert not processor.has_unfinished_requests()


def test_streams_and_stop_strings_stay_incremental(counted):
    tok, backend = counted
    processor = OutputProcessor(tok)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    processor.add_request("stream", None, [], SamplingParams(), 0.0, OutputKind.DELTA)
    processor.add_request("stop", None, [], SamplingParams(stop=["lazy"]), 0.0, OutputKind.FINAL_ONLY)
    deltas, final, stopped_at = [], None, None
    for i, t in enumerate(ids):
        outputs, stopped = step(processor, {rid: [t] for rid in list(processor.states)})
        if stopped:
            stopped_at = i
        for o in outputs:
            if o.request_id == "stream":
                deltas.append(o.outputs[0].text)
            else:
                final = o
    assert backend.decode_calls > 0  # decoded step by step
    assert "".join(deltas).startswith("The quick brown fox jumps over the lazy")  # not finished: no flush asked
    assert final.outputs[0].text == "The quick brown fox jumps over the " and final.outputs[0].stop_reason == "lazy"
    assert tok.decode(ids[: stopped_at + 1]).endswith("lazy") and not tok.decode(ids[:stopped_at]).endswith("lazy")


def test_logprob_tokens_decoded_in_one_batched_call_per_step_and_cached(counted):
    tok, backend = counted
    processor = OutputProcessor(tok)
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    for rid in "ab":
        processor.add_request(rid, None, [], SamplingParams(logprobs=1), 0.0, OutputKind.DELTA)
    processor.add_request("f", None, [], SamplingParams(logprobs=1), 0.0, OutputKind.FINAL_ONLY)
    before = backend.decode_calls
    seen: dict[str, list] = {"a": [], "b": [], "f": []}
    for i, t in enumerate(ids):
        calls = len(backend.batch_calls)
        last = i == len(ids) - 1
        outputs, _ = step(processor, {rid: [t] for rid in "abf"}, finish={"a", "b", "f"} if last else set(),
                          logprobs=True)
        # At most one batched call for the logprob tokens (+ one for f's final text), never one per entry.
        assert len(backend.batch_calls) - calls <= (2 if last else 1)
        for o in outputs:
            seen[o.request_id] += o.outputs[0].logprobs
    with_logprobs = backend.decode_calls - before
    plain = OutputProcessor(tok)  # the same requests without logprobs: the same single decodes (text windows)
    for rid in "ab":
        plain.add_request(rid, None, [], SamplingParams(), 0.0, OutputKind.DELTA)
    before = backend.decode_calls
    for i, t in enumerate(ids):
        step(plain, {rid: [t] for rid in "ab"}, finish={"a", "b"} if i == len(ids) - 1 else set())
    assert with_logprobs == backend.decode_calls - before
    for rid, entries in seen.items():
        assert len(entries) == len(ids)
        for t, position in zip(ids, entries):
            assert list(position) == [t, t + 1]
            for tid, lp in position.items():
                assert lp.decoded_token == tok.decode([tid])
    # Cached per token id: a later step with the same tokens decodes nothing more.
    calls = len(backend.batch_calls)
    processor.add_request("g", None, [], SamplingParams(logprobs=1), 0.0, OutputKind.DELTA)
    step(processor, {"g": ids[:2]}, logprobs=True)
    assert len(backend.batch_calls) == calls


# ---------------------------------------------------------------------- several tokens in one step


def _run(tok, tokens, chunks, params, kind, engine_finish=None, prompt=(7, 8, 9)):
    """Feed `tokens` in steps of the given sizes, logprobs included; the engine core finishes the request
    on the last token with `engine_finish` (reason, stop_reason; a length limit by default). Returns (outputs,
    the ids stopped by a string, whether the engine core itself finished the request)."""
    processor = OutputProcessor(tok)
    processor.add_request("r", None, list(prompt), params.model_copy(update={"logprobs": 0}), 0.0, kind)
    outputs, stopped, pos = [], [], 0
    for size in chunks:
        new = tokens[pos : pos + size]
        pos += size
        last = pos >= len(tokens)
        reason, stop_reason = (engine_finish or ("length", None)) if last else (None, None)
        out = EngineCoreOutput("r", new, new_logprobs=[[(t, -0.25 * (t % 7) - 0.1, 1)] for t in new],
                               finish_reason=reason, stop_reason=stop_reason)
        outs, stop = processor.process_outputs([out])
        outputs += outs
        stopped += stop
        if last or (outs and outs[-1].finished):
            break
    return outputs, stopped, last


def _summary(outputs, kind):
    """(token_ids, text, finish_reason, stop_reason, cumulative_logprob, logprob ids) of the whole output."""
    completions = [o.outputs[0] for o in outputs]
    last = completions[-1]
    if kind == OutputKind.DELTA:
        token_ids = [t for c in completions for t in c.token_ids]
        text = "".join(c.text for c in completions)
        logprobs = [list(p) for c in completions for p in c.logprobs]
    else:
        token_ids, text, logprobs = last.token_ids, last.text, [list(p) for p in last.logprobs]
    return token_ids, text, last.finish_reason, last.stop_reason, last.cumulative_logprob, logprobs, outputs[-1].finished


def _chunkings(rng: random.Random, n: int):
    yield [n]
    yield [2] * n
    for _ in range(4):
        sizes, left = [], n
        while left > 0:
            sizes.append(rng.randint(1, 5))
            left -= sizes[-1]
        yield sizes


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.FINAL_ONLY, OutputKind.CUMULATIVE])
def test_multi_token_steps_stop_where_one_token_steps_stop(tokenizers_under_test, kind):
    tok = tokenizers_under_test["tiny-byte-level"]
    rng = random.Random(7)
    text = "The quick brown fox jumps over the lazy dog. END. Héllo wörld 你好 🙂 more text here"
    tokens = tok.encode(text, add_special_tokens=False)
    stop_token = tokens[len(tokens) // 2]
    cases = [
        (SamplingParams(stop=["lazy"]), None),
        (SamplingParams(stop=["END.", "zzz"], include_stop_str_in_output=True), None),
        (SamplingParams(stop=["o"], min_tokens=12), None),
        (SamplingParams(stop=["你好"]), None),  # a stop string made of split characters
        (SamplingParams(stop=["nothing like it"]), None),
        # The engine core ends the step at a stop token (or a length limit): it is the step's last token.
        (SamplingParams(stop=["nothing like it"], stop_token_ids=[stop_token]), ("stop", stop_token)),
        (SamplingParams(stop=["lazy"]), ("length", None)),  # the stop string comes first
        (SamplingParams(), ("stop", stop_token)),
    ]
    for params, engine_finish in cases:
        if engine_finish is not None and engine_finish[1] is not None:
            seq = tokens[: tokens.index(stop_token) + 1]
        else:
            seq = tokens
        one_by_one, _, _ = _run(tok, seq, [1] * len(seq), params, kind, engine_finish)
        want = _summary(one_by_one, kind)
        assert want[-1], params  # finished
        for chunks in _chunkings(rng, len(seq)):
            outputs, stopped, engine_finished = _run(tok, seq, chunks, params, kind, engine_finish)
            assert _summary(outputs, kind) == want, (params, chunks)
            # A stop string tells the engine core to finish the request, unless it did so in that step.
            by_string = isinstance(want[3], str)
            assert stopped == (["r"] if by_string and not engine_finished else []), (params, chunks)
    # The cases above do stop inside a step: a stop string mid-step drops the step's later tokens.
    outputs, stopped, _ = _run(tok, tokens, [len(tokens)], SamplingParams(stop=["lazy"]), kind)
    token_ids = _summary(outputs, kind)[0]
    assert stopped == [] and 0 < len(token_ids) < len(tokens)
    outputs, stopped, _ = _run(tok, tokens, [len(tokens) - 1, 1], SamplingParams(stop=["lazy"]), kind)
    assert stopped == ["r"] and _summary(outputs, kind)[0] == token_ids


def test_n_children_detokenized_at_the_end_report_once(tokenizer_dir):
    from pagedserve.engine.output_processor import ParentRequest

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    processor = OutputProcessor(tok)
    parent = ParentRequest("p", 2)
    params = SamplingParams(n=1)
    for i in range(2):
        processor.add_request(f"p#{i}", "hi", [5, 6], params, 0.0, OutputKind.FINAL_ONLY, parent, i)
    a = tok.encode(" fox jumps", add_special_tokens=False)
    b = tok.encode(" lazy dog 你好", add_special_tokens=False)
    out, _ = processor.process_outputs([EngineCoreOutput("p#0", a, finish_reason="length")])
    assert out == []
    (final,), _ = processor.process_outputs([EngineCoreOutput("p#1", b, finish_reason="stop")])
    assert final.request_id == "p" and final.finished
    assert [c.text for c in final.outputs] == [" fox jumps", " lazy dog 你好"]


def test_async_llm_final_only_yields_one_output_with_the_offline_text(tiny_llama):
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.config import EngineConfig

    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="8MiB"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def collect(**kw):
        return [o async for o in engine.generate("the quick brown fox", params, **kw)]

    try:
        (final,) = asyncio.run(collect(output_kind=OutputKind.FINAL_ONLY))
        deltas = asyncio.run(collect())
    finally:
        engine.shutdown()
    assert final.finished and len(final.outputs[0].token_ids) == 12
    assert final.outputs[0].text == "".join(d.outputs[0].text for d in deltas)
    assert final.outputs[0].token_ids == [t for d in deltas for t in d.outputs[0].token_ids]
