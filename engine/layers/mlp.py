"""The gated (SwiGLU) feed-forward block of Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.parallel.layers import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.parallel.quant import QuantConfig, qtype_of
from pagedserve.parallel.state import ParallelContext


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up are column-parallel and fused, down is row-parallel."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "mlp",
    ) -> None:
        """quant_config/prefix: which of the checkpoint's ``{prefix}.{gate,up,down}_proj.weight`` stay quantized."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], parallel, dtype, bias=bias,
            qtype=qtype_of(quant_config, f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight",
                           in_features=hidden_size),
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, dtype, bias=bias,
                                           qtype=qtype_of(quant_config, f"{prefix}.down_proj.weight",
                                                          in_features=intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # forward called directly: see engine/models/llama.py
        return self.down_proj.forward(kernels.silu_and_mul_unchecked(self.gate_up_proj.forward(x)))
