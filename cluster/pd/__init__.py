"""What is PD-specific about moving KV over Ray: the Ray KV transport (`ray_transport`), signed reads
(`read_auth`) and where a consumer's read of one producer rank goes (`rank_server`). The PD pools,
client and app are Serve code (cluster/serve/pd_*.py); their settings are cluster/pd_settings.py."""
