"""Pipeline-parallel helpers: which layers a stage owns and what flows between stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Contiguous, balanced [start, end) of the layers owned by stage ``pp_rank``.

    Layer counts differ by at most one; the earlier stages take the extra layers
    (the last stage also runs the final norm and the LM head).
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if num_layers < pp_size:
        raise ValueError(f"num_layers ({num_layers}) must be >= pp_size ({pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    end = start + base + (1 if pp_rank < extra else 0)
    return start, end


@dataclass
class IntermediateTensors:
    """Activations handed from one pipeline stage to the next."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"hidden_states": self.hidden_states, "residual": self.residual}

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> "IntermediateTensors":
        missing = {"hidden_states", "residual"} - tensors.keys()
        if missing:
            raise ValueError(f"intermediate tensors missing {sorted(missing)}")
        return cls(hidden_states=tensors["hidden_states"], residual=tensors["residual"])
