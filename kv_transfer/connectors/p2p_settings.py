"""The torch_p2p transport's settings: its keys of `kv_connector_extra_config`, validated once.

Both ends of a deployment normally get the same extra config (the PD app hands one dict to both pools),
so each key means the same on the producer and the consumer. Errors name the key as
`kv_transfer_config.kv_connector_extra_config.<key>`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FIELD_PREFIX = "kv_transfer_config.kv_connector_extra_config"


class P2PSettings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # The address this producer rank advertises in its kv_transfer_params (default: the machine's address
    # on its default route), and the one it listens on (default: kv_host; e.g. 0.0.0.0 behind NAT).
    kv_host: str | None = None
    kv_bind_host: str | None = None
    # A whole read, consumer side; the producer's sends to one reader are bounded by it too.
    read_timeout_s: float = Field(default=60.0, gt=0)
    # Connecting to a producer: TCP, TLS, the secret handshake and the pair group's rendezvous.
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Producer: a connection must finish its TLS and secret handshake within this; a frame, once begun,
    # must arrive in full within it too.
    kv_handshake_timeout_s: float = Field(default=5.0, gt=0)
    # Producer: an authenticated consumer that sends nothing for this long is dropped (it reconnects).
    kv_idle_timeout_s: float = Field(default=600.0, gt=0)
    # Producer: authenticated consumer connections at most (a connection over it is closed at once), and as
    # many handshakes in flight (a new one pushes the oldest out).
    kv_max_connections: int = Field(default=64, ge=1)
    # The watchdog timeout of NCCL pair groups: one transfer may take this long before the pair's
    # communicator is aborted (the process never is). Gloo pairs pass their own timeout to every wait.
    kv_nccl_timeout_s: float = Field(default=600.0, gt=0)
    # Consumer: after a failed connect to a producer rank, reads and releases to it fail at once for this
    # long (reads then compute their prompt) instead of trying again on every step.
    kv_reconnect_backoff_s: float = Field(default=5.0, ge=0)
    # Optional TLS on the control connections (stdlib ssl): this engine's certificate and key, and the CA
    # that peers' certificates must chain to (producer: then clients must present one too).
    kv_tls_certfile: str | None = None
    kv_tls_keyfile: str | None = None
    kv_tls_cafile: str | None = None

    @property
    def tls(self) -> bool:
        return bool(self.kv_tls_certfile or self.kv_tls_keyfile or self.kv_tls_cafile)


def _message(error: dict[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in ("float_parsing", "float_type"):
        return "must be a number of seconds"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be an integer"
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    return str(error["msg"])


def parse_settings(extra: dict[str, Any]) -> P2PSettings:
    """Validate the torch_p2p keys of an extra config; ValueError naming the first bad key."""
    try:
        settings = P2PSettings.model_validate(extra)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{FIELD_PREFIX}.{where}: {_message(first)}") from None
    if settings.kv_tls_keyfile and not settings.kv_tls_certfile:
        raise ValueError(f"{FIELD_PREFIX}.kv_tls_keyfile: needs kv_tls_certfile (the certificate it belongs to)")
    return settings
