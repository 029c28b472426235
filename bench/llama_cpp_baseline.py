"""The llama.cpp baseline of `bench throughput|latency --baseline llama-cpp`: llama.cpp itself (through
llama-cpp-python's bindings of its C API) on the same GGUF file and workload, in the same process.

llama-cpp-python is an optional dependency (`pip install 'pagedserve[llama-cpp]'`, built from its sdist
for this machine's CPU). Its high-level `Llama` class generates one sequence at a time, which is not
llama.cpp at its best on a many-request workload, so this drives the C API the way llama.cpp's own
`batched`/`parallel` examples do: up to `batch_size` sequences share one context (one KV cache, one
sequence id each), every `llama_decode` call carries one token of each decoding sequence plus as many
prompt tokens of newly admitted ones as fit in `n_batch` (chunked prefill), the next token is the
argmax of that sequence's logits (greedy; every request produces exactly its output length, as in
pagedserve's run), and a finished sequence's KV is dropped and the next request admitted (continuous
batching). The model runs in the precision its file stores (a Q4_1 file stays Q4_1), and with
`--llama-cpp-types` also in copies of the file re-stored in other GGUF types (`gguf_convert`: BF16 may be
llama.cpp's fastest on a CPU with native bf16), each swept over the batch sizes: the fastest run of all
is the baseline.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.bench.gguf_convert import CONVERTIBLE_TYPES, convert_gguf, gguf_file_type
from pagedserve.bench.workload import BenchRequest

INSTALL_HINT = ("llama-cpp-python is not installed: `pip install 'pagedserve[llama-cpp]'` (it builds llama.cpp "
                "from source for this CPU)")


_QUIET_LOG: Any = None  # the C log callback that drops llama.cpp's messages (kept alive: C holds a pointer)


def load_bindings() -> Any:
    """The `llama_cpp` module (its C API bindings), or ValueError naming the flag and how to install it.
    llama.cpp's own log (every tensor it loads) is silenced: the benchmark prints its own report."""
    global _QUIET_LOG
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(f"--baseline llama-cpp: {INSTALL_HINT}") from None
    if _QUIET_LOG is None and hasattr(llama_cpp, "llama_log_set") and hasattr(llama_cpp, "llama_log_callback"):
        _QUIET_LOG = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_QUIET_LOG, None)
    return llama_cpp


def gguf_file_of(model: str) -> Path:
    """The GGUF file llama.cpp loads for MODEL (a .gguf file, or a folder holding exactly one)."""
    from pagedserve.engine.models.gguf_loader import find_gguf_file

    found = find_gguf_file(model)
    if found is None:
        raise ValueError(f"--baseline llama-cpp: llama.cpp runs GGUF files; {model!r} is not one (convert it "
                         f"with llama.cpp's convert_hf_to_gguf.py, or use --baseline hf)")
    return Path(found)


# `--llama-cpp-types`' name for the GGUF file as it is, whatever type it stores.
FILE_AS_IS = "file"


