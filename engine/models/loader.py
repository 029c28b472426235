"""Build a model and fill it from a checkpoint, reading only this rank's shards: a safetensors
directory, or a GGUF file (gguf_loader.py) dequantized tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedserve.engine.device_limits import auto_dtype, cpu_has_native_bf16
from pagedserve.engine.models.gguf_config import open_reader
from pagedserve.engine.models.gguf_loader import find_gguf_file, gguf_quant_config, load_gguf_weights
from pagedserve.engine.models.registry import get_model_class
from pagedserve.parallel.quant import RTNQuantConfig
from pagedserve.parallel.state import ParallelContext

# quantization="int8" / "int4" of a float checkpoint: the block format its linear layers are stored in.
RTN_WEIGHT_TYPES = {"int8": "Q8_0", "int4": "Q4_1"}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str, hf_config: Any, device: str | torch.device = "cpu") -> torch.dtype:
    """"auto" -> the checkpoint's dtype from the config (float32 if absent), run as bf16/fp16 on CUDA
    and as bf16 on a CPU with native bf16 matmuls when that is float32 (device_limits.auto_dtype); else a
    named dtype."""
    if dtype == "auto":
        device_type = torch.device(device).type
        bf16 = torch.cuda.is_bf16_supported() if device_type == "cuda" else cpu_has_native_bf16()
        return auto_dtype(_checkpoint_dtype(hf_config), device_type, bf16)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The config's `dtype` (transformers 5 maps a config file's `torch_dtype` onto it); an old config
    object with only a `torch_dtype` attribute is read from its instance dict, because on transformers 5's
    PretrainedConfig `torch_dtype` is a deprecated alias of `dtype` that warns when read."""
    cfg_dtype = getattr(hf_config, "dtype", None)
    if cfg_dtype is None:
        cfg_dtype = getattr(hf_config, "__dict__", {}).get("torch_dtype")
    if isinstance(cfg_dtype, torch.dtype):
        return cfg_dtype
    if isinstance(cfg_dtype, str):
        name = cfg_dtype.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    return torch.float32


def checkpoint_files(model_path: str) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded via the index, or all *.safetensors)."""
    root = Path(model_path)
    if not root.is_dir():
        raise ValueError(f"model_path {model_path!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = [root / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ValueError(f"checkpoint shards listed in {index} are missing: {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model_path {model_path!r}")
    return files


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    parallel: ParallelContext,
    device: str | torch.device = "cpu",
    max_position: int | None = None,
    quantization: str | None = None,
) -> torch.nn.Module:
    """Build the model for ``hf_config`` on ``device`` and load its weights (eval mode, no grad).

    ``model_path`` is a safetensors directory or a GGUF file (or a directory holding one).
    Weights of other pipeline stages are never read; sharded layers read only this
    rank's slice through safetensors' lazy ``get_slice`` (GGUF: of the block rows). Raises ValueError for
    weights the model does not know and for parameters the checkpoint lacks. `max_position`
    (max_model_len) sizes the RoPE cache when it exceeds max_position_embeddings (RoPE scaling).
    `quantization` "gguf" (or "auto") keeps a GGUF file's block-quantized weights quantized
    (EngineConfig.quantization); "none" or None loads them dequantized to ``dtype``; "int8" / "int4"
    quantize a float checkpoint's linear layers at load (RTN_WEIGHT_TYPES).
    """
    model_cls = get_model_class(hf_config)
    gguf_file = find_gguf_file(model_path)
    files = [] if gguf_file is not None else checkpoint_files(model_path)
    reader = open_reader(gguf_file) if gguf_file is not None else None
    quant_config = gguf_quant_config(reader) if reader is not None and quantization in ("gguf", "auto") else None
    if quantization in RTN_WEIGHT_TYPES:
        quant_config = RTNQuantConfig(RTN_WEIGHT_TYPES[quantization])
    with torch.device(device), torch.no_grad():
        model = model_cls(hf_config, dtype=dtype, parallel=parallel, max_position=max_position,
                          quant_config=quant_config)
    loaded: set[str] = set()
    with torch.no_grad():
        if gguf_file is not None:
            loaded = load_gguf_weights(model, gguf_file, hf_config, dtype, progress=parallel.rank == 0, reader=reader)
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = [n for n in f.keys() if model.weight_on_stage(n)]
                loaded |= model.load_weights((n, f.get_slice(n)) for n in names)
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {model_path!r} lacks weights for: {missing}")
    model.eval()
    model.requires_grad_(False)
    return model
