"""The compiled CPU ops (kernels/cpu) against the torch twin and a naive dense reference, the entry
point's choice between them, the fallback when the build is off or fails, and huge-page KV memory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_paged_attention, tolerance

from pagedserve import kernels
from pagedserve.kernels.cpu import cpu_ops_available, empty_hugepage_tensor
from pagedserve.kernels.torch_impl.attention import paged_decode_attention_gather



def compiled_decode(query, batch, seq_lens, scale, sliding_window=None):
    return torch.ops.pagedserve.paged_decode_attention(
        query, batch.key_cache, batch.value_cache, batch.block_tables,
        torch.tensor(seq_lens, dtype=torch.int32), scale, sliding_window or 0,
    )


def test_cpu_ops_build_on_this_machine():
    # CI machines have g++ and ninja: a build that stops working must fail here, not silently fall back.
    assert cpu_ops_available()


def test_ahead_of_time_build_names_the_folder_it_loaded_from():
    """`python -m pagedserve.kernels.cpu` prints the build folder, which exists and holds the library (torch's
    load() once appended its flags to the list it was given, and the folder named afterwards was another)."""
    result = subprocess.run([sys.executable, "-m", "pagedserve.kernels.cpu"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    folder = result.stdout.rsplit("(", 1)[1].split(",")[0]
    assert os.path.isfile(os.path.join(folder, "pagedserve_cpu_ops.so")), result.stdout


def test_build_directory_is_keyed_by_the_torch_installation_and_the_compiler(monkeypatch, tmp_path):
    """Issue 34: two venvs on one machine share ~/.cache/pagedserve; with the same torch version but each its
    own torch install, each keeps its own build instead of the two rebuilding in turn."""
    from pathlib import Path

    from pagedserve.kernels.cpu import build

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    here = build.build_directory()
    assert here.parent == tmp_path / "cpu_ops" and build.build_directory() == here
    assert build.build_key()["torch_path"] == str(Path(torch.__file__).resolve().parent)
    other_venv = tmp_path / "other-venv" / "lib" / "python3.11" / "site-packages" / "torch" / "__init__.py"
    changes = [(torch, "__file__", str(other_venv)), (torch, "__version__", "0.0.0+other"),
               (build, "CFLAGS", build.CFLAGS + ["-DPAGEDSERVE_OTHER"]), (build, "LDFLAGS", ["-lm"])]
    seen = {here}
    for target, name, value in changes:
        with monkeypatch.context() as mp:
            mp.setattr(target, name, value)
            seen.add(build.build_directory())
    with monkeypatch.context() as mp:
        mp.setenv("CXX", "clang++")
        seen.add(build.build_directory())
    assert len(seen) == 1 + len(changes) + 1
    assert build.build_directory() == here  # and back: nothing else feeds the key


def test_cpu_march_names_the_compile_target_and_keys_the_build(monkeypatch, tmp_path):
    """PAGEDSERVE_CPU_MARCH: -march=native unless it names another target; each target its own build
    directory (a portable AVX2 build never loads as the native one); a malformed value is refused by name."""
    from pagedserve.kernels.cpu import build

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    assert build.compile_flags() == [*build.CFLAGS, "-march=native"]
    native = build.build_directory()
    monkeypatch.setenv(build.MARCH_ENV, " x86-64-v3 ")
    assert build.compile_flags()[-1] == "-march=x86-64-v3"
    assert build.build_directory() != native
    monkeypatch.setenv(build.MARCH_ENV, "")
    assert build.build_directory() == native
    for bad in ("native -O0", "-mavx2", "skylake;rm"):
        monkeypatch.setenv(build.MARCH_ENV, bad)
        with pytest.raises(ValueError, match=build.MARCH_ENV):
            build.compile_flags()


def test_build_lock_outlives_a_killed_build(tmp_path):
    """A build killed while it held the lock (its process gone, torch's lock file left in the directory)
    blocks nobody: the OS releases our lock with the process, and the leftover torch lock is removed."""
    import signal
    import time

    from pagedserve.kernels.cpu import build

    directory = tmp_path / "ops"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, sys, time; from pagedserve.kernels.cpu.build import build_lock, TORCH_BATON\n"
        f"d = pathlib.Path({str(directory)!r})\n"
        "with build_lock(d):\n"
        "    (d / TORCH_BATON).write_text('')\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        probe = [sys.executable, "-c", (
            "import fcntl, pathlib, sys\n"
            f"f = open(pathlib.Path({str(directory)!r}) / 'pagedserve-build.flock', 'a')\n"
            "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")]
        assert subprocess.run(probe).returncode == 3  # held while the build runs
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert (directory / build.TORCH_BATON).exists()
    start = time.monotonic()
    with build.build_lock(directory):
        assert not (directory / build.TORCH_BATON).exists()
    assert time.monotonic() - start < 60  # bounded: it did not wait for a lock nobody will release


def test_two_checkouts_keep_their_own_build(monkeypatch, tmp_path):
    """torch's build file names each source by path: checkouts at two paths would rebuild one directory in turn."""
    from pathlib import Path

    from pagedserve.kernels.cpu import build

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    here = build.build_directory()
    copies = []
    for src in build.SOURCES:
        copy = tmp_path / "other-checkout" / src.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(src.read_bytes())
        copies.append(Path(copy))
    monkeypatch.setattr(build, "SOURCES", copies)
    assert build.build_directory() != here


def test_build_directory_changes_with_the_included_header(monkeypatch, tmp_path):
    """vec_math.h is compiled into the sources that include it: a changed header is a different build."""
    from pagedserve.kernels.cpu import build

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("SOURCES", "HEADERS"):
        copies = [checkout / src.name for src in getattr(build, name)]
        for src, copy in zip(getattr(build, name), copies):
            copy.write_bytes(src.read_bytes())
        monkeypatch.setattr(build, name, copies)
    before = build.build_directory()
    header = build.HEADERS[0]
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.build_directory() != before


def test_every_included_header_is_hashed_into_the_build():
    """A header the sources include but HEADERS leaves out would keep a stale build after it changes."""
    from pagedserve.kernels.cpu import build

    included = {name for path in build.SOURCES + build.HEADERS
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included and included <= {path.name for path in build.HEADERS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 64, 16), (8, 2, 80, 32), (4, 1, 96, 16), (8, 2, 128, 32), (6, 2, 72, 16), (8, 8, 32, 16)],
)
def test_compiled_decode_matches_naive_and_twin(dtype, num_heads, num_kv_heads, head_size, block_size):
    # Lengths below, at and across block and 256-token partition boundaries (split-K merge).
    seq_lens = [1, 16, 17, 45, 256, 257, 600]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=11)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    scale = head_size ** -0.5
    out = compiled_decode(query, batch, seq_lens, scale)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))
    twin = paged_decode_attention_gather(query, batch.key_cache, batch.value_cache, batch.block_tables,
                                        torch.tensor(seq_lens, dtype=torch.int32), scale)
    torch.testing.assert_close(out.double(), twin.double(), **tolerance(dtype))


