"""The offload tier's worker half: copy evicted blocks out before they are overwritten, write them to the
tier in the background, and load tier blocks back layer by layer beside the forward pass.

Spilling. The scheduler names the blocks it evicted while scheduling this step (`OffloadMetadata.stores`);
they are free and no batch in flight writes them, and this step's forward pass is the first that may. So
`start_load_kv`, before the forward pass, gathers each of them per layer into a host staging copy (one
gather per layer: the only work on the step's path, timed in `stats.stage_seconds`); a writer thread turns
staged blocks into files. Until a block's file is written, a load of it on this rank reads the staging copy.
Staged bytes are bounded (`max_staged_bytes`): past it a spill is skipped (counted), and a later load of
that block fails over to recomputing.

Loading. One loader thread per rank reads this step's loads layer by layer - layer 0 of every load, then
layer 1, ... - checking each layer's checksum; the attention of layer i waits for layer i only
(`wait_for_layer_load`) and copies it into the request's blocks, so reading later layers overlaps the
compute of earlier ones. A load that fails anywhere (a missing, foreign or damaged file, a timeout) is
reported by `finish_loads` and its request recomputes; the blocks it wrote are its own (no other request
can hit them before the load landed).

Drops delete files after everything queued before them; an engine deletes the files it wrote when it shuts
down. Files are shared by name: if two engines store the same block, either one's drop removes it and the
other's later load of it fails over to recomputing.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from pagedserve.kv_transfer.base import KVConnectorWorker
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.offload.scheduler_side import OffloadLoadJob, OffloadMetadata
from pagedserve.kv_transfer.offload.tier_files import BlockFile, TierLocation, make_rank_dir, write_block

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 60.0


@dataclass
class _Staged:
    """Blocks copied out of the cache in one step: per layer K and V [n, block, heads, head_size] on the host."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    ready: torch.cuda.Event | None
    nbytes: int

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class OffloadWorkerStats:
    """This rank's side of the tier (read by tests and benchmarks through the executor)."""

    staged_blocks: int = 0
    stage_seconds: float = 0.0  # step-thread time spent gathering evicted blocks (the spill's only cost there)
    written_blocks: int = 0
    written_bytes: int = 0
    skipped_stores: int = 0  # staging full or a write that failed
    deleted_blocks: int = 0
    loaded_bytes: int = 0


@dataclass
class _Load:
    job: OffloadLoadJob
    block_ids: torch.Tensor  # the request's blocks the load writes, on the cache's device
    sources: list  # per block: (_Staged, index) or a file path
    layers: list = field(default_factory=list)  # per layer (K, V) once read
    ready: list = field(default_factory=list)  # per layer threading.Event
    error: str | None = None


