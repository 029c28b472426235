"""LoRA adapters on the OpenAI API: the adapters served by name, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (behind the API key, as every /v1 route).

A request selects an adapter by its `model` name; the adapter's `LoRARequest` then travels to whichever
engine replica serves it inside the request's sampling params (key "lora_request"), so every replica (and
both legs of a prefill/decode pair) runs it, loading it from disk on first use. Adapters named by
--lora-modules are loaded at start-up.

Adapter ids (`LoRARequest.lora_int_id`: an engine's resident slot and prefix-cache identity) are shared by
every ingress replica's requests on the same engines, so they never come from a per-replica counter: an
adapter of --lora-modules gets an id derived from its name and path (every ingress replica serves it under
the same id, sharing slots and cached blocks), and a run-time load a random 62-bit one (a fresh identity, so
blocks an unloaded adapter left in a prefix cache are never hits for a later adapter of the same name, and
two ingress replicas that load different adapters never hand an engine one id for both).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.serving.errors import APIError
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.lora.adapter import check_adapter
from pagedserve.engine.lora.request import SAMPLING_KEY, LoRARequest



class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... -> [(name, path)]; ValueError naming a malformed one."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected NAME=PATH, got {spec!r}")
        out.append((name.strip(), path.strip()))
    return out


class LoRAAdapters:
    """The adapters one app serves, by the name clients put in `model`."""

    def __init__(self, args: ServeArgs, base_name: str) -> None:
        self.args = args
        self.base_name = base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._hf_config: Any = None
        for name, path in parse_lora_modules(args.lora_modules):
            try:
                self.load(name, path, lora_id=_startup_id(name, path))
            except APIError as exc:
                raise ValueError(f"lora_modules: {name}={path}: {exc}") from None

    def _base_config(self) -> Any:
        if self._hf_config is None:
            from pagedserve.engine.config import EngineConfig

            self._hf_config = EngineConfig(**self.args.engine_kwargs()).resolve().hf_config
        return self._hf_config

    def load(self, name: str, path: str, lora_id: int | None = None) -> LoRARequest:
        """Check the adapter against the base model and max_lora_rank, then serve it as `name` (APIError 400)
        under `lora_id` (default: a fresh random one)."""
        if not self.args.enable_lora:
            raise APIError(400, "lora_name: the server was started without --enable-lora", param="lora_name")
        if name == self.base_name or name in self.by_name:
            raise APIError(400, f"lora_name: a model named `{name}` is already served", param="lora_name")
        try:
            check_adapter(path, self._base_config(), self.args.max_lora_rank)
        except ValueError as exc:
            raise APIError(400, f"lora_path: {exc}", param="lora_path") from None
        lora = LoRARequest(name, lora_id if lora_id is not None else secrets.randbits(62) + 1, path)
        self.by_name[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", type="NotFoundError",
                           param="lora_name", code="model_not_found")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name nobody serves."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                           code="model_not_found")
        return lora


def _startup_id(name: str, path: str) -> int:
    """The id of a --lora-modules adapter: the same on every ingress replica started with the same flags."""
    digest = hashlib.sha256(f"lora-module\0{name}\0{path}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 2) + 1


def with_adapter(params: list[dict], lora: LoRARequest | None) -> list[dict]:
    """Each request's sampling params dict carrying its adapter (unchanged for the base model)."""
    if lora is None:
        return params
    return [{**p, SAMPLING_KEY: asdict(lora)} for p in params]