@pytest.mark.parametrize("sliding_window", [1, 20, 256, 300, 10_000])
def test_compiled_decode_sliding_window(sliding_window):
    seq_lens = [40, 70, 5, 530]
    batch = make_paged_batch(seq_lens, 2, 64, 16, torch.float32, seed=2)
    query = torch.randn(len(seq_lens), 4, 64)
    out = compiled_decode(query, batch, seq_lens, 0.125, sliding_window)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), 0.125, sliding_window=sliding_window)
    torch.testing.assert_close(out.double(), ref, **tolerance(torch.float32))


@pytest.mark.parametrize("seq_lens", [
    [300, 7, 64, 1000],  # few sequences: contexts split into partitions
    [900] + [3] * 18 + [200, 5],  # a batch not split, its work piled at both ends: items of unequal work
])
def test_compiled_decode_is_bitwise_stable_across_thread_counts_and_close_across_batches(seq_lens):
    """The thread count never changes the arithmetic (seeded sampling must not depend on the machine);
    a sequence alone or in another batch may be partitioned differently, within rounding. Threads claim
    work items one at a time, the largest first (whichever thread takes an item, its arithmetic is the same)."""
    batch = make_paged_batch(seq_lens, 2, 64, 16, torch.bfloat16, seed=5)
    query = torch.randn(len(seq_lens), 8, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(compiled_decode(query, batch, seq_lens, 0.125))
            for i, n_tokens in enumerate(seq_lens):
                alone = torch.ops.pagedserve.paged_decode_attention(
                    query[i:i + 1], batch.key_cache, batch.value_cache, batch.block_tables[i:i + 1],
                    torch.tensor([n_tokens], dtype=torch.int32), 0.125, 0)
                torch.testing.assert_close(alone[0], results[-1][i], **tolerance(torch.bfloat16))
        assert all(torch.equal(r, results[0]) for r in results)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    # The default model's shape (9/3, 64, 16); blocks shorter and longer than the 16 keys scored at once;
    # bf16 head sizes that end in half a 32-element pair (48, 80); 7 query heads per KV head (a tile of 6
    # and one of 1 in the values); head sizes 16 and 256.
    [(9, 3, 64, 16), (9, 3, 64, 8), (6, 2, 48, 32), (14, 2, 80, 16), (7, 1, 64, 16), (2, 2, 16, 16), (4, 2, 256, 16)],
)
def test_compiled_decode_lengths_across_chunk_and_block_edges(dtype, num_heads, num_kv_heads, head_size, block_size):
    # One batch of mixed lengths: under, at and over 16-key chunks and blocks, and split-K partitions.
    seq_lens = [1, 2, 15, 16, 17, 31, 33, 100, 255, 513]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=head_size + block_size)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    scale = head_size ** -0.5
    out = compiled_decode(query, batch, seq_lens, scale)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), scale)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    # The default model's shape; blocks of 4 and 12 tokens (shorter than, and not a multiple of, the AVX-512
    # path's 16 keys scored at once); 7 query heads per KV head; head sizes that end in a 16- or 8-wide slice
    # (48, 80, 40) and a large one (128).
    [(9, 3, 64, 16), (9, 3, 64, 4), (4, 2, 64, 12), (7, 1, 64, 16), (6, 2, 48, 32), (14, 2, 80, 16),
     (4, 2, 40, 16), (4, 4, 128, 16)],
)
@pytest.mark.parametrize("sliding_window", [0, 13])
def test_compiled_decode_of_calls_small_enough_for_one_thread(dtype, num_heads, num_kv_heads, head_size, block_size,
                                                              sliding_window):
    """One sequence at a time, the size of a batch-1 decode step: calls this small run on the calling thread
    (the other tests' batches mostly take the pool), with partitions past 256 tokens for the smallest heads
    and windows that start mid-block."""
    seq_lens = [1, 7, 8, 9, 16, 23, 40, 100, 300]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=head_size * block_size)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    scale = head_size ** -0.5
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), scale, sliding_window=sliding_window or None)
    for i, n_tokens in enumerate(seq_lens):
        if n_tokens * num_heads * head_size >= 1 << 17:  # the op would share it with the pool
            continue
        out = torch.ops.pagedserve.paged_decode_attention(
            query[i:i + 1], batch.key_cache, batch.value_cache, batch.block_tables[i:i + 1],
            torch.tensor([n_tokens], dtype=torch.int32), scale, sliding_window)
        torch.testing.assert_close(out.double(), ref[i:i + 1], **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [3, 17, 40, 260])
