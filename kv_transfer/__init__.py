"""KV connectors: ship a prompt's KV cache between engines (prefill -> decode)."""
