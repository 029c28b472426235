"""The engine core: requests, the waiting queues, the scheduler (a loop over its parts in scheduling/),
the block pool and KV cache manager, and `EngineCore`, which steps them one batch at a time."""
