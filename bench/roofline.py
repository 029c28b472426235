"""The roofline beside every figure: what a step should cost on this machine, and how close we came.

Two machine figures, measured once by a small probe and cached (`probe()`, `machine_figures()`):

- memory bandwidth B (bytes/s): the best of a few `dst.copy_(src)` over buffers far larger than the
  caches, counting the bytes read plus the bytes written;
- matmul rate F (FLOP/s) per dtype: the best of a few square `torch.mm` of side n (2 n^3 FLOPs each).

The model of one engine step (`step_roofline()`), for a batch of `T` new tokens whose attention reads
`C` cached tokens (each once) and scores `A` query-key pairs (decode: T = batch size, C = A = the sum
of the sequences' contexts; a prefill of n tokens: C = n, A = n (n + 1) / 2):

    bytes  = W + C * kv_bytes_per_token            W = the weight bytes read once per step (every
                                                   linear layer and the LM head; the embedding lookup
                                                   reads only T rows and is left out)
    flops  = 2 * P_matmul * T + 4 * L * Hq * d * A P_matmul = parameters in the matmuls (W / dtype
                                                   size); attention: QK^T and PV, 2 FLOPs per MAC
    t_mem  = bytes / B,   t_comp = flops / F,   ideal = max(t_mem, t_comp)
    kv_bytes_per_token = 2 (K and V) * L * Hkv * d * kv dtype size

`percent_of_ideal = 100 * ideal / measured`. The verdict names a bound only from what was measured:

    bandwidth_use = t_mem / measured      the bytes the step must move, in the measured time, over B
    matmul_use    = t_comp / measured     the FLOPs it must do, in the measured time, over F
    host_share    = 1 - model time / step time, from the engine's clocks (where the command measures it)

"memory-bound" or "compute-bound" when the step reached at least `ROOF_FRACTION` of that roof (the
larger use names it); else "host-bound" when the measured host share is at least `HOST_SHARE_BOUND`;
else "unexplained": the step is far from both roofs and the host does not account for the gap (or
its share was not measured), so naming a bound would be a guess.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOF_FRACTION = 0.5  # a step that reaches half of a roof (bandwidth or matmul rate) is bound by it
HOST_SHARE_BOUND = 0.5  # the host holds at least half of the step's time: host-bound
VERDICTS = ("memory-bound", "compute-bound", "host-bound", "unexplained")
ROOFLINE_FILE_ENV = "PAGEDSERVE_ROOFLINE_FILE"
DEFAULT_BANDWIDTH_BYTES = 256 * 1024 * 1024  # per buffer; two buffers
DEFAULT_MATMUL_SIDE = 1024


@dataclass(frozen=True)
class ModelFacts:
    """What the roofline needs to know about a model (from its HF config and run dtype)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int
    dtype: str
    # The matmul weights' bytes as the engine holds them when some stay quantized (GGUF blocks, int8/int4
    # RTN); None: every matmul weight is in the run dtype.
    quantized_weight_bytes: int | None = None

    @property
    def matmul_params(self) -> int:
        """Parameters read by the matmuls of one forward pass: attention and MLP of every layer + LM head."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_attention_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    @property
    def weight_bytes(self) -> int:
        """W: weight bytes read once per step (the layers' norms are a rounding error and left out)."""
        if self.quantized_weight_bytes is not None:
            return self.quantized_weight_bytes
        return self.matmul_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, hf_config: Any, dtype: str) -> "ModelFacts":
        import torch

        heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            num_layers=int(hf_config.num_hidden_layers), hidden_size=int(hf_config.hidden_size),
            num_attention_heads=heads, num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim), intermediate_size=int(hf_config.intermediate_size),
            vocab_size=int(hf_config.vocab_size),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            dtype_bytes=getattr(torch, dtype).itemsize, dtype=dtype,
        )


