"""Copies of a GGUF file with its weights re-stored in another GGUF type, for the llama.cpp baseline.

llama.cpp's fastest configuration on a machine is not always the file a user downloaded: on a CPU with
native bf16 a BF16 file may decode faster than the Q4_1 one it came from. `bench throughput|latency
--llama-cpp-types` runs llama.cpp on such copies beside the file itself, so that "llama.cpp's best" is
measured rather than assumed. A copy holds the same metadata (the tokenizer, the chat template, the
hyperparameters; `general.file_type` set to the new type) and every matrix of the file dequantized and
stored as the target type: F32 keeps the file's weights exactly, F16 / BF16 / Q8_0 round them once more
(as a user converting the original checkpoint would get slightly different numbers anyway). Vectors
(norms, biases) stay F32, as llama.cpp's converter writes them; a matrix whose rows do not fill Q8_0's
32-element blocks is stored as F16 in a Q8_0 copy.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from pagedserve.engine.models.gguf_config import open_reader

# The types a copy may be written in (the GGUF quant type name) and the file type each declares.
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
CONVERTIBLE_TYPES = tuple(_FILE_TYPES)


def gguf_file_type(path: Path) -> str:
    """The GGUF type most of a file's matrices are stored in (e.g. "Q4_1"), as llama.cpp's name for it."""
    reader = open_reader(path)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return counts.most_common(1)[0][0] if counts else "F32"


def _stored_type(shape: tuple[int, ...], target: str) -> str:
    """The type a tensor of numpy `shape` is written in: vectors F32, matrices `target` (F16 for a Q8_0
    copy's rows that do not fill its 32-element blocks)."""
    if len(shape) < 2:
        return "F32"
    return "F16" if target == "Q8_0" and shape[-1] % 32 else target


def _add_info(writer, name: str, shape: tuple[int, ...], kind: str) -> None:
    """Declare a tensor of numpy `shape` stored as `kind` (its data is written later, one tensor at a time)."""
    import gguf

    count = int(np.prod(shape))
    if kind in ("F32", "F16"):
        dtype = np.float32 if kind == "F32" else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), count * np.dtype(dtype).itemsize)
        return
    qtype = gguf.GGMLQuantizationType[kind]
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)


def _stored(values: np.ndarray, kind: str) -> np.ndarray:
    """Float32 `values` as the bytes (or floats) of `kind`."""
    import gguf

    if kind == "F32":
        return values.astype(np.float32)
    if kind == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[kind])


def convert_gguf(source: Path, destination: Path, target: str) -> Path:
    """Write `destination`: `source` with its matrices stored as `target` (one of CONVERTIBLE_TYPES). One
    tensor is converted at a time (a 7B model's F32 copy is 28 GB: it is streamed to disk, not held)."""
    import gguf

    if target not in CONVERTIBLE_TYPES:
        raise ValueError(f"--llama-cpp-types: cannot write a {target!r} copy; choose from "
                         f"{', '.join(CONVERTIBLE_TYPES)} (or 'file' for the file itself)")
    reader = open_reader(source)
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(destination, arch=str(arch_field.contents()))
    file_type = int(gguf.LlamaFileType[_FILE_TYPES[target]])
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(file_type)
    plan = []
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        kind = _stored_type(shape, target)
        _add_info(writer, tensor.name, shape, kind)
        plan.append((tensor, shape, kind))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor, shape, kind in plan:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            writer.write_tensor_data(_stored(values, kind))
    finally:
        writer.close()
    return destination
