"""Ray Serve: the engine host (the body of every engine deployment), the one ingress deployment (over an engine
client a factory builds), request routers, the engine clients, and the app builders of both shapes
(`app.build_app`; `pd_app.build_pd_app` for prefill/decode disaggregation)."""
