"""A worker's adapters: `max_loras` resident slots and up to `max_cpu_loras` adapters in host memory.

An adapter is read from disk the first time a step needs it (this rank's layers only) and stays in host
memory, least recently used first out once `max_cpu_loras` are held. A step's adapters are made resident
before its forward pass: one already in a slot is just touched; another takes a free slot or the least
recently used slot whose adapter this step does not need (the scheduler never puts more than
`max_loras` adapters in one step). Every rank of an engine sees the same steps, so every rank makes the
same choices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.lora.adapter import AdapterWeights, load_adapter
from pagedserve.engine.lora.batch import LoRAContext, build_lora_batch
from pagedserve.engine.lora.layers import LoRALinear
from pagedserve.engine.lora.request import LoRARequest

_FUSED = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}


def wrap_model(model: torch.nn.Module, context: LoRAContext, max_loras: int, max_rank: int) -> list[LoRALinear]:
    """Replace the q/k/v/o and gate/up/down projections of every decoder layer on this stage by LoRA wrappers."""
    wrapped: list[LoRALinear] = []
    for i, layer in enumerate(model.model.layers):
        for (block_name, proj_name), modules in _FUSED.items():
            block = getattr(layer, block_name)
            lora = LoRALinear(getattr(block, proj_name), model.start_layer + i, modules, context, max_loras, max_rank)
            setattr(block, proj_name, lora)
            wrapped.append(lora)
    return wrapped


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.context = LoRAContext()
        self.layers = wrap_model(model, self.context, max_loras, max_rank)
        self.stage_layers = range(model.start_layer, model.end_layer)
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self.resident_names: dict[int, str] = {}
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self._slot_scales = np.zeros(max_loras, dtype=np.float64)
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.requests: dict[str, LoRARequest] = {}
        self.num_disk_loads = 0  # adapters read from disk into host memory
        self.num_loads = 0  # adapters installed into a resident slot
        self.num_evictions = 0  # adapters pushed out of a resident slot

    # ------------------------------------------------------------------ requests

    def update(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self.requests[new.req_id] = new.lora_request

    # ------------------------------------------------------------------ the step

    def prepare(self, req_ids: Sequence[str], query_lens: np.ndarray) -> None:
        """Make this step's adapters resident and set the batch the LoRA layers read."""
        wanted: dict[int, LoRARequest] = {}
        for rid in req_ids:
            lora = self.requests.get(rid)
            if lora is not None:
                wanted.setdefault(lora.lora_int_id, lora)
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for lora in wanted.values():
            self._make_resident(lora, wanted)
        if not wanted:
            self.context.batch = None
            return
        slots = np.fromiter(
            (self.resident[lr.lora_int_id] if (lr := self.requests.get(rid)) is not None else -1 for rid in req_ids),
            dtype=np.int64, count=len(req_ids))
        self.context.batch = build_lora_batch(slots, query_lens, self._slot_scales, self.device, self.dtype)

    def _make_resident(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> None:
        lora_id = lora.lora_int_id
        if lora_id in self.resident:
            self.resident.move_to_end(lora_id)
            return
        weights = self._host_weights(lora)
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next(i for i in self.resident if i not in needed)
            slot = self.resident.pop(victim)
            self.resident_names.pop(victim, None)
            self.num_evictions += 1
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in weights.weights.items():
            by_layer.setdefault(layer, {})[module] = pair
        for wrapper in self.layers:
            wrapper.set_slot(slot, by_layer.get(wrapper.layer_idx, {}))
        self._slot_scales[slot] = weights.scaling
        self.resident[lora_id] = slot
        self.resident_names[lora_id] = lora.lora_name
        self.num_loads += 1

    def _host_weights(self, lora: LoRARequest) -> AdapterWeights:
        weights = self.host.get(lora.lora_int_id)
        if weights is not None:
            self.host.move_to_end(lora.lora_int_id)
            return weights
        weights = load_adapter(lora.lora_path, self.stage_layers, self.dtype)
        self.num_disk_loads += 1
        self.host[lora.lora_int_id] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def stats(self) -> dict:
        return {"loads": self.num_loads, "evictions": self.num_evictions, "disk_loads": self.num_disk_loads,
                "resident": sorted(self.resident_names.values())}
