"""The PD shape of `ServeArgs`: which pools to start, with which layouts, and whether they can
exchange KV (checked at start-up, both layouts named, before any engine starts)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedserve.kv_transfer.config import ConnectorExtraConfig
from pagedserve.kv_transfer.layout import KVLayout, check_compatible
from pagedserve.kv_transfer.registry import CONNECTORS

PD_FIELDS = ("num_prefill_engines", "num_decode_engines")


def pool_scaling(args: Any, role: str) -> tuple[int, int, int] | None:
    """(min, initial, max) replicas of an autoscaled pool, or None for a fixed num_*_engines."""
    low, high = getattr(args, f"{role}_min_replicas"), getattr(args, f"{role}_max_replicas")
    if low is None and high is None:
        return None
    count = int(getattr(args, f"num_{role}_engines"))
    low = low if low is not None else 1
    high = high if high is not None else max(low, count)
    return low, min(max(count, low), high), high


def side_layout_kwargs(args: Any, role: str) -> dict[str, int]:
    """tensor/pipeline parallel sizes of one pool's engines (the shared flags unless the pool's own are set)."""
    tp = getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
    pp = getattr(args, f"{role}_pipeline_parallel_size") or args.pipeline_parallel_size
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}


def layout_of(hf_config: Any, dtype: str, block_size: int, tp: int, pp: int) -> KVLayout:
    """The KV layout an engine of this model and parallel shape will have (what its ranks report)."""
    heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return KVLayout(num_layers=int(hf_config.num_hidden_layers), num_kv_heads=heads, head_size=int(head_size),
                    dtype=dtype, block_size=block_size, tp_size=tp, pp_size=pp)


def check_pd_args(args: Any) -> None:
    """Raise ValueError naming the field when the PD settings are incomplete or the two pools' layouts
    cannot exchange KV."""
    given = [f for f in PD_FIELDS if getattr(args, f) is not None]
    for role in ("prefill", "decode"):
        low, high = getattr(args, f"{role}_min_replicas"), getattr(args, f"{role}_max_replicas")
        if (low is not None or high is not None) and len(given) < 2:
            field = f"{role}_min_replicas" if low is not None else f"{role}_max_replicas"
            raise ValueError(f"{field}: autoscales a PD pool; set num_prefill_engines and num_decode_engines too")
        if low is not None and high is not None and high < low:
            raise ValueError(f"{role}_max_replicas: must be >= {role}_min_replicas ({low}), got {high}")
    if len(given) == 1:
        missing = next(f for f in PD_FIELDS if f not in given)
        raise ValueError(f"{missing}: prefill/decode disaggregation needs both num_prefill_engines and "
                         f"num_decode_engines (got only {given[0]})")
    if not given:
        return
    if args.kv_connector not in CONNECTORS or args.kv_connector == "inproc":
        choices = sorted(c for c in CONNECTORS if c != "inproc")
        raise ValueError(f"kv_connector: {args.kv_connector!r} cannot join engine pools (they run in separate "
                         f"processes); choose one of {choices}")
    if args.kv_transfer_config is not None:
        raise ValueError("kv_transfer_config: set by the PD pools themselves; use kv_connector and "
                         "kv_connector_extra_config instead")
    if args.autoscaling or args.data_parallel_size != 1:
        raise ValueError("data_parallel_size: the PD shape sizes its pools with num_prefill_engines / "
                         "num_decode_engines (min/max_replicas and data_parallel_size do not apply)")
    try:
        ConnectorExtraConfig.model_validate(args.kv_connector_extra_config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"kv_connector_extra_config: {where}: {first['msg']}") from None
    if args.hf_config is None and args.model is not None:
        from pagedserve.engine.config import EngineConfig

        hf_config = EngineConfig(model=args.model).resolve().hf_config
    else:
        hf_config = args.hf_config
    if hf_config is None:
        return
    layouts = {}
    for role in ("prefill", "decode"):
        sizes = side_layout_kwargs(args, role)
        layouts[role] = layout_of(hf_config, args.dtype, args.block_size, sizes["tensor_parallel_size"],
                                  sizes["pipeline_parallel_size"])
    both = f"prefill layout: {layouts['prefill'].describe()}; decode layout: {layouts['decode'].describe()}"
    for role, layout in layouts.items():
        tp, heads = layout.tp_size, layout.num_kv_heads
        if heads % tp and tp % heads:
            raise ValueError(f"{role}_tensor_parallel_size: {tp} neither divides nor is a multiple of the model's "
                             f"{heads} KV heads, so its KV heads cannot be re-sliced ({both})")
        if layout.pp_size > layout.num_layers:
            raise ValueError(f"{role}_pipeline_parallel_size: {layout.pp_size} stages for {layout.num_layers} "
                             f"layers ({both})")
    try:
        check_compatible(layouts["decode"], layouts["prefill"])
    except ValueError as exc:
        raise ValueError(f"decode_tensor_parallel_size: the pools cannot exchange KV ({both}): {exc}") from None