def test_compiled_decode_sliding_window_starts_inside_a_block(dtype, sliding_window):
    """Windows that start mid-block (and mid 16-key chunk) on the default model's shape."""
    seq_lens = [5, 23, 64, 71, 300]
    batch = make_paged_batch(seq_lens, 3, 64, 16, dtype, seed=sliding_window)
    query = torch.randn(len(seq_lens), 9, 64).to(dtype)
    out = compiled_decode(query, batch, seq_lens, 0.125, sliding_window)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), 0.125, sliding_window=sliding_window)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_on_caches_with_padded_heads(dtype):
    """K/V caches that are views with a head stride wider than the head (the op reads strides, not sizes)."""
    seq_lens = [7, 40, 129]
    wide = make_paged_batch(seq_lens, 3, 80, 16, dtype, seed=4)
    batch = type(wide)(wide.key_cache[..., :64], wide.value_cache[..., :64], wide.block_tables, seq_lens)
    assert batch.key_cache.stride(2) == 80
    query = torch.randn(len(seq_lens), 9, 64).to(dtype)
    out = compiled_decode(query, batch, seq_lens, 0.125)
    ref = naive_paged_attention(query, batch, list(range(len(seq_lens) + 1)), 0.125)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("scale", [4.0, 50.0])
def test_compiled_decode_with_peaked_softmax(scale):
    """Large scores: most exponentials underflow to 0 and the softmax is nearly one-hot."""
    seq_lens = [5, 90, 333]
    batch = make_paged_batch(seq_lens, 2, 32, 16, torch.float32, seed=9)
    query = torch.randn(len(seq_lens), 4, 32)
    out = compiled_decode(query, batch, seq_lens, scale)
    ref = naive_paged_attention(query, batch, [0, 1, 2, 3], scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_entry_point_uses_compiled_op_on_strided_query_and_int64_tables():
    """The engine hands a query that is a view into the fused QKV projection, and tables may be int64."""
    seq_lens = [33, 90]
    batch = make_paged_batch(seq_lens, 2, 64, 16, torch.float32, seed=7)
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    out = kernels.paged_decode_attention(query, batch.key_cache, batch.value_cache, batch.block_tables.long(),
                                         torch.tensor(seq_lens), 0.125)
    ref = naive_paged_attention(query, batch, [0, 1, 2], 0.125)
    torch.testing.assert_close(out.double(), ref, **tolerance(torch.float32))
    torch.testing.assert_close(out, compiled_decode(query.contiguous(), batch, seq_lens, 0.125), atol=0, rtol=0)


def test_compiled_decode_rejects_mismatched_dtypes():
    batch = make_paged_batch([5], 1, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        compiled_decode(torch.randn(1, 2, 32).to(torch.bfloat16), batch, [5], 0.1)


FALLBACK_SCRIPT = """
import logging, torch
from pagedserve import kernels
logging.basicConfig(level=logging.WARNING)
from pagedserve.kernels.cpu.build import cpu_ops_available, cpu_ops_error
q = torch.randn(2, 4, 32); kc = torch.randn(4, 16, 2, 32); vc = torch.randn(4, 16, 2, 32)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32); sl = torch.tensor([20, 3], dtype=torch.int32)
out = kernels.paged_decode_attention(q, kc, vc, bt, sl, 0.25)
print(cpu_ops_available(), cpu_ops_error(), float(out.abs().sum()) > 0)
"""


@pytest.mark.parametrize("how", ["switched off", "build fails", "malformed march"])
def test_falls_back_to_torch_twin(tmp_path, how):
    env = dict(os.environ, PAGEDSERVE_CACHE_DIR=str(tmp_path))
    script = FALLBACK_SCRIPT
    if how == "switched off":
        env["PAGEDSERVE_CPU_OPS"] = "0"
    elif how == "malformed march":
        env["PAGEDSERVE_CPU_MARCH"] = "native -O0"
    else:  # a compile error stands for any failed build (no compiler, no ninja)
        script = "import pagedserve.kernels.cpu.build as b; b.CFLAGS = b.CFLAGS + ['-DPAGEDSERVE_NO_SUCH_HEADER', " \
                 "'-include', 'no/such/header.h']\n" + script
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ok, *_, nonzero = result.stdout.split()
    assert ok == "False" and nonzero == "True"
    if how == "switched off":
        assert "PAGEDSERVE_CPU_OPS" in result.stdout
    elif how == "malformed march":
        assert "PAGEDSERVE_CPU_MARCH" in result.stderr and "CPU ops unavailable" in result.stderr
    else:
        assert "CPU ops unavailable" in result.stderr


def test_hugepage_tensor_is_zeroed_writable_and_outlives_views():
    t = empty_hugepage_tensor((300, 16, 4, 64), torch.bfloat16)  # 2.3 MiB: the mmap path
    assert t.shape == (300, 16, 4, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[5].fill_(2.0)
    view = t[5]
    del t
    assert float(view.float().sum()) == 2.0 * 16 * 4 * 64
    small = empty_hugepage_tensor((3, 4), torch.float32)  # under one huge page: plain torch.zeros
    assert small.shape == (3, 4) and not small.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_compiled_reshape_and_cache_matches_twin(dtype, slot_dtype):
    from pagedserve.kernels.torch_impl.cache import reshape_and_cache_index_copy

    num_blocks, block_size, hkv, d, tokens = 6, 16, 2, 64, 40
    gen = torch.Generator().manual_seed(3)
    # Strided sources, as the model hands them: K and V are column slices of one fused QKV output.
    qkv = torch.randn(tokens, (4 + 2 * hkv) * d, generator=gen).to(dtype)
    key = qkv[:, 4 * d:(4 + hkv) * d].view(tokens, hkv, d)
    value = qkv[:, (4 + hkv) * d:].view(tokens, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # padding rows
    caches = [torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype) for _ in range(4)]
    torch.ops.pagedserve.reshape_and_cache(key, value, caches[0], caches[1], slots.to(slot_dtype))
    reshape_and_cache_index_copy(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].any()


def test_compiled_reshape_and_cache_refuses_slots_beyond_the_cache():
    key = torch.randn(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="beyond the cache"):
        torch.ops.pagedserve.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 8]))
    assert not cache.any()


