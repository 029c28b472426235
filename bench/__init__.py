"""`pagedserve bench latency|throughput|serve|report` and `pagedserve tune`: benchmarks as a user runs
them, one JSON report shape for all of them, and the roofline beside every figure (docs/benchmarks.md)."""
