"""`kv_transfer_config`: which KV connector an engine runs and in which role (vLLM's shape).

    {"kv_connector": "ray" | "torch_p2p" | "inproc",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_connector_extra_config": {"hold_timeout_s": 120, ...}}

A producer (prefill engine) keeps the blocks of a finished prompt alive for a reader; a consumer
(decode engine) loads a prompt's KV from a producer instead of computing it; `kv_both` does either,
per request (`kv_transfer_params` of the request decides).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from pagedserve.kv_transfer.registry import CONNECTORS

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class ConnectorExtraConfig(BaseModel):
    """Options every connector understands; a transport may read more keys (extra keys are kept)."""

    model_config = ConfigDict(extra="allow")

    # How long a producer keeps a finished prefill's blocks for its reader before freeing them.
    hold_timeout_s: float = Field(default=120.0, gt=0)
    # A consumer gives up on a read that takes longer than this and computes the prompt itself.
    read_timeout_s: float = Field(default=60.0, gt=0)


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_connector: str
    kv_role: KVRole
    kv_connector_extra_config: ConnectorExtraConfig = Field(default_factory=ConnectorExtraConfig)
    # This engine's id in kv_transfer_params (readers address it); unique per engine by default.
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    # The deployment's shared KV secret (kv_transfer/auth.py: unset -> PAGEDSERVE_KV_SECRET, _FILE, or per
    # process). A SecretStr: never shown in reprs or logs; never sent on the wire by any transport.
    kv_secret: SecretStr | None = None

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, v: str) -> str:
        if v not in CONNECTORS:
            raise ValueError(f"kv_connector: unknown connector {v!r}; choose one of {sorted(CONNECTORS)}")
        return v

    @field_validator("kv_secret")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        from pagedserve.kv_transfer.auth import MIN_SECRET_BYTES

        if v is not None and len(v.get_secret_value().strip().encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"the KV secret must be at least {MIN_SECRET_BYTES} characters")
        return v

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def secret(self) -> bytes:
        """The secret this engine's transport authenticates peers with."""
        from pagedserve.kv_transfer.auth import resolve_secret

        return resolve_secret(self.kv_secret.get_secret_value() if self.kv_secret is not None else None)

    @property
    def extra(self) -> dict[str, Any]:
        return self.kv_connector_extra_config.model_dump()


def parse_kv_transfer_config(value: dict[str, Any] | KVTransferConfig | None) -> KVTransferConfig | None:
    """Validate `EngineConfig.kv_transfer_config`; errors name the field as `kv_transfer_config.<key>`."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    from pydantic import ValidationError

    try:
        return KVTransferConfig.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"kv_transfer_config.{where}: {first['msg'].removeprefix('Value error, ')}") from None
