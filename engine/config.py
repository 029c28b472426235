"""Engine configuration: one validated pydantic model, resolved once against the model's HF config."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.engine.device_limits import check_block_size
from pagedserve.engine.sampling_params import SEED_MAX, SEED_MIN

logger = logging.getLogger(__name__)

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_memory_size(value: int | float | str, field: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "4GiB", "512MiB", "2GB", "1e9"; errors name `field`."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a size in bytes or a string such as '4GiB'")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{field}: cannot parse {value!r}; use bytes or e.g. '4GiB', '512MiB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{field}: must be positive, got {value!r}")
    return size


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def context_limit(hf_config: Any) -> tuple[int, str]:
    """The longest max_model_len the model's positions support, and where that number comes from.

    Plain RoPE: max_position_embeddings. RoPE scaling with a factor (transformers 5's
    ``rope_parameters`` or the older ``rope_scaling``) extends it as vLLM does: llama3
    configs already count the extension in max_position_embeddings (or use
    original_max_position_embeddings * factor if larger), yarn scales
    original_max_position_embeddings, the others (linear, dynamic, ...) max_position_embeddings.
    """
    max_pos = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    source = f"max_position_embeddings {max_pos}"
    scaling = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(scaling, dict):
        return max_pos, source
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    factor = scaling.get("factor")
    if rope_type == "default" or not isinstance(factor, (int, float)) or factor <= 1:
        return max_pos, source
    original = scaling.get("original_max_position_embeddings")
    if rope_type == "llama3":
        limit = max(max_pos, int(original * factor)) if original else max_pos
    elif rope_type == "yarn":
        limit = int((original or max_pos) * factor)
    else:
        limit = int(max_pos * factor)
    return limit, f"{source} with {rope_type} RoPE scaling (factor {factor})"


def default_kv_cache_memory() -> int:
    """On CPU: a quarter of the memory that is available now, capped at 8 GiB, at least 256 MiB."""
    available = _available_memory_bytes()
    return max(256 * 1024**2, min(available // 4, 8 * 1024**3))


class EngineConfig(BaseModel):
    """Everything one engine needs; mirrors vLLM's `EngineArgs` where they overlap."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = "auto"
    # Weight-only quantization (vLLM's name). "auto": a GGUF file with block-quantized weights (Q4_0, Q4_1,
    # Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) keeps them quantized in memory and multiplies with dequantizing
    # kernels ("gguf"); "none" (or None) dequantizes them to `dtype` at load. "int8" / "int4": a float
    # checkpoint's linear layers are quantized at load, round-to-nearest per 32 weights (Q8_0 / Q4_1
    # blocks: an fp16 scale, and a min for int4). resolve() leaves "gguf", "none", "int8" or "int4".
    quantization: Literal["auto", "gguf", "none", "int8", "int4"] | None = "auto"
    seed: int = Field(default=0, ge=SEED_MIN, le=SEED_MAX)  # seeds torch and the sampler's shared generator
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1, le=1024)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | str | None = None
    # On CUDA (when kv_cache_memory is not set): the share of the device's memory the engine may fill
    # (weights, activations, KV cache); the KV cache gets what a profile run leaves (memory_profiler).
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    num_kv_blocks: int | None = Field(default=None, ge=1, description="Override the number of KV blocks (tests).")
    # On CUDA, decode-only steps replay CUDA graphs captured at start-up (engine/worker/cuda_graphs.py);
    # True runs every step eagerly (vLLM's name): no capture time, no graph memory, easier debugging.
    enforce_eager: bool = False
    # Decode batch sizes to capture graphs for (vLLM's name); None: 1, 2, 4, 8, then every multiple of 8 up
    # to max_num_seqs. A batch runs in the graph of the smallest size that holds it (padded rows).
    cuda_graph_sizes: list[int] | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_logprobs: int = Field(default=20, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    distributed_executor_backend: Literal["uni", "ray"] | None = None
    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    num_cpus_per_worker: float = Field(default=1.0, gt=0, description="CPUs reserved per Ray worker rank.")
    # torch threads of each worker (rank): torch.set_num_threads in the worker. None: torch's default in a
    # plain process (every core); in a Ray actor the CPUs Ray reserved for it (num_cpus_per_worker for a rank,
    # num_cpus_per_engine for an engine replica), whatever OMP_NUM_THREADS the actor inherited.
    cpu_threads: int | None = Field(default=None, ge=1)
    placement_timeout_s: float = Field(default=300.0, gt=0, description="Longest wait for a busy cluster to offer "
                                       "the ranks' placement group (a layout it can never hold fails at once).")
    # Set by the cluster layer for a rank/engine that shares its node with others (its CPU share of the node):
    # the default KV budget (kv_cache_memory unset) is a budget for the whole node, so each takes its share.
    kv_cache_memory_share: float = Field(default=1.0, gt=0, le=1)
    kv_transfer_config: dict[str, Any] | None = None
    # A KV offload tier (kv_transfer/offload/): blocks evicted from the prefix cache spill there and a later
    # prefix hit in it is loaded back instead of recomputed. Bytes per rank or "2GiB"; None: no tier. It lives
    # in host shared memory (/dev/shm), readable by every engine on the node that serves the same model with
    # the same KV layout, or under `kv_offload_dir` (a local disk) when that is set.
    kv_offload_size: int | str | None = None
    kv_offload_dir: str | None = None
    # Speculative decoding, vLLM's shape: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    # (a dict, or its JSON text as the CLI passes it); see engine/spec_decode/config.py.
    speculative_config: dict[str, Any] | None = None
    # vLLM's name: schedule step N+1 while step N runs (the sampled token feeds the next step on the worker);
    # the in-process executor only (engine/core/scheduling/in_flight.py).
    async_scheduling: bool = False
    # Embeddings (`LLM.embed`, /v1/embeddings) from this decoder model (vLLM's PoolerConfig): which prompt
    # positions' final-norm hidden states make a request's vector when it does not say (last token, their
    # mean, the first), and whether vectors are L2-normalized by default (engine/pooling_params.py).
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize_embeddings: bool = True
    # Multi-LoRA serving (vLLM's names): requests may run under PEFT LoRA adapters (engine/lora/); at most
    # max_loras adapters are resident (and in one step) at once, of rank <= max_lora_rank; max_cpu_loras
    # adapters (default: max_loras) stay in host memory after their first load from disk.
    enable_lora: bool = False
    max_loras: int = Field(default=1, ge=1)
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)

    # Resolved from the HF config by `resolve()`; not user input.
    hf_config: Any = Field(default=None, exclude=True)

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_memory(cls, v: int | str | None) -> int | str | None:
        if v is not None:
            parse_memory_size(v)
        return v

    @field_validator("kv_offload_size")
    @classmethod
    def _check_kv_offload_size(cls, v: int | str | None) -> int | str | None:
        if v is not None:
            parse_memory_size(v, field="kv_offload_size")
        return v

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _check_cuda_graph_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("cuda_graph_sizes: must list at least one batch size (enforce_eager turns graphs off)")
        if any(size < 1 for size in v):
            raise ValueError(f"cuda_graph_sizes: every size must be a positive integer, got {v}")
        return sorted(set(v))

    @field_validator("kv_transfer_config")
    @classmethod
    def _check_kv_transfer(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # Parsed once here so every rank and the scheduler share one engine_id (a default is a fresh uuid).
        if v is None:
            return None
        from pagedserve.kv_transfer.config import parse_kv_transfer_config

        return parse_kv_transfer_config(v).model_dump()

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _check_speculative(cls, v: Any) -> dict[str, Any] | None:
        from pagedserve.engine.spec_decode.config import parse_speculative_config

        spec = parse_speculative_config(v)
        return None if spec is None else spec.model_dump()

    @property
    def speculative(self):
        """The parsed speculative_config (an engine.spec_decode.config.SpeculativeConfig), or None."""
        if self.speculative_config is None:
            return None
        from pagedserve.engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.model_validate(self.speculative_config)

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        # The device's own range (device_limits) is checked by resolve(), where the device is known.
        if v & (v - 1):
            raise ValueError(f"block_size: must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _check_backend(self) -> "EngineConfig":
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend: 'uni' runs one worker; tensor_parallel_size * "
                "pipeline_parallel_size > 1 needs 'ray'"
            )
        if self.async_scheduling:
            if self.executor_backend != "uni":
                raise ValueError("async_scheduling: needs the in-process executor (tensor_parallel_size = "
                                 "pipeline_parallel_size = 1, backend 'uni'): the step scheduled ahead takes its "
                                 "input from the sampling rank's last token, kept on that rank")
            if self.speculative_config is not None:
                raise ValueError("async_scheduling: cannot run with speculative_config (the next step's input "
                                 "depends on how many drafts the host verifies)")
            if self.kv_transfer_config is not None:
                raise ValueError("async_scheduling: cannot run with kv_transfer_config (KV loads and holds are "
                                 "tracked per finished step)")
            if self.kv_offload_size is not None:
                raise ValueError("async_scheduling: cannot run with kv_offload_size (loads from the offload tier "
                                 "are tracked per finished step)")
        if self.kv_offload_dir is not None and self.kv_offload_size is None:
            raise ValueError("kv_offload_dir: needs kv_offload_size (the tier's size per rank)")
        if self.kv_offload_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_size: the offload tier holds blocks evicted from the prefix cache; "
                             "it needs enable_prefix_caching")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: {self.max_cpu_loras} is fewer than max_loras ({self.max_loras}); every "
                             "resident adapter is also kept in host memory")
        return self

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "ray" if self.world_size > 1 else "uni"

    @property
    def kv_cache_memory_bytes(self) -> int:
        if self.kv_cache_memory is None:
            return int(default_kv_cache_memory() * self.kv_cache_memory_share)
        return parse_memory_size(self.kv_cache_memory)

    @property
    def kv_offload_bytes(self) -> int:
        """The offload tier's size per rank in bytes (0: no tier)."""
        return 0 if self.kv_offload_size is None else parse_memory_size(self.kv_offload_size, field="kv_offload_size")

    def kv_offload_spec(self):
        """The offload tier (kv_transfer.factory.OffloadSpec), or None. Its model identity - the model's path, its
        HF config and quantization - is what engines must share to read each other's offloaded KV."""
        if self.kv_offload_size is None:
            return None
        import hashlib

        from pagedserve.kv_transfer.factory import OffloadSpec

        hf = self.hf_config.to_json_string() if self.hf_config is not None else ""
        path = os.path.realpath(self.model)
        # The weight files as they are now (name, size, mtime): new weights saved over the same path get a tier
        # of their own, never the KV computed with the old ones.
        files = sorted(os.scandir(path), key=lambda e: e.name) if os.path.isdir(path) else []
        weights = [(e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in files
                   if e.is_file() and e.name.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
        if os.path.isfile(path):
            weights = [(path, os.path.getsize(path), os.stat(path).st_mtime_ns)]
        key = f"{path}|{self.quantization}|{hf}|{weights}"
        return OffloadSpec(hashlib.sha256(key.encode()).hexdigest(), self.kv_offload_bytes, self.kv_offload_dir)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve(self) -> "EngineConfig":
        """Load the HF config (from config.json, or a GGUF file's metadata) and fill in the derived
        limits (max_model_len, token budget)."""
        from transformers import AutoConfig

        from pagedserve.engine.models.gguf_config import gguf_hf_config, open_reader
        from pagedserve.engine.models.gguf_loader import find_gguf_file, has_quantized_weights

        if not os.path.exists(self.model):
            raise ValueError(f"model: {self.model!r} does not exist (pagedserve loads a local HF-format folder "
                             "or a GGUF file)")
        gguf_file = find_gguf_file(self.model)
        quantization = "none" if self.quantization in (None, "none") else self.quantization
        if gguf_file is not None:
            reader = open_reader(gguf_file)
            hf_config = gguf_hf_config(gguf_file, reader)
            if quantization == "auto":
                quantization = "gguf" if has_quantized_weights(reader) else "none"
            elif quantization in ("int8", "int4"):
                raise ValueError(f"quantization: {quantization!r} quantizes a float (safetensors) checkpoint at load; "
                                 "a GGUF file runs in its own quant types ('auto') or dequantized ('none')")
        elif quantization == "gguf":
            raise ValueError(f"quantization: 'gguf' needs a GGUF model file, and {self.model!r} is not one")
        elif not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is neither a directory nor a .gguf file (pagedserve loads a "
                             "local HF-format folder or a GGUF file)")
        else:
            hf_config = AutoConfig.from_pretrained(self.model)
        if quantization == "auto":
            quantization = "none"
        check_block_size(self.block_size, self.resolved_device)
        max_pos = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
        max_model_len = self.max_model_len or max_pos
        limit, source = context_limit(hf_config)
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds what the model's positions support ({limit}, from its "
                f"{source}); lower max_model_len to at most {limit}"
            )
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        else:
            budget = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {budget} is smaller than max_model_len {max_model_len}; "
                "without chunked prefill a whole prompt must fit in one step"
            )
        spec = self.speculative
        if spec is not None and spec.method == "draft_model":
            from pagedserve.engine.spec_decode.config import check_draft_compatible, load_draft_hf_config

            check_draft_compatible(spec, hf_config, load_draft_hf_config(spec))
        update = dict(hf_config=hf_config, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      quantization=quantization)
        return self.model_copy(update=update)


# vLLM's name for the same thing: `EngineArgs(model=..., tensor_parallel_size=...)`.
EngineArgs = EngineConfig
