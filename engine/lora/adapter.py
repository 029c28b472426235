"""PEFT adapter folders: their config, the shapes they promise, their weights, and whether they fit.

A PEFT LoRA folder holds ``adapter_config.json`` (r, lora_alpha, target_modules, ...) and
``adapter_model.safetensors`` with, per adapted projection, ``...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
[r, in_features] and ``lora_B.weight`` [out_features, r]. The adapted output is
``base(x) + lora_B(lora_A(x)) * scaling`` with scaling = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora). `check_adapter` reads only the config and the safetensors header (no weights), so the
engine front refuses an adapter that does not fit before any worker loads it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# The projections an adapter may target: attention (q/k/v/o) and the gated MLP (gate/up/down).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: tuple[str, ...]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection of the base model."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inter = int(hf_config.intermediate_size)
    return {
        "q_proj": (hidden, heads * head), "k_proj": (hidden, kv_heads * head), "v_proj": (hidden, kv_heads * head),
        "o_proj": (heads * head, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


def read_adapter_config(path: str) -> AdapterConfig:
    """The adapter's rank, scaling and targets; ValueError naming what is missing or unsupported."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE} (expected a PEFT LoRA adapter folder)")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_FILE}")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora_path: cannot read {config_path}: {exc}") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter_config.peft_type: only LORA adapters are served, got {raw.get('peft_type')!r}")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter_config.r: expected a positive integer, got {rank!r}")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if raw.get(field):
            raise ValueError(f"adapter_config.{field}: not supported (every target module must share r and alpha)")
    if raw.get("use_dora"):
        raise ValueError("adapter_config.use_dora: DoRA adapters are not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"adapter_config.bias: only 'none' is supported, got {raw.get('bias')!r}")
    if raw.get("fan_in_fan_out"):
        raise ValueError("adapter_config.fan_in_fan_out: not supported (Conv1D-style weights)")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = [m for m in SUPPORTED_MODULES if re.fullmatch(targets, m) or targets == m]
    alpha = float(raw.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank=rank, scaling=scaling, target_modules=tuple(sorted(set(targets))))


def _weight_shapes(path: str) -> dict[tuple[int, str, str], tuple[int, ...]]:
    """(layer, module, "A"|"B") -> shape, from the safetensors header; ValueError for any other tensor."""
    from safetensors import safe_open

    shapes: dict[tuple[int, str, str], tuple[int, ...]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = _KEY_RE.search(key)
            if m is None:
                raise ValueError(f"adapter weights: {key!r} is not a LoRA weight of a decoder layer's projection "
                                 f"(supported targets: {', '.join(SUPPORTED_MODULES)})")
            shapes[(int(m.group(1)), m.group(2), m.group(3))] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_adapter(path: str, hf_config: Any, max_lora_rank: int) -> AdapterConfig:
    """The adapter's config if it fits the base model and the engine's max_lora_rank, else a ValueError
    that says why (rank too large, a target module the model has not, a hidden size that differs)."""
    config = read_adapter_config(path)
    if config.rank > max_lora_rank:
        raise ValueError(f"lora rank: the adapter's r={config.rank} exceeds max_lora_rank={max_lora_rank}")
    shapes = module_shapes(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    for (layer, module, ab), shape in _weight_shapes(path).items():
        if module not in shapes:
            raise ValueError(f"target_modules: the adapter adapts {module!r}, which the base model does not have "
                             f"(supported: {', '.join(SUPPORTED_MODULES)})")
        if layer >= num_layers:
            raise ValueError(f"adapter weights: layer {layer} is past the base model's {num_layers} layers")
        in_features, out_features = shapes[module]
        want = (config.rank, in_features) if ab == "A" else (out_features, config.rank)
        if shape != want:
            raise ValueError(
                f"base model mismatch: the adapter's layers.{layer}.{module}.lora_{ab} is {list(shape)}, the base "
                f"model needs {list(want)} (hidden_size {int(hf_config.hidden_size)}, rank {config.rank}); the "
                "adapter was trained on another base model"
            )
    return config


@dataclass
class AdapterWeights:
    """An adapter in host memory: scaling and, per (layer, module), (A [r, in], B [out, r])."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(path: str, layers: range, dtype: torch.dtype) -> AdapterWeights:
    """The adapter's A/B pairs for `layers` (this pipeline stage's), read from disk in `dtype`."""
    from safetensors import safe_open

    config = read_adapter_config(path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = _KEY_RE.search(key)
            if m is None:
                raise ValueError(f"adapter weights: unexpected tensor {key!r}")
            layer, module = int(m.group(1)), m.group(2)
            if layer in layers:
                halves.setdefault((layer, module), {})[m.group(3)] = f.get_tensor(key).to(dtype)
    weights = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter weights: layers.{where[0]}.{where[1]} has lora_{''.join(pair)} only")
        weights[where] = (pair["A"], pair["B"])
    return AdapterWeights(rank=config.rank, scaling=config.scaling, weights=weights)
