"""Training scripts for pagedserve's bundled default model and its draft model."""
