"""KV transports, one module each (see kv_transfer/registry.py for the names)."""