def test_compiled_decode_refuses_tables_that_point_outside_the_cache():
    batch = make_paged_batch([20, 5], 1, 32, 16, torch.float32)
    query = torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="block_tables has"):
        compiled_decode(query, batch, [20, 16 * batch.block_tables.shape[1] + 1], 0.1)
    batch.block_tables[0, 1] = batch.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        compiled_decode(query, batch, [20, 5], 0.1)


def test_entry_point_on_an_empty_batch():
    batch = make_paged_batch([4], 1, 32, 16, torch.bfloat16)
    out = kernels.paged_decode_attention(torch.empty(0, 2, 32, dtype=torch.bfloat16), batch.key_cache,
                                         batch.value_cache, batch.block_tables[:0], torch.empty(0, dtype=torch.int32),
                                         0.1)
    assert out.shape == (0, 2, 32)


def test_entry_point_names_seq_lens_that_overrun_the_block_table():
    batch = make_paged_batch([20], 1, 32, 16, torch.float32)
    too_long = 16 * batch.block_tables.shape[1] + 1
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_decode_attention(torch.randn(1, 2, 32), batch.key_cache, batch.value_cache, batch.block_tables,
                                       torch.tensor([too_long], dtype=torch.int32), 0.1, seq_lens_cpu=[too_long])


