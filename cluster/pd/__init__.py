"""What is PD-specific about moving KV over Ray: the Ray KV transport (`ray_transport`: a producer
addressed as a Serve replica or a named actor) and signed reads (`read_auth`). The PD pools, client,
autoscaling and app are Serve code (cluster/serve/pd_*.py); their settings are cluster/pd_settings.py."""
