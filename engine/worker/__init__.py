"""What runs a batch: the model runner, the worker that hosts it (one per rank), the executors that
drive workers, the persistent input batch, decode CUDA graphs, the speculator and CUDA warm-up."""
