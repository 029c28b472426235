"""What runs a batch: the model runner, the worker that hosts it (one per rank), the executors that
drive workers, attention metadata, and start-up checks/warm-up for the device."""