def model_facts(model: str, dtype: str = "auto", hf_config: Any = None, quantization: str | None = "auto") -> ModelFacts:
    """ModelFacts for a model folder or GGUF file (or its already loaded HF config), at the dtype the
    engine runs it in on the CPU, with the weight bytes of what `quantization` keeps quantized."""
    import dataclasses

    from pagedserve.engine.config import EngineConfig
    from pagedserve.engine.models.loader import resolve_dtype

    config = EngineConfig(model=model, quantization=quantization).resolve()
    hf_config = hf_config if hf_config is not None else config.hf_config
    run_dtype = resolve_dtype(dtype, hf_config, "cpu")
    facts = ModelFacts.from_hf_config(hf_config, str(run_dtype).removeprefix("torch."))
    quantized = quantized_weight_bytes(model, config.quantization, facts)
    return dataclasses.replace(facts, quantized_weight_bytes=quantized) if quantized is not None else facts


# The GGUF tensors of one layer that the engine fuses into one matmul (kept quantized only when their
# types agree, as `parallel.quant.GGUFQuantConfig.qtype` decides).
_FUSED_GGUF_PARTS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_output",), ("ffn_down",))


def quantized_weight_bytes(model: str, quantization: str | None, facts: ModelFacts) -> int | None:
    """The matmul weights' bytes when the engine keeps some quantized (`quantization` as resolved: "gguf",
    "int8", "int4"); None when they all run in the run dtype."""
    from pagedserve.engine.models.loader import RTN_WEIGHT_TYPES
    from pagedserve.kernels.torch_impl.gguf_quant import row_bytes

    if quantization in RTN_WEIGHT_TYPES:  # every linear layer quantized; the LM head stays float
        qtype = RTN_WEIGHT_TYPES[quantization]
        linear_params = facts.matmul_params - facts.vocab_size * facts.hidden_size
        per_weight = row_bytes(qtype, 256) / 256
        return int(linear_params * per_weight) + facts.vocab_size * facts.hidden_size * facts.dtype_bytes
    if quantization != "gguf":
        return None
    from pagedserve.engine.models.gguf_config import open_reader
    from pagedserve.engine.models.gguf_loader import QUANTIZED_TYPES, find_gguf_file

    tensors = {t.name: t for t in open_reader(find_gguf_file(model)).tensors}

    def held_bytes(parts: list[Any]) -> int:
        kinds = {t.tensor_type.name for t in parts}
        if len(kinds) == 1 and kinds.pop() in QUANTIZED_TYPES:
            return sum(int(t.n_bytes) for t in parts)
        return sum(int(t.n_elements) for t in parts) * facts.dtype_bytes

    total = 0
    for layer in range(facts.num_layers):
        for group in _FUSED_GGUF_PARTS:
            total += held_bytes([tensors[f"blk.{layer}.{name}.weight"] for name in group])
    head = tensors.get("output.weight") or tensors["token_embd.weight"]  # a tied LM head reads the embedding
    return total + held_bytes([head])


@dataclass(frozen=True)
class Machine:
    """Measured memory bandwidth (bytes/s) and matmul rate per dtype (FLOP/s)."""

    memory_bandwidth: float
    matmul_flops: dict[str, float]
    device: str
    threads: int
    measured_at: str

    def flops_for(self, dtype: str) -> float:
        return self.matmul_flops.get(dtype) or max(self.matmul_flops.values())

    def to_dict(self) -> dict[str, Any]:
        return {"memory_bandwidth_gb_s": self.memory_bandwidth / 1e9,
                "matmul_gflop_s": {k: v / 1e9 for k, v in self.matmul_flops.items()},
                "device": self.device, "threads": self.threads, "measured_at": self.measured_at}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Machine":
        return cls(memory_bandwidth=float(data["memory_bandwidth_gb_s"]) * 1e9,
                   matmul_flops={k: float(v) * 1e9 for k, v in data["matmul_gflop_s"].items()},
                   device=str(data["device"]), threads=int(data["threads"]), measured_at=str(data["measured_at"]))