def parse_llama_cpp_types(text: str) -> list[str]:
    """`--llama-cpp-types`: comma-separated `file` and/or GGUF types a copy can be written in, in order,
    without repeats; ValueError naming the flag otherwise."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        name = FILE_AS_IS if name.lower() == FILE_AS_IS else name.upper()
        if name != FILE_AS_IS and name not in CONVERTIBLE_TYPES:
            raise ValueError(f"--llama-cpp-types: {raw.strip()!r} is not a type llama.cpp's copy can be written in; "
                             f"choose from {FILE_AS_IS}, {', '.join(CONVERTIBLE_TYPES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"--llama-cpp-types: expected at least one of {FILE_AS_IS}, {', '.join(CONVERTIBLE_TYPES)}")
    return names


def gguf_variants(gguf_file: Path, types: list[str]) -> Iterator[tuple[str, Path]]:
    """(GGUF type, file) for each of `types`: the file itself for `file` or its own type, else a copy
    written into a temporary folder, removed once the caller asks for the next one (or closes this)."""
    own = gguf_file_type(gguf_file)
    seen: set[str] = set()
    for name in types:
        kind = own if name == FILE_AS_IS else name
        if kind in seen:
            continue
        seen.add(kind)
        if kind == own:
            yield kind, gguf_file
            continue
        with tempfile.TemporaryDirectory(prefix="pagedserve-llama-cpp-") as folder:
            yield kind, convert_gguf(gguf_file, Path(folder) / f"{gguf_file.stem}.{kind}.gguf", kind)


@dataclass
class _Sequence:
    seq_id: int
    request: BenchRequest
    prefilled: int = 0  # prompt tokens already decoded
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed back
    first_token_time: float | None = None

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.output_len


@dataclass(frozen=True)
class LlamaCppRun:
    """One run of a workload through llama.cpp at one batch size."""

    seconds: float
    batch_size: int
    decode_calls: int  # llama_decode calls (forward passes)
    output_tokens: int
    first_token_times: list[float]  # seconds from the start, one per request
    finish_times: list[float]
    gguf_type: str = ""  # the GGUF type the weights were stored in (set by `llama_cpp_baseline`)


class LlamaCppEngine:
    """One llama.cpp model and context sized for `batch_size` sequences of up to `max_seq_len` tokens."""

    def __init__(self, gguf_file: Path, batch_size: int, max_seq_len: int, n_threads: int | None = None,
                 n_batch: int = 512, extra_buffers: bool = False) -> None:
        """`extra_buffers`: llama.cpp's extra weight buffer types (AMX, repacked layouts). Off by default:
        in llama-cpp-python 0.3.36 built natively on a CPU with AMX, every call of more than one token
        crashed the process (segmentation fault) with them on; a machine where they work can turn them on
        (`--llama-cpp-extra-buffers`)."""
        self.lc = lc = load_bindings()
        self.batch_size = batch_size
        n_ctx = batch_size * max_seq_len
        # llama.cpp sizes its buffers for at most n_ctx tokens per call: a larger n_batch breaks it.
        self.n_batch = min(max(n_batch, batch_size), n_ctx)
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        if hasattr(model_params, "use_extra_bufts"):
            model_params.use_extra_bufts = extra_buffers
        self.model = lc.llama_model_load_from_file(str(gguf_file).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_file}")
        threads = n_threads or os.cpu_count() or 1
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = self.n_batch
        ctx_params.n_ubatch = self.n_batch
        ctx_params.n_seq_max = batch_size
        if hasattr(ctx_params, "kv_unified"):
            ctx_params.kv_unified = True  # one KV pool that sequences of any length share, as a paged cache does
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, batch_size)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _drop(self, seq_id: int) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), seq_id, -1, -1)
        else:  # older bindings
            lc.llama_kv_self_seq_rm(self.ctx, seq_id, -1, -1)

    def _argmax(self, index: int) -> int:
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def run(self, workload: list[BenchRequest]) -> LlamaCppRun:
        """Every request greedily to exactly its output length, `batch_size` sequences at a time."""
        pending = deque(enumerate(workload))
        free_ids = list(range(self.batch_size))
        live: dict[int, tuple[int, _Sequence]] = {}  # seq id -> (request index, sequence)
        first = [0.0] * len(workload)
        finish = [0.0] * len(workload)
        calls = produced = 0
        start = time.perf_counter()
        while pending or live:
            while pending and free_ids:
                index, request = pending.popleft()
                seq_id = free_ids.pop()
                live[seq_id] = (index, _Sequence(seq_id, request))
            # One token of every decoding sequence first, then prompt chunks in the room that is left.
            entries: list[tuple[int, int, int, bool]] = []  # (token, position, seq id, wants logits)
            for seq_id, (_, seq) in live.items():
                if seq.next_token is not None:
                    position = len(seq.request.prompt_token_ids) + len(seq.generated) - 1
                    entries.append((seq.next_token, position, seq_id, True))
            for seq_id, (_, seq) in live.items():
                prompt = seq.request.prompt_token_ids
                room = self.n_batch - len(entries)
                if seq.prefilled >= len(prompt) or room <= 0:
                    continue
                chunk = prompt[seq.prefilled: seq.prefilled + room]
                for offset, token in enumerate(chunk):
                    position = seq.prefilled + offset
                    entries.append((token, position, seq_id, position == len(prompt) - 1))
                seq.prefilled += len(chunk)
            logit_rows = self._decode(entries)
            calls += 1
            now = time.perf_counter() - start
            for seq_id, row in logit_rows:
                index, seq = live[seq_id]
                token = self._argmax(row)
                seq.generated.append(token)
                produced += 1
                if len(seq.generated) == 1:
                    first[index] = now
                seq.next_token = token
                if seq.done:
                    finish[index] = now
                    self._drop(seq_id)
                    del live[seq_id]
                    free_ids.append(seq_id)
        return LlamaCppRun(time.perf_counter() - start, self.batch_size, calls, produced, first, finish)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """One `llama_decode` over these tokens; returns (seq id, logits row) of the rows that sample."""
        batch = self.batch
        rows = []
        for i, (token, position, seq_id, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = 1 if logits else 0
            if logits:
                rows.append((seq_id, i))
        batch.n_tokens = len(entries)
        status = self.lc.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} (context too small for the batch?)")
        return rows


def llama_cpp_baseline(model: str, workload: list[BenchRequest], batch_sizes: list[int],
                       n_threads: int | None = None, extra_buffers: bool = False,
                       types: list[str] | None = None) -> tuple[LlamaCppRun, dict[str, dict[int, float]]]:
    """llama.cpp over the whole workload at every batch size, in the file's own type and in each of `types`
    (default: the file only; each run on its own fresh context after one short warm-up): the fastest
    run, and every type's output tokens per second at every size."""
    gguf_file = gguf_file_of(model)
    load_bindings()
    max_seq_len = max(len(r.prompt_token_ids) + r.output_len for r in workload)
    best: LlamaCppRun | None = None
    rates: dict[str, dict[int, float]] = {}
    variants = gguf_variants(gguf_file, types or [FILE_AS_IS])
    try:
        for kind, path in variants:
            for batch_size in sorted(set(batch_sizes)):
                engine = LlamaCppEngine(path, batch_size, max_seq_len, n_threads, extra_buffers=extra_buffers)
                try:
                    engine.run([BenchRequest(workload[0].prompt_token_ids, 2)])  # warm-up
                    result = engine.run(workload)
                finally:
                    engine.close()
                result = dataclasses.replace(result, gguf_type=kind)
                rates.setdefault(kind, {})[batch_size] = result.output_tokens / result.seconds
                if best is None or result.seconds < best.seconds:
                    best = result
    finally:
        variants.close()  # the last copy's folder goes now, not when the generator is collected
    assert best is not None
    return best, rates
