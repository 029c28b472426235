"""Load a model from a GGUF file: find the file, map llama.cpp tensor names onto HF names, and
stream the weights tensor by tensor.

The file format is the `gguf` package's (`GGUFReader`); what is ours is the name mapping, undoing
llama.cpp's Q/K permutation, and the block formats (kernels/torch_impl/gguf_quant.py). A tensor in
one of `QUANTIZED_TYPES` is handed to the model as a lazy `QuantizedWeight` (its raw block rows in
the memory map): with ``quantization="gguf"`` the model's layers keep it quantized (`gguf_quant_config`
says which), otherwise each rank dequantizes only its own slice into float weights. Pipeline stages
skip other stages' tensors without reading them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import numpy as np

from pagedserve.engine.models.gguf_config import PERMUTED_QK_ARCHITECTURES, gguf_architecture, open_reader
from pagedserve.parallel.quant import GGUFQuantConfig, QuantizedWeight

logger = logging.getLogger(__name__)

# Block-quantized types the layers can keep quantized (GGMLQuantizationType names).
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Every type a GGUF file may use here: floats, and the quantized ones.
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", *QUANTIZED_TYPES)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors the engine derives itself: llama3-style RoPE frequency factors (see `gguf_weights`).
_SKIPPED = {"rope_freqs.weight"}


def find_gguf_file(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: the path itself if it is a ``.gguf`` file, else the one
    ``.gguf`` in a directory that holds no HF checkpoint (config.json); None for anything else.
    Raises ValueError for a directory with several GGUF files (name the one to load)."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"model: {str(model)!r} holds several GGUF files ({', '.join(f.name for f in files)}); "
                         "pass the path of the one to load")
    return files[0] if files else None


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor (None for tensors the engine skips)."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"model: unexpected tensor {gguf_name!r} in the GGUF file")


def check_quant_types(reader: Any) -> None:
    """Refuse a file with a tensor in a quant type we do not dequantize, naming the type."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            raise ValueError(
                f"model: GGUF quant type {tensor.tensor_type.name} (tensor {tensor.name!r}) is not supported; "
                f"supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
            )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of a Q or K projection (weight or bias).

    llama.cpp stores each head's rows with the two rotary halves interleaved (its RoPE pairs
    adjacent dims); HF's layout keeps the halves apart. Per head: rows (pairs, 2) -> (2, pairs).
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def unpermute_order(rows: int, num_heads: int) -> np.ndarray:
    """Row indices that undo llama.cpp's Q/K permutation (`unpermute_qk` as an index array)."""
    return unpermute_qk(torch.arange(rows).unsqueeze(1), num_heads).squeeze(1).numpy()


def is_quantized(tensor: Any) -> bool:
    return tensor.tensor_type.name in QUANTIZED_TYPES


def quantized_weight(tensor: Any) -> QuantizedWeight:
    """A block-quantized GGUF tensor as a lazy `QuantizedWeight` over the memory map."""
    rows, cols = (int(d) for d in reversed(tensor.shape))
    return QuantizedWeight(tensor.data, tensor.tensor_type.name, (rows, cols))


def gguf_quant_config(reader: Any) -> GGUFQuantConfig:
    """The weights of the file that the layers keep quantized: HF name -> quant type."""
    check_quant_types(reader)
    types = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is not None and is_quantized(tensor) and len(tensor.shape) == 2:
            types[name] = tensor.tensor_type.name
    return GGUFQuantConfig(types)


def has_quantized_weights(reader: Any) -> bool:
    return any(is_quantized(t) for t in reader.tensors)


def dequantize_tensor(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of ``dtype`` (its own shape, rows first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = tensor.data  # already floats: convert straight from the memory map
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.tensor(array.reshape(shape), dtype=dtype)


def gguf_weights(
    reader: Any,
    hf_config: Any,
    dtype: torch.dtype,
    wanted: Callable[[str], bool] = lambda name: True,
    progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for every weight ``wanted`` accepts: float tensors converted to ``dtype`` one at
    a time, block-quantized 2-D ones as lazy `QuantizedWeight`s (read when a layer copies its slice).

    Tensors ``wanted`` refuses (another pipeline stage's) are never read.
    """
    from tqdm.auto import tqdm

    arch = gguf_architecture(reader)
    check_quant_types(reader)
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        logger.warning("pagedserve: the GGUF file's rope_freqs (llama3 RoPE factors) are ignored, as "
                       "transformers' GGUF loader ignores them; long-context positions may differ from the original")
    for tensor in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        if name is None or not wanted(name):
            continue
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else None
        permuted = arch in PERMUTED_QK_ARCHITECTURES and heads is not None
        if is_quantized(tensor) and len(tensor.shape) == 2:
            qweight = quantized_weight(tensor)
            yield name, qweight.take_rows(unpermute_order(qweight.shape[0], heads)) if permuted else qweight
        else:
            weight = dequantize_tensor(tensor, dtype)
            yield name, unpermute_qk(weight, heads) if permuted else weight


def load_gguf_weights(model: torch.nn.Module, gguf_path: str | Path, hf_config: Any, dtype: torch.dtype,
                      progress: bool = True, reader: Any = None) -> set[str]:
    """Fill ``model`` (built for ``hf_config``) from the GGUF file; returns the parameter names filled."""
    reader = reader if reader is not None else open_reader(gguf_path)
    weights = gguf_weights(reader, hf_config, dtype, wanted=model.weight_on_stage, progress=progress)
    return model.load_weights(weights)


def load_gguf_tokenizer(gguf_path: str | Path) -> Any:
    """The tokenizer and chat template a GGUF file carries, through transformers' GGUF support."""
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
