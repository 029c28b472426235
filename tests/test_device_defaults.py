"""Device-dependent defaults and limits, decided from plain inputs (no GPU needed), and the
configuration checks built on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM
from pagedserve.engine.config import EngineConfig, context_limit
from pagedserve.engine import device_limits
from pagedserve.engine.device_limits import BLOCK_SIZE_RANGE, auto_dtype, check_block_size, should_warm_up
from pagedserve.engine.models.loader import resolve_dtype
from pagedserve.engine.worker.warmup import warm_up_batches
from pagedserve.engine.worker.worker import Worker
from tests.test_engine_parity import _hf_model, assert_all_blocks_free, greedy, hf_greedy, random_prompts


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 1024, 24])
def test_cuda_refuses_block_sizes_its_kernels_cannot_run(block_size):
    with pytest.raises(ValueError, match=r"block_size: .*cuda.*\[16, 256\]"):
        check_block_size(block_size, "cuda")


def test_block_size_ranges_per_device():
    assert BLOCK_SIZE_RANGE == {"cuda": (16, 256), "cpu": (1, 1024)}
    for bs in (16, 32, 64, 128, 256):
        check_block_size(bs, "cuda")
    for bs in (1, 2, 4, 8, 16, 512, 1024):
        check_block_size(bs, "cpu")
    with pytest.raises(ValueError, match=r"block_size: .*\[1, 1024\]"):
        check_block_size(2048, "cpu")


def test_resolve_checks_block_size_for_the_named_device(tiny_llama):
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model=str(tiny_llama), device="cuda", block_size=8).resolve()
    assert EngineConfig(model=str(tiny_llama), device="cpu", block_size=8).resolve().block_size == 8


def test_worker_checks_block_size_for_its_own_device(tiny_llama):
    # Resolved where the device is unknown (a CPU driver), the worker still refuses it for CUDA.
    config = EngineConfig(model=str(tiny_llama), device="cpu", block_size=8).resolve()
    worker = Worker(config.model_copy(update={"device": "cuda"}))
    with pytest.raises(ValueError, match=r"block_size: 8 .*cuda"):
        worker.init_device()


def test_auto_dtype_runs_fp32_checkpoints_in_half_precision_on_cuda():
    assert auto_dtype(torch.float32, "cuda", bf16_supported=True) == torch.bfloat16
    assert auto_dtype(torch.float32, "cuda", bf16_supported=False) == torch.float16
    assert auto_dtype(torch.bfloat16, "cuda", bf16_supported=True) == torch.bfloat16
    assert auto_dtype(torch.float16, "cuda", bf16_supported=True) == torch.float16
    assert auto_dtype(torch.bfloat16, "cpu", bf16_supported=False) == torch.bfloat16


def test_resolve_dtype_on_cpu_keeps_the_checkpoint_dtype(monkeypatch):
    monkeypatch.setattr(device_limits, "cpu_capabilities", lambda: {"avx2": True})
    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu") == torch.float32
    assert resolve_dtype("float32", SimpleNamespace(dtype="float32"), "cuda") == torch.float32


@pytest.mark.parametrize("torch_capability,caps,native", [
    ("AVX2", {"avx2": True}, False),  # AVX2 only: bf16 is emulated
    ("AVX512", {"avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, False),
    ("AVX512", {"avx512_f": True, "avx512_bf16": True}, True),
    ("AVX512", {"amx_tile": True, "amx_bf16": True}, True),
    ("AVX2", {"avx512_f": True, "avx512_bf16": True, "amx_bf16": True}, False),  # torch held to AVX2 kernels
    ("DEFAULT", {"amx_bf16": True}, False),
])
def test_cpu_auto_dtype_follows_native_bf16(monkeypatch, torch_capability, caps, native):
    """fp32 checkpoints (GGUF files, quantized or not, count as fp32) run in bf16 only where the CPU
    multiplies bf16 natively and torch runs its AVX-512 kernels; bf16/fp16 checkpoints and explicit dtypes
    are unchanged."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: torch_capability)
    monkeypatch.setattr(device_limits, "cpu_capabilities", lambda: caps)
    assert device_limits.cpu_has_native_bf16() is native
    fp32 = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu") == fp32
    assert resolve_dtype("auto", SimpleNamespace(), "cpu") == fp32  # GGUF configs carry no dtype
    assert resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), "cpu") == torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(dtype="float16"), "cpu") == torch.float16
    assert resolve_dtype("float32", SimpleNamespace(dtype="float32"), "cpu") == torch.float32
    assert resolve_dtype("bfloat16", SimpleNamespace(dtype="float32"), "cpu") == torch.bfloat16


