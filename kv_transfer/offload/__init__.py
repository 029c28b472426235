"""The KV offload tier: blocks evicted from an engine's prefix cache spill to host shared memory (or a local
disk) and are loaded back on a later prefix hit through the KV connector machinery (docs/architecture.md,
"KV offload")."""
