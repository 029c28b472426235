"""GGUF loading on small files the tests write with `gguf.GGUFWriter`.

Each supported quant type, a Llama (Q/K permuted by llama.cpp's convention) and a Qwen2 (q/k/v
biases, not permuted) architecture, tied and untied embeddings. The reference for every parameter
is the writer's own tensor run through `gguf.quants.dequantize`, un-permuted here by index
arithmetic (independent of the loader's reshape), then loaded through the safetensors-style
`load_weights` path. transformers' GGUF loader is the second oracle for the same files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedserve.engine.config import EngineConfig  # noqa: E402
from pagedserve.engine.models.gguf_config import open_reader  # noqa: E402
from pagedserve.engine.models.gguf_loader import SUPPORTED_QUANT_TYPES, find_gguf_file  # noqa: E402
from pagedserve.engine.models.loader import load_model  # noqa: E402
from pagedserve.engine.models.registry import get_model_class  # noqa: E402
from pagedserve.parallel.state import ParallelContext  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 128, 96, 2
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": 1 + w(HIDDEN, scale=0.05)}
    if not tied:
        out["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN, scale=0.05),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN, scale=0.05),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
            p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        }
        if arch == "qwen2":
            out |= {p + "self_attn.q_proj.bias": w(HEADS * HEAD_DIM), p + "self_attn.k_proj.bias": w(KV_HEADS * HEAD_DIM),
                    p + "self_attn.v_proj.bias": w(KV_HEADS * HEAD_DIM)}
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K permutation (each head's rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def undo_permutation(stored: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_cpp_permute` by index arithmetic: where did each original row go?"""
    rows = llama_cpp_permute(np.arange(stored.shape[0]), n_head)
    original = np.empty_like(stored)
    original[rows] = stored
    return original


def new_writer(path, arch: str):
    """A GGUFWriter with the tiny model's metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    return writer


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(path, arch: str, weights: dict[str, np.ndarray], qtype_name: str) -> dict[str, torch.Tensor]:
    """Write a GGUF file for ``weights`` (matrices in ``qtype_name``, vectors F32); returns the
    HF-named reference tensors the loader must produce (dequantized, un-permuted)."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = new_writer(path, arch)
    reference: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        heads = HEADS if ".q_proj." in name else KV_HEADS if ".k_proj." in name else None
        permuted = arch == "llama" and heads is not None
        stored = llama_cpp_permute(w, heads) if permuted else w
        if w.ndim == 2:
            data = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        else:
            writer.add_tensor(gguf_name(name), stored)
            back = stored
        reference[name] = torch.from_numpy(np.ascontiguousarray(undo_permutation(back, heads) if permuted else back))
    finish(writer)
    return reference


def reference_model(hf_config, reference: dict[str, torch.Tensor], parallel: ParallelContext) -> torch.nn.Module:
    model = get_model_class(hf_config)(hf_config, dtype=torch.float32, parallel=parallel)
    with torch.no_grad():
        model.load_weights(reference.items())
    return model


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# The K-quants need 256-wide rows and cannot be written by the gguf package: tests/test_gguf_quantized.py.
@pytest.mark.parametrize("qtype", [q for q in SUPPORTED_QUANT_TYPES if not q.endswith("_K")])
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_each_quant_type_loads_to_the_dequantized_reference(tmp_path, qtype, arch, tied):
    path = tmp_path / "m.gguf"
    weights = hf_weights(arch, tied)
    reference = write_gguf(path, arch, weights, qtype)
    if qtype == "F32":  # lossless: the mapping and un-permutation give back the original weights
        assert all(np.array_equal(reference[n].numpy(), w) for n, w in weights.items())
    config = EngineConfig(model=str(path)).resolve()
    hf_config = config.hf_config
    assert hf_config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert hf_config.tie_word_embeddings is tied
    assert (hf_config.num_hidden_layers, hf_config.num_key_value_heads, hf_config.vocab_size) == (LAYERS, KV_HEADS, VOCAB)
    model = load_model(str(path), hf_config, torch.float32, ParallelContext.single())
    assert_same_params(model, reference_model(hf_config, reference, ParallelContext.single()))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_transformers_gguf_loader_agrees(tmp_path, arch, tied):
    """The same file through transformers (`gguf_file=`): its weights equal our reference, so our
    un-permutation is the one HF applies."""
    from transformers import AutoModelForCausalLM

    reference = write_gguf(tmp_path / "m.gguf", arch, hf_weights(arch, tied, seed=1), "Q8_0")
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    hf_params = dict(hf_model.named_parameters())
    for name, tensor in reference.items():
        assert torch.equal(hf_params[name].detach(), tensor), name
    config = EngineConfig(model=str(tmp_path)).resolve()  # a directory holding one GGUF file
    assert config.hf_config.tie_word_embeddings == hf_model.config.tie_word_embeddings == tied


