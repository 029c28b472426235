import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 你好 🙂 the quick brown fox jumps over the lazy dog",
    "stop here STOP now, then END. naïve café 日本語 😀🙂 ###",
    "Hello world! The end is near; stop words and more words.",
] * 30
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE; a small vocab so CJK characters and emoji split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok)


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    """Sentencepiece style (Metaspace '▁' for spaces, the decoder strips a leading space)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + ["<unk>"])
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(tok, prompt_ids, output_ids, chunk=1, **kw):
    """Feed output ids `chunk` at a time; return (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**kw))
    deltas, stop = [], None
    for i in range(0, len(output_ids), chunk):
        stop = detok.update(output_ids[i : i + chunk])
        finished = stop is not None or i + chunk >= len(output_ids)
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop


def test_multibyte_split_across_tokens_never_emits_replacement(byte_tok):
    text = "héllo 你好🙂 naïve 日本語 😀🙂"
    ids = enc(byte_tok, text)
    # The point of the test: some characters really are split over several tokens.
    assert any("\ufffd" in byte_tok.decode(ids[:i]) for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(byte_tok, enc(byte_tok, "the"), SamplingParams())
    seen = []
    for t in ids:
        detok.update([t])
        seen.append(detok.output_text)
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == byte_tok.decode(ids) == text
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(byte_tok, chunk):
    text = "the quick 你好 brown 🙂 fox"
    ids = enc(byte_tok, text)
    detok, deltas, stop = run(byte_tok, enc(byte_tok, "Hello"), ids, chunk=chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == byte_tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_leading_space_kept_mid_text(sp_tok):
    prompt = enc(sp_tok, "Hello")
    ids = enc(sp_tok, "Hello world and more words")[len(prompt) :]
    assert sp_tok.convert_ids_to_tokens(ids)[0].startswith("▁")
    detok, deltas, _ = run(sp_tok, prompt, ids)
    # The continuation keeps its leading space (a standalone decode would strip it).
    assert detok.output_text == " world and more words"
    assert "".join(deltas) == detok.output_text


def test_no_prompt_context_matches_decode(sp_tok):
    ids = enc(sp_tok, "stop words and more")
    detok, deltas, _ = run(sp_tok, [], ids)
    assert detok.output_text == sp_tok.decode(ids) == "stop words and more"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(byte_tok, include):
    text = "the quick brown fox jumps over"
    ids = enc(byte_tok, text)
    stop = "ck bro"
    # The stop string starts and ends inside different tokens.
    start = text.index(stop)
    boundaries = [len(byte_tok.decode(ids[:i])) for i in range(len(ids) + 1)]
    assert start not in boundaries and start + len(stop) not in boundaries
    detok, deltas, matched = run(byte_tok, [], ids, stop=["zzz", stop], include_stop_str_in_output=include)
    expected = text[: start + len(stop)] if include else text[:start]
    assert matched == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # No update after a stop changes the text.
    assert detok.update(enc(byte_tok, " more")) is None
    assert detok.output_text == expected


def test_earliest_stop_string_wins(byte_tok):
    ids = enc(byte_tok, "stop here STOP now")
    detok, _, matched = run(byte_tok, [], ids, chunk=len(ids), stop=["now", "here", "ere S"])
    assert matched == "here" and detok.output_text == "stop "


def test_streaming_never_leaks_partial_stop_string(byte_tok):
    rng = random.Random(0)
    text = "the quick brown fox jumps over the lazy dog END. more"
    ids = enc(byte_tok, text)
    stop = "END."
    for _ in range(5):
        chunk = rng.randint(1, 3)
        detok, deltas, matched = run(byte_tok, [], ids, chunk=chunk, stop=[stop, "zebra"])
        assert matched == stop
        final = text[: text.index(stop)]
        emitted = ""
        for d in deltas:
            emitted += d
            # Every emission is final text: nothing of the stop string ever goes out.
            assert final.startswith(emitted)
        assert emitted == detok.output_text == final


def test_holdback_released_on_finish_without_stop(byte_tok):
    ids = enc(byte_tok, "the lazy dog")
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["xyzzy"]))
    detok.update(ids)
    partial = detok.get_next_output_text(finished=False, delta=True)
    assert partial == "the lazy dog"[: -4]
    assert detok.get_next_output_text(finished=False, delta=False) == partial
    rest = detok.get_next_output_text(finished=True, delta=True)
    assert partial + rest == "the lazy dog"
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == "the lazy dog"


