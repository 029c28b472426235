"""Disaggregated prefill/decode on Ray: the Ray KV transport, prefill and decode engine pools, the PD
client (router) and its Serve app (docs/architecture.md, "Disaggregated prefill / decode")."""
