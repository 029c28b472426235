"""The engine core: requests, the waiting queues and scheduler, the block pool and KV cache manager, and
`EngineCore`, which steps them one batch at a time."""
