"""Ray under one engine: the worker group (one Ray actor per TP/PP rank), the Ray executor the engine
core drives it through, placement (placement groups, bundles, custom resources) and Ray helpers."""
