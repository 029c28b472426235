"""The cluster layer, cut by role (docs/architecture.md, "cluster/, room by room").

- `serving/`: the OpenAI HTTP API only (one module per endpoint family, one place for errors).
- `serve/`: Ray Serve deployments (the engine host, the one ingress), request routers, app builders.
- `executor/`: Ray worker groups, the Ray executor, placement.
- `pd/`: what is PD-specific about KV over Ray: the Ray KV transport and signed reads.
- top: what every room reads (`engine_client.EngineClient`, `settings`, `pd_settings`, `engine_stats`,
  `fleet_stats`), and the CLI.

Imports run one way (tests/test_layout.py): serving -> top <- serve, pd; serve -> pd, executor.
Kept free of eager imports so that importing one submodule does not start or import Ray."""