@dataclass(frozen=True)
class StepRoofline:
    """One step against its roofline (a run of `steps` alike: the figures of one of them); seconds."""

    steps: int
    tokens: int
    context_tokens: int
    weight_bytes: float
    kv_bytes: float
    flops: float
    t_memory: float
    t_compute: float
    ideal_s: float
    measured_s: float
    percent_of_ideal: float
    bandwidth_use: float
    matmul_use: float
    host_share: float | None
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(bandwidth_use: float, matmul_use: float, host_share: float | None) -> str:
    """The bound the measurements name (module docstring), or "unexplained"."""
    if max(bandwidth_use, matmul_use) >= ROOF_FRACTION:
        return "memory-bound" if bandwidth_use >= matmul_use else "compute-bound"
    if host_share is not None and host_share >= HOST_SHARE_BOUND:
        return "host-bound"
    return "unexplained"


def step_roofline(facts: ModelFacts, machine: Machine, tokens: int, context_tokens: int, measured_s: float,
                  steps: int = 1, attention_pairs: int | None = None,
                  host_share: float | None = None) -> StepRoofline:
    """The roofline of one step of `tokens` new tokens reading `context_tokens` cached tokens and scoring
    `attention_pairs` (default: `context_tokens`) query-key pairs (see the module docstring for the
    formula), against `measured_s`, the measured time of `steps` such steps together; `host_share` is
    the host's measured share of those steps, None where it was not measured."""
    if tokens < 1 or context_tokens < 0 or steps < 1:
        raise ValueError(f"step_roofline: need tokens >= 1, context_tokens >= 0, steps >= 1; got {tokens}, "
                         f"{context_tokens}, {steps}")
    if measured_s <= 0:
        raise ValueError(f"step_roofline: measured_s must be > 0, got {measured_s}")
    if host_share is not None and not 0.0 <= host_share <= 1.0:
        raise ValueError(f"step_roofline: host_share must be in [0, 1], got {host_share}")
    weight_bytes = facts.weight_bytes
    kv_bytes = context_tokens * facts.kv_bytes_per_token
    pairs = context_tokens if attention_pairs is None else attention_pairs
    attn_flops = 4 * facts.num_layers * facts.num_attention_heads * facts.head_dim * pairs
    flops = 2 * facts.matmul_params * tokens + attn_flops
    t_memory = (weight_bytes + kv_bytes) / machine.memory_bandwidth
    t_compute = flops / machine.flops_for(facts.dtype)
    ideal = max(t_memory, t_compute)
    measured = measured_s / steps
    bandwidth_use, matmul_use = t_memory / measured, t_compute / measured
    return StepRoofline(steps=steps, tokens=tokens, context_tokens=context_tokens, weight_bytes=weight_bytes,
                        kv_bytes=kv_bytes, flops=flops, t_memory=t_memory, t_compute=t_compute, ideal_s=ideal,
                        measured_s=measured, percent_of_ideal=100.0 * ideal / measured,
                        bandwidth_use=bandwidth_use, matmul_use=matmul_use, host_share=host_share,
                        verdict=verdict(bandwidth_use, matmul_use, host_share))


