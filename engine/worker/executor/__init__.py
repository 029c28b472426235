from pagedserve.engine.executor.base import Executor

__all__ = ["Executor"]