# ---- the per-layer elementwise ops (kernels/cpu/elementwise.cpp) against their torch twins

ELEMENTWISE_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])


@pytest.fixture(autouse=True)
def _ops_loaded():
    assert cpu_ops_available()  # torch.ops.pagedserve.* exist once the library is loaded


@ELEMENTWISE_DTYPES
@pytest.mark.parametrize("hidden", [64, 576, 72])  # 72: a tail after the 16-wide lanes
def test_compiled_rms_norm_matches_twin(dtype, hidden):
    from pagedserve.kernels.torch_impl.norm import fused_add_rms_norm_torch, rms_norm_torch

    torch.manual_seed(0)
    x, residual = torch.randn(9, hidden).to(dtype), torch.randn(9, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    out = torch.ops.pagedserve.rms_norm(x, w, 1e-5)
    # Only the float32 order of the sum of squares differs: one rounding of the dtype at most.
    torch.testing.assert_close(out, rms_norm_torch(x, w, 1e-5), **tolerance(dtype))
    normed, summed = torch.ops.pagedserve.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_normed, ref_summed = fused_add_rms_norm_torch(x, residual, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **tolerance(dtype))
    # Strided (a slice of a wider tensor) and 3-D inputs take the same path as contiguous 2-D ones.
    wide = torch.randn(9, 2 * hidden).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(wide[:, :hidden], w, 1e-5),
                               rms_norm_torch(wide[:, :hidden], w, 1e-5), **tolerance(dtype))
    assert kernels.rms_norm(x.view(3, 3, hidden), w, 1e-5).shape == (3, 3, hidden)


