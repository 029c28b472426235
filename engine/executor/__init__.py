from engine.executor.base import Executor

__all__ = ["Executor"]