def test_incomplete_character_at_finish_is_flushed(byte_tok):
    ids = enc(byte_tok, "fox 🙂")
    prefix = next(i for i in range(len(ids), 0, -1) if byte_tok.decode(ids[:i]).endswith("\ufffd"))
    cut = ids[:prefix]
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams())
    detok.update(cut)
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=False)
    assert detok.get_next_output_text(finished=True, delta=False) == byte_tok.decode(cut)


def test_skip_special_tokens(byte_tok):
    eos, bos = byte_tok.eos_token_id, byte_tok.bos_token_id
    ids = [bos] + enc(byte_tok, "the fox") + [eos]
    detok, deltas, _ = run(byte_tok, [], ids)
    assert detok.output_text == "the fox" == byte_tok.decode(ids, skip_special_tokens=True)
    detok, deltas, _ = run(byte_tok, [], ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert detok.output_text == "<|bos|>the fox<|eos|>" == byte_tok.decode(ids)
    assert "".join(deltas) == detok.output_text


def test_spaces_between_special_tokens(byte_tok):
    eos, bos = byte_tok.eos_token_id, byte_tok.bos_token_id
    ids = [bos] + enc(byte_tok, "the fox") + [eos, eos]
    detok, deltas, _ = run(byte_tok, [], ids, skip_special_tokens=False)
    assert detok.output_text == "<|bos|> the fox <|eos|> <|eos|>"
    assert "".join(deltas) == detok.output_text


def test_stop_string_matches_special_token_text_only_when_kept(byte_tok):
    ids = enc(byte_tok, "the fox") + [byte_tok.eos_token_id] + enc(byte_tok, " dog")
    _, _, matched = run(byte_tok, [], ids, stop=["<|eos|>"])
    assert matched is None
    detok, _, matched = run(
        byte_tok, [], ids, stop=["<|eos|>"], skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert matched == "<|eos|>" and detok.output_text == "the fox"


def test_detokenize_false_does_no_text_work(byte_tok):
    class Exploding:
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer.{name} used with detokenize=False")

    detok = IncrementalDetokenizer(Exploding(), [1, 2], SamplingParams(detokenize=False))
    assert detok.update(enc(byte_tok, "the fox")) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def _first_token_completing(tok, ids: list[int], needle: str, after: int = 0) -> int:
    """Number of output tokens at which `needle` first appears in the text past character `after`."""
    return next(i for i in range(1, len(ids) + 1) if needle in tok.decode(ids[:i])[after:])


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_min_tokens_delays_stop_strings(byte_tok, include, chunk):
    text = "the fox\nthe lazy dog\nmore words\n"
    ids = enc(byte_tok, text)
    first = _first_token_completing(byte_tok, ids, "\n")
    second = _first_token_completing(byte_tok, ids, "\n", after=text.index("\n") + 1)
    assert first < second
    kw = dict(stop=["\n"], include_stop_str_in_output=include)
    # With exactly `first` tokens required, the first newline (completed by token `first`) stops.
    detok, deltas, matched = run(byte_tok, [], ids, chunk=chunk, min_tokens=first, **kw)
    expected = text[: text.index("\n") + include]
    assert matched == "\n" and detok.output_text == expected == "".join(deltas)
    # One more required token: the first newline is ordinary text, the next one stops.
    detok, deltas, matched = run(byte_tok, [], ids, chunk=chunk, min_tokens=first + 1, **kw)
    end = text.index("\n", text.index("\n") + 1)
    expected = text[: end + include]
    assert matched == "\n" and detok.output_text == expected == "".join(deltas)
    # Past every newline: no stop at all.
    detok, _, matched = run(byte_tok, [], ids, chunk=chunk, min_tokens=len(ids) + 1, max_tokens=len(ids) + 1, **kw)
    assert matched is None and detok.output_text == text
