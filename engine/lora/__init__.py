"""Multi-LoRA serving: adapters in PEFT format applied per token over one base model.

- `request.py`: `LoRARequest` (vLLM's shape), the adapter a request runs under.
- `adapter.py`: reading a PEFT folder, and checking that an adapter fits the base model and the engine.
- `layers.py`: the LoRA wrappers of the q/k/v/o and gate/up/down projections (TP-sharded A/B stacks).
- `batch.py`: one step's token -> adapter slot mapping, grouped by slot (the segments of the kernel).
- `manager.py`: a worker's resident slots and host-memory cache, both LRU; wraps the model.
"""

from pagedserve.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
