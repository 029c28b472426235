"""Where an offload tier lives and how one block is stored there: one file per (rank, block hash).

The tier of an engine is a directory named by a digest of what makes KV interchangeable - the model's
identity, the KV layout (layers, KV heads, head size, dtype, block size, TP/PP) - with one subdirectory per
rank. Every engine on the node that serves the same model with the same layout finds the same directory,
so one engine loads what another spilled; engines that differ in any of these never meet. The file name is
the block's prefix-cache hash, which chains the whole prefix and the request's `cache_salt` (and whatever
else the engine puts in the chain), so a tenant can only ever find blocks of its own prefixes.

A block file holds this rank's layers, K then V per layer, behind a header naming the hash, the number of
layers, the bytes per layer and a CRC-32 per layer: a reader checks each layer before it uses it, so a
truncated, foreign or damaged file fails the load (the request recomputes) instead of feeding wrong KV.
Files appear atomically (written under a temporary name, then renamed): a name that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kv_transfer.layout import KVLayout

MAGIC = b"PSKVOFF1"
_HEADER = struct.Struct("<8s32sIQ")  # magic, block hash, layers, bytes per layer (K and V)
HOST_SHM = "/dev/shm"


class CorruptBlockFile(ValueError):
    """A tier file that is not the block it is named for (wrong header, size or checksum)."""


@dataclass(frozen=True)
class TierLocation:
    """One engine's view of its tier: the name ("host" or "disk") and its namespace directory."""

    name: str
    namespace: Path
    world_size: int

    def rank_dir(self, rank: int) -> Path:
        return self.namespace / f"rank{rank}"

    def block_path(self, rank: int, block_hash: bytes) -> Path:
        return self.rank_dir(rank) / block_hash.hex()

    def on_node(self, block_hash: bytes) -> bool:
        """Whether every rank's file of the block exists (someone on this node stored it)."""
        name = block_hash.hex()
        return all(os.path.exists(self.namespace / f"rank{rank}" / name) for rank in range(self.world_size))


def tier_location(model_identity: str, layout: KVLayout, offload_dir: str | None) -> TierLocation:
    """The tier's directory: under `offload_dir` ("disk") or host shared memory ("host"), named by the model
    and the KV layout so that only engines whose KV is interchangeable share it."""
    if offload_dir is not None:
        name, root = "disk", Path(offload_dir)
    else:
        shm_ok = os.path.isdir(HOST_SHM) and os.access(HOST_SHM, os.W_OK)
        name, root = "host", Path(HOST_SHM if shm_ok else tempfile.gettempdir())
    key = json.dumps({"model": model_identity, "layout": layout.to_dict()}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return TierLocation(name, root / f"pagedserve-kv-{digest}", layout.world_size)


def make_rank_dir(location: TierLocation, rank: int) -> Path:
    path = location.rank_dir(rank)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def write_block(path: Path, block_hash: bytes, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
    """Write one block (per layer its K and V, host tensors) atomically; returns the bytes written."""
    parts: list[memoryview] = []
    crcs = []
    for k, v in zip(keys, values):
        kb, vb = _bytes(k), _bytes(v)
        parts += [kb, vb]
        crcs.append(zlib.crc32(vb, zlib.crc32(kb)))
    layer_bytes = len(parts[0]) + len(parts[1]) if parts else 0
    header = _HEADER.pack(MAGIC, block_hash, len(keys), layer_bytes) + struct.pack(f"<{len(crcs)}I", *crcs)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.writev(fd, [header, *parts])
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return len(header) + layer_bytes * len(keys)


class BlockFile:
    """One block's file, opened for reading layer by layer (an open file survives its unlinking)."""

    def __init__(self, path: Path, block_hash: bytes, num_layers: int, layer_bytes: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(self.fd, _HEADER.size + 4 * num_layers, 0)
            if len(head) != _HEADER.size + 4 * num_layers:
                raise CorruptBlockFile(f"{path.name}: truncated header")
            magic, stored_hash, layers, nbytes = _HEADER.unpack_from(head)
            if magic != MAGIC or stored_hash != block_hash or layers != num_layers or nbytes != layer_bytes:
                raise CorruptBlockFile(f"{path.name}: the header does not describe this block of this layout")
            self.crcs = struct.unpack_from(f"<{num_layers}I", head, _HEADER.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.name = path.name
        self.layer_bytes = layer_bytes
        self.offset = _HEADER.size + 4 * num_layers

    def read_layer(self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Read `layer`'s K and V into the (contiguous, host) tensors, checking the layer's CRC."""
        kb, vb = _bytes(k_out), _bytes(v_out)
        got = os.preadv(self.fd, [kb, vb], self.offset + layer * self.layer_bytes)
        if got != self.layer_bytes or len(kb) + len(vb) != self.layer_bytes:
            raise CorruptBlockFile(f"{self.name}: layer {layer} is truncated")
        if zlib.crc32(vb, zlib.crc32(kb)) != self.crcs[layer]:
            raise CorruptBlockFile(f"{self.name}: layer {layer} fails its checksum")

    def close(self) -> None:
        os.close(self.fd)


def block_bytes(layout: KVLayout, rank: int) -> int:
    """Bytes of one block's K and V on `rank` (its layers and KV heads)."""
    element = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * len(layout.layers_of(rank)) * layout.block_size * len(layout.heads_of(rank)) * layout.head_size * element


def read_block_blob(path: Path, block_hash: bytes, max_bytes: int) -> bytes:
    """One block file's bytes, whole (header included), checked with `check_block_blob` (FileNotFoundError
    when the tier does not hold it, CorruptBlockFile when the file is not that block)."""
    fd = os.open(path, os.O_RDONLY)  # (an open file survives its unlinking by the LRU)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CorruptBlockFile(f"{path.name}: {size} bytes, more than a block of this layout")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    check_block_blob(data, block_hash, max_bytes)
    return data


def check_block_blob(data: bytes, block_hash: bytes, max_bytes: int) -> tuple[int, int]:
    """That `data` is a whole block file of `block_hash` (magic, hash, size and every layer's CRC-32):
    returns (layers, bytes per layer); raises CorruptBlockFile otherwise."""
    if not isinstance(data, (bytes, bytearray)) or not _HEADER.size <= len(data) <= max_bytes:
        raise CorruptBlockFile("not a block file (size)")
    magic, stored_hash, layers, layer_bytes = _HEADER.unpack_from(data)
    if magic != MAGIC or stored_hash != block_hash:
        raise CorruptBlockFile("the header does not name this block")
    offset = _HEADER.size + 4 * layers
    if len(data) != offset + layers * layer_bytes:
        raise CorruptBlockFile("truncated or padded")
    crcs = struct.unpack_from(f"<{layers}I", data, _HEADER.size)
    view = memoryview(data)
    for layer in range(layers):
        start = offset + layer * layer_bytes
        if zlib.crc32(view[start:start + layer_bytes]) != crcs[layer]:
            raise CorruptBlockFile(f"layer {layer} fails its checksum")
    return layers, layer_bytes


def install_block_blob(path: Path, data: bytes) -> None:
    """Place a checked block file atomically (a name that exists is complete)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.recv.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view, written = memoryview(data), 0
        while written < len(view):
            written += os.write(fd, view[written:])
    finally:
        os.close(fd)
    os.replace(tmp, path)