class OffloadConnectorWorker(KVConnectorWorker):
    def __init__(self, location: TierLocation, layout: KVLayout, rank: int, device: torch.device,
                 max_staged_bytes: int, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.location = location
        self.layout = layout
        self.rank = rank
        self.device = device
        self.max_staged_bytes = max_staged_bytes
        self.read_timeout_s = read_timeout_s
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stats = OffloadWorkerStats()
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[int, _Staged, int]] = {}  # hash -> (generation, staging, index)
        self._owned: set[bytes] = set()  # hashes whose files this rank wrote and has not deleted
        self._staged_bytes = 0
        self._generation = itertools.count()
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._loads: list[_Load] = []
        self._loader: threading.Thread | None = None
        self._cancel = threading.Event()
        self._step_bytes = 0
        self._step_started = 0.0

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        self.dir = make_rank_dir(self.location, self.rank)
        block_shape = tuple(kv_caches[0][0].shape[1:]) if kv_caches else ()
        self.block_shape = block_shape
        self.dtype = kv_caches[0][0].dtype if kv_caches else torch.float32
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-offload-writer-{self.rank}", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ the step

    def start_load_kv(self, metadata: OffloadMetadata | None) -> None:
        self._loads = []
        self._step_bytes = 0
        self._step_started = time.perf_counter()
        if metadata is None:
            return
        if metadata.stores:
            self._stage(metadata.stores)
        if metadata.drops:
            self._writes.put(("drop", list(metadata.drops)))
        if metadata.adopts:
            self._writes.put(("adopt", list(metadata.adopts)))
        if metadata.loads:
            self._start_loads(metadata.loads)

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t  # (index_select already made the copy)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _stage(self, stores: list[tuple[int, bytes]]) -> None:
        started = time.perf_counter()
        per_block = 2 * len(self.kv_caches) * self._block_numel() * self.dtype.itemsize
        nbytes = per_block * len(stores)
        with self._lock:
            if self._staged_bytes + nbytes > self.max_staged_bytes:
                self.stats.skipped_stores += len(stores)
                logger.warning("KV offload: %d evicted blocks not spilled (the writer is behind: %d bytes staged)",
                               len(stores), self._staged_bytes)
                return
            self._staged_bytes += nbytes
        ids = torch.tensor([block_id for block_id, _ in stores], dtype=torch.long, device=self.kv_caches[0][0].device)
        keys = [self._host_copy(k.index_select(0, ids)) for k, _ in self.kv_caches]
        values = [self._host_copy(v.index_select(0, ids)) for _, v in self.kv_caches]
        ready = None
        if ids.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        staged = _Staged(keys, values, ready, nbytes)
        hashes = [block_hash for _, block_hash in stores]
        with self._lock:
            entries = []
            for i, block_hash in enumerate(hashes):
                generation = next(self._generation)
                self._pending[block_hash] = (generation, staged, i)
                entries.append((block_hash, generation))
        self._writes.put(("store", entries, staged))
        self.stats.staged_blocks += len(stores)
        self.stats.stage_seconds += time.perf_counter() - started

    def _block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    def _start_loads(self, jobs: list[OffloadLoadJob]) -> None:
        self._cancel.set()  # a previous step's loader that was abandoned (a failed forward) stops
        if self._loader is not None:
            self._loader.join()
        self._cancel = threading.Event()
        bs = self.layout.block_size
        device = self.kv_caches[0][0].device
        with self._lock:
            for job in jobs:
                first = job.token_start // bs
                sources = []
                for block_hash in job.hashes:
                    pending = self._pending.get(block_hash)
                    sources.append((pending[1], pending[2]) if pending else self.location.block_path(self.rank, block_hash))
                ids = torch.tensor(job.block_ids[first : first + len(job.hashes)], dtype=torch.long, device=device)
                load = _Load(job, ids, sources, [None] * len(self.kv_caches),
                             [threading.Event() for _ in self.kv_caches])
                self._loads.append(load)
        self._loader = threading.Thread(target=self._read_loop, args=(list(self._loads), self._cancel),
                                        name=f"kv-offload-loader-{self.rank}", daemon=True)
        self._loader.start()

    def _read_loop(self, loads: list[_Load], cancel: threading.Event) -> None:
        """Layer 0 of every load, then layer 1, ...: each layer is handed over as soon as it is read."""
        files: dict[int, list] = {}
        pin = self.device.type == "cuda"
        try:
            for i, load in enumerate(loads):
                try:
                    files[i] = [self._open(src, load.job) for src in load.sources]
                except Exception as exc:  # noqa: BLE001 - the request recomputes
                    self._fail(load, exc)
            for layer in range(len(self.kv_caches)):
                for i, load in enumerate(loads):
                    if cancel.is_set():
                        return
                    if load.error is None:
                        try:
                            load.layers[layer] = self._read_layer(files[i], layer, pin)
                        except Exception as exc:  # noqa: BLE001
                            self._fail(load, exc)
                    load.ready[layer].set()
        finally:
            for opened in files.values():
                for src in opened:
                    if isinstance(src, BlockFile):
                        src.close()
            for load in loads:  # (a cancelled or failed reader leaves nobody waiting)
                for event in load.ready:
                    event.set()

    def _open(self, src, job: OffloadLoadJob):
        if isinstance(src, tuple):
            return src
        block_hash = bytes.fromhex(src.name)
        layer_bytes = 2 * self._block_numel() * self.dtype.itemsize
        return BlockFile(src, block_hash, len(self.kv_caches), layer_bytes)

    def _read_layer(self, sources: list, layer: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(sources), *self.block_shape)
        k = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        v = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        for i, src in enumerate(sources):
            if isinstance(src, BlockFile):
                src.read_layer(layer, k[i], v[i])
            else:
                staged, index = src
                staged.wait()
                k[i].copy_(staged.keys[layer][index])
                v[i].copy_(staged.values[layer][index])
        return k, v

    def _fail(self, load: _Load, exc: BaseException) -> None:
        if load.error is None:
            load.error = f"{exc.__class__.__name__}: {exc}"
            logger.warning("KV offload: loading request %s from the %s tier failed on rank %d (it recomputes): %s",
                           load.job.req_id, self.location.name, self.rank, load.error)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if not self._loads:
            return
        key_cache, value_cache = self.kv_caches[layer_idx]
        for load in self._loads:
            if load.error is not None:
                continue
            if not load.ready[layer_idx].wait(self.read_timeout_s):
                self._fail(load, TimeoutError(f"layer {layer_idx} not read within {self.read_timeout_s:.0f} s"))
                continue
            layer = load.layers[layer_idx]
            if load.error is not None or layer is None:
                self._fail(load, RuntimeError(f"layer {layer_idx} was not read"))
                continue
            k, v = layer
            key_cache.index_copy_(0, load.block_ids, k.to(key_cache.device, non_blocking=True))
            value_cache.index_copy_(0, load.block_ids, v.to(value_cache.device, non_blocking=True))
            load.layers[layer_idx] = None
            self._step_bytes += 2 * k.numel() * k.element_size()

    def finish_loads(self) -> tuple[set[str], int, float]:
        failed = {load.job.req_id for load in self._loads if load.error is not None}
        seconds = time.perf_counter() - self._step_started if self._loads else 0.0
        self.stats.loaded_bytes += self._step_bytes
        self._loads = []
        return failed, self._step_bytes, seconds

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                kind = item[0]
                if kind == "store":
                    self._write(item[1], item[2])
                elif kind == "drop":
                    self._delete(item[1])
                elif kind == "adopt":
                    self._adopt(item[1])
                elif kind == "sync":
                    item[1].set()
            except Exception:  # noqa: BLE001 - the writer must outlive one bad item
                logger.exception("KV offload writer on rank %d failed an item", self.rank)
            finally:
                self._writes.task_done()

    def _write(self, entries: list[tuple[bytes, int]], staged: _Staged) -> None:
        staged.wait()
        try:
            for index, (block_hash, generation) in enumerate(entries):
                try:
                    keys = [k[index] for k in staged.keys]
                    values = [v[index] for v in staged.values]
                    nbytes = write_block(self.location.block_path(self.rank, block_hash), block_hash, keys, values)
                    with self._lock:
                        self._owned.add(block_hash)
                    self.stats.written_blocks += 1
                    self.stats.written_bytes += nbytes
                except OSError as exc:
                    self.stats.skipped_stores += 1
                    logger.warning("KV offload: could not write a block to %s: %s", self.dir, exc)
                finally:
                    with self._lock:
                        pending = self._pending.get(block_hash)
                        if pending is not None and pending[0] == generation:
                            del self._pending[block_hash]
        finally:
            with self._lock:
                self._staged_bytes -= staged.nbytes

    def _adopt(self, hashes: list[bytes]) -> None:
        """Files fetched from another node's tier (remote.py) are this rank's to delete from now on."""
        for block_hash in hashes:
            if self.location.block_path(self.rank, block_hash).exists():
                with self._lock:
                    self._owned.add(block_hash)

    def _delete(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            try:
                os.unlink(self.location.block_path(self.rank, block_hash))
                self.stats.deleted_blocks += 1
            except FileNotFoundError:
                pass
            with self._lock:
                self._owned.discard(block_hash)

    # ------------------------------------------------------------------ accounting and shutdown

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every spill and drop queued so far is on the tier."""
        done = threading.Event()
        self._writes.put(("sync", done))
        if not done.wait(timeout_s):
            raise TimeoutError(f"KV offload writer on rank {self.rank} did not catch up within {timeout_s} s")

    def state(self) -> dict:
        """After `flush`: the hashes whose files this rank wrote (and has not deleted), and what is staged."""
        self.flush()
        with self._lock:
            return {"owned": set(self._owned), "pending": len(self._pending), "staged_bytes": self._staged_bytes,
                    "files": {bytes.fromhex(p.name) for p in self.dir.iterdir() if not p.name.startswith(".")}}

    def close(self) -> None:
        """Stop the threads and delete the files this rank wrote (the tier does not outlive its engines)."""
        self._cancel.set()
        if self._writer is not None and self._writer.is_alive():
            self._writes.put(None)
            self._writer.join(timeout=30)
        with self._lock:
            owned, self._owned = list(self._owned), set()
        for block_hash in owned:
            try:
                os.unlink(self.location.block_path(self.rank, block_hash))
            except FileNotFoundError:
                pass
