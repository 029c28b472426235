"""Per-request pooling parameters (vLLM's `PoolingParams`): how a prompt's hidden states become one
embedding vector.

A pooling request is a prefill-only request in the same continuous batch as generation: the model
runner gathers the final-norm hidden states of its prompt positions across its prefill chunks and the
request finishes after its prefill, without sampling. `pooling_type` picks the positions: "last" (the
last prompt token: what a decoder-only model's causal attention summarizes the whole prompt into),
"mean" (every prompt position) or "cls" (the first). Fields left None take the engine's defaults
(`EngineConfig.pooling`, `EngineConfig.normalize_embeddings`); `Processor.process` resolves them.
`dimensions` keeps the first that many components (then normalizes, when normalizing: Matryoshka
truncation, as OpenAI's `dimensions`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean", "cls")


class PoolingParams(BaseModel):
    """How to pool one prompt's hidden states into an embedding (None: the engine's default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = Field(default=None, ge=1)

    @property
    def needs_every_position(self) -> bool:
        """Mean and cls pooling read hidden states that a prefix-cache hit would not recompute."""
        return self.pooling_type in ("mean", "cls")

    def resolved(self, default_type: str, default_normalize: bool, hidden_size: int) -> PoolingParams:
        """A copy with the engine's defaults filled in; `dimensions` above the hidden size is refused."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions: the model's embeddings have {hidden_size} dimensions, "
                             f"got {self.dimensions}")
        return PoolingParams(
            pooling_type=self.pooling_type or default_type,  # type: ignore[arg-type]
            normalize=default_normalize if self.normalize is None else self.normalize,
            dimensions=self.dimensions,
        )
