"""Ray: worker groups, the Ray executor, and the cluster-facing services.

Kept free of eager imports so that importing one submodule does not start or import Ray."""
