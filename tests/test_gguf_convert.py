"""`bench ... --llama-cpp-types`: copies of a GGUF file in another type (bench/gguf_convert.py), written
from small files the tests make with `gguf.GGUFWriter`, read back with `gguf.GGUFReader` and loaded by
our own GGUF loader; and the llama.cpp baseline sweeping the types (against the fake `llama_cpp`)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagedserve.bench import llama_cpp_baseline as lcb  # noqa: E402
from pagedserve.bench.gguf_convert import CONVERTIBLE_TYPES, convert_gguf, gguf_file_type  # noqa: E402
from pagedserve.bench.workload import BenchRequest  # noqa: E402
from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from tests.test_gguf_loader import VOCAB, finish, hf_weights, new_writer, write_gguf  # noqa: E402
from tests.test_llama_cpp_baseline import FakeLlamaCpp  # noqa: E402

FILE_TYPE = gguf.Keys.General.FILE_TYPE
EXPECTED_FILE_TYPE = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                      "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def values(tensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


@pytest.fixture
def q4_1_file(tmp_path):
    path = tmp_path / "model.Q4_1.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=False, seed=5), "Q4_1")
    return path


@pytest.mark.parametrize("target", CONVERTIBLE_TYPES)
def test_a_copy_holds_the_files_metadata_and_its_weights_stored_as_the_type(tmp_path, q4_1_file, target):
    copy = convert_gguf(q4_1_file, tmp_path / f"copy.{target}.gguf", target)
    source, written = gguf.GGUFReader(q4_1_file), gguf.GGUFReader(copy)
    assert gguf_file_type(q4_1_file) == "Q4_1" and gguf_file_type(copy) == target
    expected = fields(source)
    expected[FILE_TYPE] = int(EXPECTED_FILE_TYPE[target])
    assert fields(written) == expected
    originals = {t.name: t for t in source.tensors}
    assert [t.name for t in written.tensors] == list(originals)
    for tensor in written.tensors:
        original = originals[tensor.name]
        assert list(tensor.shape) == list(original.shape), tensor.name
        weights = values(original)
        if len(original.shape) < 2:  # vectors (norms) stay float32, unchanged
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(values(tensor), weights)
            continue
        assert tensor.tensor_type == gguf.GGMLQuantizationType[target], tensor.name
        # The file's weights (dequantized), rounded once into the target type: exactly so.
        once = gguf.quants.dequantize(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[target]),
                                      gguf.GGMLQuantizationType[target])
        np.testing.assert_array_equal(values(tensor), once)
        if target == "F32":
            np.testing.assert_array_equal(values(tensor), weights)


def test_an_f32_copy_is_the_same_model_to_our_loader(tmp_path, tokenizer_dir, q4_1_file):
    """Same weights, same tokens: the copy carries everything a GGUF reader needs (config, tensor layout)."""
    copy = convert_gguf(q4_1_file, tmp_path / "copy.F32.gguf", "F32")
    prompts = [{"prompt_token_ids": np.random.default_rng(n).integers(8, VOCAB, n).tolist()} for n in (4, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for path in (q4_1_file, copy):
        llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), dtype="float32", kv_cache_memory="8MiB")
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


def test_a_q8_0_copy_keeps_rows_that_do_not_fill_its_blocks_in_f16(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = new_writer(path, "llama")
    odd = np.random.default_rng(0).standard_normal((4, 48)).astype(np.float32)  # 48: not a multiple of 32
    writer.add_tensor("odd.weight", odd)
    finish(writer)
    copy = gguf.GGUFReader(convert_gguf(path, tmp_path / "odd.Q8_0.gguf", "Q8_0"))
    (tensor,) = copy.tensors
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F16
    np.testing.assert_array_equal(values(tensor), odd.astype(np.float16).astype(np.float32))


def test_types_are_validated_and_named():
    assert lcb.parse_llama_cpp_types("file") == ["file"]
    assert lcb.parse_llama_cpp_types(" File, bf16,F32 ,bf16,") == ["file", "BF16", "F32"]
    with pytest.raises(ValueError, match="--llama-cpp-types: 'Q4_K' is not"):
        lcb.parse_llama_cpp_types("file,Q4_K")
    with pytest.raises(ValueError, match="--llama-cpp-types: expected at least one"):
        lcb.parse_llama_cpp_types(" , ")
    with pytest.raises(ValueError, match="--llama-cpp-types"):
        convert_gguf("unused.gguf", "unused-copy.gguf", "Q4_1")


def test_the_baseline_sweeps_every_type_and_removes_its_copies(monkeypatch, q4_1_file):
    fake = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    loaded = []
    original_load = fake.llama_model_load_from_file

    def load(path, params):
        loaded.append((path.decode(), gguf_file_type(path.decode())))  # the copy exists while it runs
        return original_load(path, params)

    monkeypatch.setattr(fake, "llama_model_load_from_file", load)
    workload = [BenchRequest([3, 4, 5], 4), BenchRequest([7, 8], 3)]
    # The file's own type named as such runs the file itself, once.
    best, rates = lcb.llama_cpp_baseline(str(q4_1_file), workload, [1, 2], types=["file", "F32", "Q4_1"])
    assert list(rates) == ["Q4_1", "F32"] and all(set(r) == {1, 2} for r in rates.values())
    assert best.gguf_type in rates and best.output_tokens == 7
    runs_per_load = [kind for _, kind in loaded]
    assert runs_per_load == ["Q4_1"] * 2 + ["F32"] * 2  # each type, each batch size
    copies = {path for path, kind in loaded if kind == "F32"}
    assert len(copies) == 1 and not any(os.path.exists(p) for p in copies)
    assert {path for path, kind in loaded if kind == "Q4_1"} == {str(q4_1_file)}