@ELEMENTWISE_DTYPES
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_compiled_rotary_is_bitwise_the_twin(dtype, is_neox, rotary_dim):
    from pagedserve.kernels.torch_impl.rotary import rotary_embedding_torch

    torch.manual_seed(0)
    head_size = 64
    qkv = torch.randn(5, 12 * head_size).to(dtype)
    q, k, _ = qkv.split([8 * head_size, 2 * head_size, 2 * head_size], dim=-1)  # strided views, as in the model
    positions = torch.tensor([0, 3, 50, 99, 7])
    for cache_dtype in (torch.float32, dtype):
        cache = kernels.compute_rope_cos_sin_cache(rotary_dim, 100, 10000.0, None, cache_dtype)
        got_q, got_k = torch.ops.pagedserve.rotary_embedding(positions, q, k, cache, head_size, is_neox)
        ref_q, ref_k = rotary_embedding_torch(positions, q, k, cache, head_size, is_neox)
        assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


def test_compiled_rotary_refuses_positions_outside_the_cache():
    cache = kernels.compute_rope_cos_sin_cache(16, 8, 10000.0, None, torch.float32)
    q = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        torch.ops.pagedserve.rotary_embedding(torch.tensor([1, 8]), q, q, cache, 16, True)


@ELEMENTWISE_DTYPES
def test_compiled_silu_and_mul_matches_twin(dtype):
    from pagedserve.kernels.torch_impl.activation import silu_and_mul_torch

    torch.manual_seed(0)
    x = (4 * torch.randn(3, 4, 2 * 1536)).to(dtype)
    got = torch.ops.pagedserve.silu_and_mul(x)
    assert got.shape == (3, 4, 1536)
    # float32: its own expf (within an ulp of torch's); bf16/fp16: rounded to the same values.
    torch.testing.assert_close(got, silu_and_mul_torch(x), **tolerance(dtype))
    assert torch.equal(kernels.silu_and_mul(x), got)


@ELEMENTWISE_DTYPES
def test_compiled_silu_and_mul_on_extremes_and_tails(dtype):
    """The vectorised exp at its edges (overflow to inf, underflow to 0, NaN) and widths with a scalar tail."""
    from pagedserve.kernels.torch_impl.activation import silu_and_mul_torch

    torch.manual_seed(1)
    x = (6 * torch.randn(4, 2 * (32 + 7))).to(dtype)
    extremes = torch.tensor([100.0, -100.0, 88.0, -88.0, -87.0, 0.0, float("inf"), float("-inf"), float("nan")])
    x[0, :9] = extremes.to(dtype)
    x[1, 32:41] = extremes.to(dtype)  # in the tail after the 16-wide lanes
    got, ref = torch.ops.pagedserve.silu_and_mul(x), silu_and_mul_torch(x)
    torch.testing.assert_close(got, ref, equal_nan=True, **tolerance(dtype))