@pytest.mark.parametrize("tp_rank,pp_rank", [(0, 0), (1, 0), (1, 1)])
def test_sharded_load_slices_after_dequantization(tmp_path, tp_rank, pp_rank):
    """TP ranks hold their slice of the dequantized tensors; PP stages load only their layers."""
    path = tmp_path / "m.gguf"
    reference = write_gguf(path, "llama", hf_weights("llama", tied=True), "Q4_1")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    ctx = ParallelContext(rank=pp_rank * 2 + tp_rank, world_size=4, tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank,
                          pp_size=2)
    model = load_model(str(path), hf_config, torch.float32, ctx)
    assert model.end_layer - model.start_layer == 1
    assert_same_params(model, reference_model(hf_config, reference, ctx))


def test_unsupported_quant_type_is_refused_by_name(tmp_path):
    path = tmp_path / "k.gguf"
    qtype = gguf.GGMLQuantizationType.Q2_K
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    writer = new_writer(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 256 // block * nbytes), dtype=np.uint8), raw_dtype=qtype)
    finish(writer)
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    with pytest.raises(ValueError, match="quant type Q2_K"):
        load_model(str(path), hf_config, torch.float32, ParallelContext.single())


def test_our_reader_reads_what_gguf_reads_from_the_same_map(tmp_path):
    """open_reader reads the file through a plain view of gguf's memory map (a faster way to the same
    bytes): every metadata field and tensor as `gguf.GGUFReader` has it, and tensor data still views the
    file instead of a copy in memory."""
    path = tmp_path / "vocab.gguf"
    writer = new_writer(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_token_merges([f"t{i} ok{i}" for i in range(50)])
    writer.add_token_types([1] * VOCAB)
    writer.add_tensor("token_embd.weight", np.arange(VOCAB * HIDDEN, dtype=np.float32).reshape(VOCAB, HIDDEN))
    q = gguf.quants.quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64),
                             gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    finish(writer)
    ours, theirs = open_reader(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == VOCAB
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        np.testing.assert_array_equal(mine.data, reference.data)
        assert not mine.data.flags.owndata  # a view of the map: nothing read into memory
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)


def test_model_path_resolution(tmp_path):
    gguf_dir = tmp_path / "one"
    gguf_dir.mkdir()
    write_gguf(gguf_dir / "a.gguf", "llama", hf_weights("llama", tied=True), "F16")
    assert find_gguf_file(gguf_dir) == gguf_dir / "a.gguf" == find_gguf_file(gguf_dir / "a.gguf")
    (gguf_dir / "b.gguf").write_bytes((gguf_dir / "a.gguf").read_bytes())
    with pytest.raises(ValueError, match="several GGUF files"):
        EngineConfig(model=str(gguf_dir)).resolve()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a directory nor a .gguf file"):
        EngineConfig(model=str(tmp_path / "notes.txt")).resolve()
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(model=str(tmp_path / "absent.gguf")).resolve()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        EngineConfig(model=str(tmp_path / "junk.gguf")).resolve()


def test_dtype_of_a_gguf_config_is_read_without_the_deprecated_alias(tmp_path, monkeypatch):
    """Issue 34: a GGUF file's config has no dtype, and reading `config.torch_dtype` for it made transformers 5
    warn that `torch_dtype` is deprecated. `dtype` is read; `torch_dtype` only as an old config's plain attribute."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from pagedserve.engine.models.loader import resolve_dtype

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=True), "F16")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    assert hf_config.dtype is None

    def deprecated(self):
        raise AssertionError("read the deprecated PretrainedConfig.torch_dtype")

    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(deprecated))
    # (On a CPU without native bf16 matmuls "auto" keeps a GGUF file's float32; pinned so the check holds anywhere.)
    monkeypatch.setattr("pagedserve.engine.models.loader.cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", hf_config) == torch.float32
    # An old config object with only `torch_dtype` still names its dtype.
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="bfloat16")) == torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(dtype=torch.float16, torch_dtype="bfloat16")) == torch.float16
