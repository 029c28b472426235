"""Tensor- and pipeline-parallel building blocks on torch.distributed.

Nothing here holds global state: every layer and collective takes a
`ParallelContext` explicitly, so several engines can live in one process.
"""

from pagedserve.parallel.state import ParallelContext, destroy_distributed, init_distributed

__all__ = ["ParallelContext", "init_distributed", "destroy_distributed"]
