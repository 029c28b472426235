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

from pathlib import Path

import numpy as np

# The types a copy may be written in (the GGUF quant type name) and the file type each declares.
CONVERTIBLE_TYPES = ("F32", "F16", "BF16", "Q8_0")
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}


def gguf_file_type(path: Path) -> str:
    """The GGUF type most of a file's matrices are stored in (e.g. "Q4_1"), as llama.cpp's name for it."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(path)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return counts.most_common(1)[0][0] if counts else "F32"


def _store(values: np.ndarray, target: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor: float32 `values` [..., K] stored as `target`."""
    import gguf

    qtype = gguf.GGMLQuantizationType
    if target == "F32":
        return values.astype(np.float32), None
    if target == "F16" or (target == "Q8_0" and values.shape[-1] % 32):
        return values.astype(np.float16), None
    return gguf.quants.quantize(values.astype(np.float32), qtype[target]), qtype[target]


def convert_gguf(source: Path, destination: Path, target: str) -> Path:
    """Write `destination`: `source` with its matrices stored as `target` (one of CONVERTIBLE_TYPES)."""
    import gguf

    if target not in CONVERTIBLE_TYPES:
        raise ValueError(f"--llama-cpp-types: cannot write a {target!r} copy; choose from "
                         f"{', '.join(CONVERTIBLE_TYPES)} (or 'file' for the file itself)")
    reader = gguf.GGUFReader(source)
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(destination, arch=str(arch_field.contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[target]]))
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[target]]))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if len(tensor.shape) < 2:
            writer.add_tensor(tensor.name, values.astype(np.float32))
            continue
        array, raw_dtype = _store(values, target)
        writer.add_tensor(tensor.name, array, raw_dtype=raw_dtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return destination
