"""Which rank of an engine holds which layers and KV heads, and how a reader re-slices them.

Producer and consumer may be laid out differently (tensor-parallel size, pipeline-parallel size,
block size). KV moves in a layout-free form - per layer, per token, a range of KV heads - so a
consumer rank asks each producer rank for exactly the (layers x heads x tokens) it holds and needs,
and writes them into its own blocks, whatever their size. The model itself must match: layers, KV
heads, head size and dtype; anything else is refused with both layouts named.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedserve.parallel.pipeline import layer_range


@dataclass(frozen=True)
class KVLayout:
    """One engine's KV cache layout (picklable; travels in kv_transfer_params as a dict)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    tp_size: int = 1
    pp_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_size} ({self.dtype}), "
                f"TP={self.tp_size} PP={self.pp_size} block_size={self.block_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def layers_of(self, rank: int) -> range:
        """Global layer indices held by `rank` (rank = pp_rank * tp_size + tp_rank)."""
        start, end = layer_range(self.num_layers, rank // self.tp_size, self.pp_size)
        return range(start, end)

    def heads_of(self, rank: int) -> range:
        """Global KV head indices held by `rank` (replicated when there are fewer heads than TP ranks)."""
        tp_rank = rank % self.tp_size
        if self.num_kv_heads >= self.tp_size:
            per = self.num_kv_heads // self.tp_size
            return range(tp_rank * per, (tp_rank + 1) * per)
        head = tp_rank // (self.tp_size // self.num_kv_heads)
        return range(head, head + 1)


@dataclass(frozen=True)
class ReadPlan:
    """One read a consumer rank makes from one producer rank."""

    remote_rank: int
    layers: tuple[int, ...]  # global layer indices, ascending
    heads: range  # global KV heads to read (a contiguous run held by remote_rank)
    local_head_offset: int  # where `heads` start in the consumer rank's own head range


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ValueError, naming both layouts, if KV cannot move from `remote` to `local`."""
    mismatched = [f for f in ("num_layers", "num_kv_heads", "head_size", "dtype") if getattr(local, f) != getattr(remote, f)]
    if mismatched:
        raise ValueError(
            f"kv_transfer_config: the producer's KV layout ({remote.describe()}) cannot feed this consumer's "
            f"({local.describe()}): {', '.join(mismatched)} differ; both sides must serve the same model and dtype"
        )


def plan_reads(local: KVLayout, local_rank: int, remote: KVLayout) -> list[ReadPlan]:
    """The reads that fill `local_rank`'s layers and heads from `remote`'s ranks. Every (layer, head)
    the local rank holds is read exactly once; a replicated remote head is read from its first holder."""
    check_compatible(local, remote)
    my_layers = local.layers_of(local_rank)
    my_heads = local.heads_of(local_rank)
    plans: list[ReadPlan] = []
    for pp_rank in range(remote.pp_size):
        stage_layers = remote.layers_of(pp_rank * remote.tp_size)
        layers = tuple(l for l in my_layers if l in stage_layers)
        if not layers:
            continue
        # Group my heads into contiguous runs by the remote TP rank that holds them first.
        run_rank, run_start = None, None
        for head in [*my_heads, None]:
            owner = None
            if head is not None:
                owner = next(pp_rank * remote.tp_size + t for t in range(remote.tp_size)
                             if head in remote.heads_of(pp_rank * remote.tp_size + t))
            if owner != run_rank:
                if run_rank is not None:
                    plans.append(ReadPlan(run_rank, layers, range(run_start, head if head is not None else my_heads.stop),
                                          run_start - my_heads.start))
                run_rank, run_start = owner, head
    return plans