def run_roofline(facts: ModelFacts, machine: Machine, lengths: list[tuple[int, int]], steps: int,
                 measured_s: float, host_share: float | None = None) -> StepRoofline:
    """A whole offline run of requests given as (prompt_len, output_len) that took `steps` steps (the
    engine's own count, or HF's forward passes), against its wall time. Per step: T = all tokens / S;
    C = (prompt tokens + every decode token's context) / S; A = (each prompt's n (n + 1) / 2 + every
    decode token's context) / S. A decode token at output position j of a prompt of n tokens reads
    n + j cached tokens; summed over j this is o (n + (o - 1) / 2)."""
    if not lengths:
        raise ValueError("run_roofline: no requests")
    if steps < 1:
        raise ValueError(f"run_roofline: steps must be >= 1, got {steps}")
    total = sum(p + o for p, o in lengths)
    decode_ctx = sum(o * (p + (o - 1) / 2) for p, o in lengths)
    context = (sum(p for p, _ in lengths) + decode_ctx) / steps
    pairs = (sum(p * (p + 1) / 2 for p, _ in lengths) + decode_ctx) / steps
    return step_roofline(facts, machine, tokens=max(1, round(total / steps)), context_tokens=round(context),
                         measured_s=measured_s, steps=steps, attention_pairs=round(pairs), host_share=host_share)


# --------------------------------------------------------------------------- the probe


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe(bandwidth_bytes: int = DEFAULT_BANDWIDTH_BYTES, matmul_side: int = DEFAULT_MATMUL_SIDE,
          dtypes: tuple[str, ...] = ("float32", "bfloat16"), repeats: int = 5) -> Machine:
    """Measure this process's CPU memory bandwidth and matmul rate (peaks: the best of `repeats`)."""
    import torch

    if bandwidth_bytes < 4096 or matmul_side < 8:
        raise ValueError("probe: bandwidth_bytes must be >= 4096 and matmul_side >= 8")
    src = torch.ones(bandwidth_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    seconds = _best_of(lambda: dst.copy_(src), repeats)
    bandwidth = 2 * src.numel() * src.element_size() / seconds
    src = dst = None  # free the buffers before the matmul probes
    flops: dict[str, float] = {}
    n = matmul_side
    for name in dtypes:
        a = torch.randn(n, n).to(getattr(torch, name))
        b = torch.randn(n, n).to(getattr(torch, name))
        torch.mm(a, b)
        flops[name] = 2 * n**3 / _best_of(lambda: torch.mm(a, b), repeats)
    return Machine(memory_bandwidth=bandwidth, matmul_flops=flops, device=f"cpu:{platform.machine()}",
                   threads=torch.get_num_threads(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def roofline_file() -> Path:
    """Where probe results are cached: $PAGEDSERVE_ROOFLINE_FILE, else <cache>/roofline.json with
    <cache> = $PAGEDSERVE_CACHE_DIR or ~/.cache/pagedserve (as the compiled CPU ops)."""
    if os.environ.get(ROOFLINE_FILE_ENV):
        return Path(os.environ[ROOFLINE_FILE_ENV])
    root = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return root / "roofline.json"


# Settings that change which kernels torch's matmuls run (oneDNN's ISA cap, ATen's vector level): figures
# probed under one are not the machine's figures without it.
PROBE_SETTINGS_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def _cache_key() -> str:
    """This machine (host name, CPU model, torch's vector ISA: one home directory may serve several VMs),
    its thread count, and any probe-changing settings in the environment."""
    import torch

    from pagedserve.bench.report import cpu_features

    cpu = cpu_features()
    settings = "".join(f":{name}={os.environ[name]}" for name in PROBE_SETTINGS_ENV if os.environ.get(name))
    return (f"cpu:{platform.machine()}:{platform.node()}:{cpu['cpu_model']}:{cpu['cpu_capability']}"
            f":threads={torch.get_num_threads()}{settings}")


def machine_figures(path: Path | None = None, remeasure: bool = False, **probe_kwargs: Any) -> Machine:
    """The cached figures for this machine and thread count, probing (and caching) them when absent."""
    path = path or roofline_file()
    entries: dict[str, Any] = {}
    if path.is_file():
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            entries = {}
    key = _cache_key()
    if not remeasure and key in entries:
        try:
            return Machine.from_dict(entries[key])
        except (KeyError, TypeError, ValueError):
            pass  # an old or damaged entry: measure again
    machine = probe(**probe_kwargs)
    entries[key] = machine.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2))
    tmp.replace(path)
    return machine