def test_elementwise_entry_points_use_the_compiled_ops(monkeypatch):
    """The CPU entry points call the compiled ops (one dispatch each), not the twins' compositions."""
    from pagedserve.kernels.torch_impl import activation, norm, rotary

    def refuse(*args, **kwargs):
        raise AssertionError("the twin ran")

    for module, name in ((norm, "rms_norm_torch"), (norm, "fused_add_rms_norm_torch"),
                         (rotary, "rotary_embedding_torch"), (activation, "silu_and_mul_torch")):
        monkeypatch.setattr(module, name, refuse)
    x, w = torch.randn(2, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    kernels.rms_norm(x, w, 1e-6)
    kernels.fused_add_rms_norm(x, x, w, 1e-6)
    kernels.silu_and_mul(x)
    cache = kernels.compute_rope_cos_sin_cache(16, 8, 10000.0, None, torch.bfloat16)
    kernels.rotary_embedding(torch.tensor([0, 1]), x, x, cache, 16)


@ELEMENTWISE_DTYPES
@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 17, 33, 1000, 49152, 49153])
def test_compiled_greedy_argmax_is_argmax(dtype, width):
    """The compiled greedy argmax answers as torch's argmax: the first of equal maxima (in one lane, across
    lanes, in the scalar tail), the first NaN wherever it sits, a row of -inf at 0, +inf over all else."""
    g = torch.Generator().manual_seed(width)
    nan, inf = float("nan"), float("inf")
    logits = torch.randn(8, width, generator=g)
    logits[1] = (logits[1] * 2).round()  # many ties
    logits[2] = -inf
    logits[3, width // 2] = nan
    logits[3, width - 1] = nan
    logits[4, width - 1] = nan  # the first NaN in the tail, or in the last vector
    logits[5, -1] = inf
    logits[5, 0] = inf
    logits[6] = 1.0  # every element a maximum
    logits = logits.to(dtype)
    got = torch.ops.pagedserve.greedy_argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(kernels.greedy_argmax(logits), got)


def test_compiled_greedy_argmax_shapes():
    """Any leading shape, strided input, an empty batch; a row of no elements is refused by name."""
    x = torch.randn(4, 3, 50)
    assert torch.equal(torch.ops.pagedserve.greedy_argmax(x), x.argmax(dim=-1))
    assert torch.equal(torch.ops.pagedserve.greedy_argmax(x.transpose(0, 1)), x.transpose(0, 1).argmax(dim=-1))
    assert torch.equal(torch.ops.pagedserve.greedy_argmax(x[..., ::2]), x[..., ::2].argmax(dim=-1))
    assert torch.ops.pagedserve.greedy_argmax(torch.randn(0, 5)).shape == (0,)
    assert torch.ops.pagedserve.greedy_argmax(torch.randn(7)).shape == ()
    with pytest.raises(RuntimeError, match="last dimension of logits is empty"):
        torch.ops.pagedserve.greedy_argmax(torch.randn(3, 0))


def test_greedy_argmax_entry_point_uses_the_compiled_op(monkeypatch):
    from pagedserve.kernels.torch_impl import sampling

    def refuse(*args, **kwargs):
        raise AssertionError("the twin ran")

    monkeypatch.setattr(sampling, "greedy_argmax_torch", refuse)
    logits = torch.randn(3, 100, dtype=torch.bfloat16)
    assert torch.equal(kernels.greedy_argmax(logits), logits.argmax(dim=-1))
