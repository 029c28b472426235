"""`bench ... --baseline llama-cpp`: the continuous-batching driver of llama.cpp's C API, checked against a
fake `llama_cpp` module that plays a deterministic model and checks every call the way llama.cpp would
(positions in order per sequence, the batch within n_batch, sequence ids within n_seq_max, KV dropped
before a sequence id is reused); and, where llama-cpp-python is installed, the real thing on a GGUF file."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from pagedserve.bench import llama_cpp_baseline as lcb
from pagedserve.bench.common import parse_baselines
from pagedserve.bench.workload import BenchRequest

VOCAB = 50


class FakeLlamaCpp(types.ModuleType):
    """The C API calls the driver makes. The "model": the next token is (sum of the sequence's tokens) % VOCAB."""

    def __init__(self) -> None:
        super().__init__("llama_cpp")
        self.kv: dict[int, list[int]] = {}  # seq id -> its tokens, in position order
        self.decode_calls: list[int] = []
        self.dropped: list[int] = []
        self._logits = (ctypes.c_float * VOCAB)()
        self.rows: dict[int, np.ndarray] = {}

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return types.SimpleNamespace()

    def llama_context_default_params(self):
        return types.SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        return object()

    def llama_init_from_model(self, model, params):
        self.params = params
        return object()

    def llama_model_get_vocab(self, model):
        return object()

    def llama_vocab_n_tokens(self, vocab):
        return VOCAB

    def llama_batch_init(self, n_tokens, embd, n_seq_max):
        return types.SimpleNamespace(token=[0] * n_tokens, pos=[0] * n_tokens, n_seq_id=[0] * n_tokens,
                                     seq_id=[[0] for _ in range(n_tokens)], logits=[0] * n_tokens, n_tokens=0)

    def llama_decode(self, ctx, batch):
        assert 0 < batch.n_tokens <= self.params.n_batch
        self.decode_calls.append(batch.n_tokens)
        self.rows = {}
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            assert 0 <= seq < self.params.n_seq_max and batch.n_seq_id[i] == 1
            tokens = self.kv.setdefault(seq, [])
            assert batch.pos[i] == len(tokens), "positions of a sequence must come in order"
            tokens.append(batch.token[i])
            if batch.logits[i]:
                row = np.full(VOCAB, -1.0, dtype=np.float32)
                row[sum(tokens) % VOCAB] = 1.0
                self.rows[i] = row
        assert sum(len(t) for t in self.kv.values()) <= self.params.n_ctx
        return 0

    def llama_get_logits_ith(self, ctx, i):
        ctypes.memmove(self._logits, self.rows[i].ctypes.data, VOCAB * 4)
        return ctypes.cast(self._logits, ctypes.POINTER(ctypes.c_float))

    def llama_get_memory(self, ctx):
        return object()

    def llama_memory_seq_rm(self, memory, seq, p0, p1):
        self.dropped.append(seq)
        self.kv.pop(seq, None)

    def llama_batch_free(self, batch):
        pass

    def llama_free(self, ctx):
        pass

    def llama_model_free(self, model):
        pass


def expected_output(request: BenchRequest) -> list[int]:
    tokens = list(request.prompt_token_ids)
    out = []
    for _ in range(request.output_len):
        out.append(sum(tokens) % VOCAB)
        tokens.append(out[-1])
    return out


@pytest.fixture
def fake(monkeypatch, tmp_path):
    module = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


def test_continuous_batching_feeds_every_sequence_in_order_and_produces_exact_lengths(fake, tmp_path):
    rng = np.random.default_rng(0)
    workload = [BenchRequest([int(t) for t in rng.integers(1, VOCAB, size=int(n))], int(m))
                for n, m in zip(rng.integers(1, 40, size=11), rng.integers(1, 9, size=11))]
    engine = lcb.LlamaCppEngine(tmp_path / "m.gguf", batch_size=3, max_seq_len=64, n_batch=16)
    result = engine.run(workload)
    assert result.output_tokens == sum(r.output_len for r in workload)
    assert len(result.first_token_times) == len(workload) and all(t > 0 for t in result.finish_times)
    assert all(f >= s for s, f in zip(result.first_token_times, result.finish_times))
    # Every sequence was dropped once it finished, and nothing is left in the cache.
    assert len(fake.dropped) == len(workload) and fake.kv == {}
    assert max(fake.decode_calls) <= 16 and result.decode_calls == len(fake.decode_calls)


def test_the_model_sees_each_request_exactly_as_greedy_decoding_would(fake, tmp_path):
    """The tokens fed back are the argmax of that sequence's own row: check the last KV contents."""
    workload = [BenchRequest([3, 4, 5], 4), BenchRequest([7] * 20, 3), BenchRequest([1], 5)]
    seen: dict[int, list[int]] = {}
    real_rm = fake.llama_memory_seq_rm

    def keep(memory, seq, p0, p1):
        seen.setdefault(len(seen), list(fake.kv[seq]))
        real_rm(memory, seq, p0, p1)

    fake.llama_memory_seq_rm = keep
    lcb.LlamaCppEngine(tmp_path / "m.gguf", batch_size=2, max_seq_len=32, n_batch=8).run(workload)
    # A finished sequence holds its prompt and every output token but the last (never fed back).
    finals = sorted(seen.values(), key=len)
    wanted = sorted((list(r.prompt_token_ids) + expected_output(r)[:-1] for r in workload), key=len)
    assert finals == wanted


def test_baseline_flags_and_errors(monkeypatch, tmp_path):
    assert parse_baselines("none") == []
    assert parse_baselines("hf,llama-cpp,hf") == ["hf", "llama-cpp"]
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="llama-cpp"):
        parse_baselines("vllm")
    with pytest.raises(ValueError, match="--baseline llama-cpp: .*GGUF"):
        lcb.gguf_file_of(str(tmp_path))  # a folder without a GGUF file
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(ValueError, match="--baseline llama-cpp: llama-cpp-python is not installed"):
        lcb.load_bindings()


def test_real_llama_cpp_on_a_gguf_file(tmp_path):
    """llama.cpp itself, when installed: the default model's GGUF file, greedy, exact lengths."""
    pytest.importorskip("llama_cpp")
    from pagedserve.engine.models.default_model import resolve_default_model

    try:
        model = resolve_default_model()
    except Exception as exc:  # noqa: BLE001 - no default model on this machine
        pytest.skip(f"no default model: {exc}")
    try:
        gguf = lcb.gguf_file_of(model)
    except ValueError:
        pytest.skip("the default model here is not a GGUF file")
    workload = [BenchRequest(list(range(10, 10 + n)), m) for n, m in ((5, 4), (17, 6), (9, 1))]
    best, rates = lcb.llama_cpp_baseline(str(gguf), workload, [1, 2])
    assert best.output_tokens == sum(r.output_len for r in workload)
    kind = lcb.gguf_file_type(gguf)
    assert best.gguf_type == kind and list(rates) == [kind]
    assert set(rates[kind]) == {1, 2} and all(rate > 0 for rate in rates[kind].values())


def test_the_commands_refuse_the_baseline_before_running_when_it_is_not_installed(monkeypatch, capsys):
    from pagedserve.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for command in ("throughput", "latency"):
        assert main(["bench", command, "--random-weights", "small", "--baseline", "llama-cpp", "--no-roofline"]) == 2
        assert "llama-cpp-python is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--baseline", "vllm"])