def test_cpu_dtype_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(device_limits, "cpu_capabilities", lambda: {"amx_bf16": True})
    device_limits._log_choice.cache_clear()
    with caplog.at_level("INFO", logger=device_limits.__name__):
        for _ in range(3):
            resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu")
    records = [r.getMessage() for r in caplog.records if r.name == device_limits.__name__]
    assert len(records) == 1 and "running in bfloat16" in records[0] and "AMX" in records[0]


def test_cpu_capabilities_fall_back_to_proc_cpuinfo(monkeypatch):
    real = device_limits.cpu_capabilities()
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    flags = device_limits.cpu_capabilities()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert flags.get("avx512_bf16", False) == ("avx512_bf16" in text.split()) == bool(real.get("avx512_bf16"))
    assert flags.get("amx_bf16", False) == ("amx_bf16" in text.split()) == bool(real.get("amx_bf16"))


def _cfg(max_pos, **rope):
    return SimpleNamespace(max_position_embeddings=max_pos, **rope)


def test_context_limit_reads_rope_parameters_and_rope_scaling():
    assert context_limit(_cfg(1024))[0] == 1024
    assert context_limit(_cfg(1024, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))[0] == 1024
    assert context_limit(_cfg(1024, rope_parameters={"rope_type": "linear", "factor": 4.0}))[0] == 4096
    assert context_limit(_cfg(1024, rope_scaling={"type": "dynamic", "factor": 2.0}))[0] == 2048
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_limit(_cfg(32768, rope_parameters=yarn))[0] == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert context_limit(_cfg(131072, rope_parameters=llama3))[0] == 131072


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_llama):
    # The tiny llama has max_position_embeddings 512 and plain RoPE.
    with pytest.raises(ValueError, match=r"max_model_len: 1024 .*512"):
        EngineConfig(model=str(tiny_llama), device="cpu", max_model_len=1024).resolve()


def test_rope_scaling_extends_max_model_len_and_the_rope_cache(tiny_model_factory):
    path = tiny_model_factory("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory="32MiB")
    try:
        prompt = random_prompts(41, [600])[0]  # past max_position_embeddings (512)
        out = llm.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(_hf_model(path), prompt, 4)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_warm_up_runs_on_cuda_only():
    calls = []
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        worker = Worker.__new__(Worker)
        worker.device = device
        worker.model_runner = SimpleNamespace(
            initialize_kv_cache=lambda n: calls.append(("kv", n)), warm_up=lambda d=device: calls.append(("warm", d))
        )
        worker.initialize_kv_cache(3)
    assert calls == [("kv", 3), ("warm", torch.device("cuda", 0)), ("kv", 3)]
    assert should_warm_up(torch.device("cuda")) and not should_warm_up(torch.device("cpu"))


def test_warm_up_batches_cover_every_decode_partition_count():
    batches = warm_up_batches(4096)
    assert batches[0] == [(1, 1), (16, 16), (16, 32)]
    assert [b[0][1] for b in batches[1:]] == [1024, 2048, 4096]  # 2, 4, 8 split-K partitions
    assert warm_up_batches(600)[1:] == [[(1, 600)]]
    assert warm_up_batches(512)[1:] == []


def test_warm_up_leaves_the_engine_untouched(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", device="cpu", block_size=4, kv_cache_memory="8MiB")
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        before = [k.clone() for k, _ in runner.kv_caches[:1]]
        runner.warm_up()  # what a CUDA start-up runs, here through the CPU twins
        assert torch.equal(before[0], runner.kv_caches[0][0])
        prompt = random_prompts(42, [9])[0]
        out = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(_hf_model(tiny_llama), prompt)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_triton_kernels_do_not_specialize_per_step_integers():
    from pagedserve.kernels.triton.decode_attention import _decode_kernel, _decode_reduce_kernel
    from pagedserve.kernels.triton.prefill_attention import _prefill_kernel

    def unspecialised(fn) -> set[str]:
        if not hasattr(fn, "params"):
            pytest.skip("Triton kernels were imported in interpreter mode")
        return {p.name for p in fn.params if p.do_not_specialize}

    assert unspecialised(_decode_kernel) == {"num_partitions", "stride_bt"}
    assert unspecialised(_decode_reduce_kernel) == {"num_partitions"}
    assert unspecialised(_prefill_kernel) == {"stride_bt"}
    assert {p.name for p in _prefill_kernel.params if p.do_not_specialize_on_alignment} == {
        "block_tables_ptr", "seq_lens_ptr"
    }
