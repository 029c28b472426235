from pagedserve.engine.worker.executor.base import Executor

__all__ = ["Executor"]
