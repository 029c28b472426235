"""`ServeArgs`: the one validated configuration behind `pagedserve serve` and the Serve app builder.

Request limits live here too: `max_n` (n and best_of), `max_logprobs` (logprobs, top_logprobs,
prompt_logprobs; an engine field, vLLM's default 20), `max_prompts_per_request` (the prompts of one
completions body), `max_request_body_bytes` (also the longest rendered chat prompt, in characters),
`tokenizer_pool_size` (threads that tokenize and render chat templates off the event loop),
`trust_request_chat_template` and `metrics_require_auth`.

Tool calling: `enable_auto_tool_choice` with `tool_call_parser` (one of
`engine.tool_parsers.TOOL_PARSERS`) lets a request's tool_choice be "auto" (vLLM's pair of flags);
"required", named and "none" work without them.

The API key: `api_key` (the --api-key flag, visible in `ps`), else the stripped contents of
`api_key_file`, else $PAGEDSERVE_API_KEY. Replicas get its SHA-256 only (`to_dict`).
"""

from __future__ import annotations

import logging

import hashlib
import ipaddress
import os
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.models.default_model import DEFAULT_MODEL_NAME, is_default_model, resolve_default_model

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Prompts in one /v1/completions body: a static ceiling the validation checks before any per-prompt work,
# and the bound of the setting below (each prompt becomes n engine requests).
MAX_PROMPTS = 4096
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
# How the engine deployment's request router picks a replica (cluster/serve/routing_policy.py): uniformly at
# random, the less loaded of two random replicas, approximate prefix affinity (the prefixes replicas reported
# serving and where this router sent them), or exact: what each replica's KV cache holds, from its KV events.
ROUTING_POLICIES = ("random", "power_of_two", "prefix_approx", "exact")


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


class ServeArgs(EngineConfig):
    """`pagedserve serve` / `build_app` arguments: the engine's `EngineConfig` fields plus the service's."""

    model: str | None = Field(default=None, validate_default=True)  # type: ignore[assignment]
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    address: str | None = None
    data_parallel_size: int = Field(default=1, ge=1)
    api_key: str | None = Field(default_factory=_api_key_from_env, repr=False)
    api_key_file: str | None = None  # read (and stripped) at start when no api_key is given
    # What the replicas get instead of the key itself (Serve shows deployment args in its status).
    api_key_sha256: str | None = Field(default=None, repr=False, pattern=r"^[0-9a-f]{64}$")
    max_pending_requests: int = Field(default=1024, ge=1)
    # A streamed request's deltas leave its engine at most once per this many generated tokens (the first
    # tokens and the finish at once): one Ray stream item and one SSE event per merge (vLLM's --stream-interval).
    # "auto" (the default): 1 while an engine has few streams open, more as they grow
    # (engine.delta_coalescer.auto_interval), as Ray Serve LLM batches its streams by default.
    stream_interval: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = "auto"
    num_cpus_per_engine: float = Field(default=1.0, ge=0.0)
    app_name: str = "pagedserve"
    max_n: int = Field(default=16, ge=1, le=1024)
    max_prompts_per_request: int = Field(default=DEFAULT_MAX_PROMPTS_PER_REQUEST, ge=1, le=MAX_PROMPTS)
    max_request_body_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1024)
    tokenizer_pool_size: int = Field(default=2, ge=1, le=64)
    trust_request_chat_template: bool = False
    metrics_require_auth: bool = False
    # Tracing (cluster/serving/tracing.py; needs pagedserve[otel]): OTLP/HTTP endpoint of the trace
    # collector, e.g. http://127.0.0.1:4318/v1/traces (else OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT turns it on).
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float | None = Field(default=None, ge=0.0, le=1.0)  # default OTEL_TRACES_SAMPLER_ARG or 1
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Scale-out on Serve (`serve_app`): the engine deployment's replicas are the data-parallel engines.
    min_replicas: int | None = Field(default=None, ge=0)  # set min/max to autoscale the engine replicas
    max_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float = Field(default=32.0, gt=0)  # per engine replica, for autoscaling
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)  # Serve's default (600 s) suits no LLM fleet
    autoscaling_look_back_period_s: float = Field(default=30.0, gt=0)  # the window Serve averages metrics over
    num_ingress_replicas: int = Field(default=1, ge=1)
    # The ingress replica listens on `port` itself, without Serve's HTTP proxy (cluster/serve/direct_ingress.py):
    # None (the default): where it can, on a Ray this process starts with one ingress replica; True: that or
    # an error; False: always through Serve's proxy.
    direct_ingress: bool | None = None
    graceful_shutdown_timeout_s: float = Field(default=60.0, gt=0)  # a removed engine finishes its requests
    # Fault tolerance (cluster/serve/migration.py): times one request may move to another engine after
    # the one serving it failed, before the client gets an error.
    max_migrations: int = Field(default=3, ge=0)
    routing_stats_period_s: float = Field(default=1.0, gt=0)
    affinity_blocks: int = Field(default=4, ge=0)
    imbalance_factor: float = Field(default=2.0, ge=1.0)
    imbalance_slack: float = Field(default=2.0, ge=0.0)
    kv_weight: float = Field(default=4.0, ge=0.0)
    routing_policy: str = "exact"  # one of ROUTING_POLICIES
    # Prefill/decode disaggregation (`cluster/pd/`): both counts set -> a prefill pool and a decode pool.
    num_prefill_engines: int | None = Field(default=None, ge=1)
    num_decode_engines: int | None = Field(default=None, ge=1)
    prefill_tensor_parallel_size: int | None = Field(default=None, ge=1)  # default: tensor_parallel_size
    decode_tensor_parallel_size: int | None = Field(default=None, ge=1)
    prefill_pipeline_parallel_size: int | None = Field(default=None, ge=1)  # default: pipeline_parallel_size
    decode_pipeline_parallel_size: int | None = Field(default=None, ge=1)
    kv_connector: str = "ray"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)  # hold_timeout_s, read_timeout_s, ...
    prefill_resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources pinning a pool
    decode_resources: dict[str, float] = Field(default_factory=dict)
    # Multi-LoRA (with enable_lora): adapters served from the start, NAME=PATH (PEFT folders); clients pick
    # one by its name in `model` (cluster/serving/lora.py).
    lora_modules: list[str] = Field(default_factory=list)
    # PD autoscaling, per pool (`pd_autoscaling`): set a pool's min/max to autoscale it from its
    # num_*_engines; the targets are per replica: prefill by prompt tokens in flight (its queue), decode by
    # sequences running or waiting, or by KV usage, whichever asks for more replicas.
    prefill_min_replicas: int | None = Field(default=None, ge=1)
    prefill_max_replicas: int | None = Field(default=None, ge=1)
    decode_min_replicas: int | None = Field(default=None, ge=1)
    decode_max_replicas: int | None = Field(default=None, ge=1)
    prefill_target_queued_prompt_tokens: float = Field(default=8192.0, gt=0)
    decode_target_num_seqs: float = Field(default=32.0, gt=0)
    decode_target_kv_usage: float = Field(default=0.85, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _read_api_key_file(cls, data: Any) -> Any:
        """--api-key wins over --api-key-file, which wins over $PAGEDSERVE_API_KEY."""
        if isinstance(data, dict) and data.get("api_key_file") is not None and data.get("api_key") is None:
            data = {**data, "api_key": read_api_key_file(str(data["api_key_file"]))}
        return data

    @field_validator("routing_policy")
    @classmethod
    def _check_routing_policy(cls, v: str) -> str:
        return check_routing_policy(v)

    @model_validator(mode="after")
    def _check_replicas(self) -> "ServeArgs":
        low = self.min_replicas if self.min_replicas is not None else 1
        if self.max_replicas is not None and self.max_replicas < low:
            raise ValueError(f"max_replicas: must be >= min_replicas ({low}), got {self.max_replicas}")
        if self.direct_ingress and self.num_ingress_replicas != 1:
            raise ValueError(f"direct_ingress: one ingress replica listens on the port itself; with "
                             f"num_ingress_replicas {self.num_ingress_replicas} leave it unset (Serve's proxy)")
        if self.direct_ingress and self.address not in (None, "local"):  # "local": a new Ray of its own
            raise ValueError("direct_ingress: needs a Ray that this process starts; with --address the server is "
                             "reached through Serve's proxy (leave it unset)")
        return self

    @model_validator(mode="after")
    def _check_tool_calling(self) -> "ServeArgs":
        from pagedserve.engine.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser (which format the model writes calls in)")
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            # Accepted as vLLM accepts it (a config carried over keeps starting), but said: the parser only
            # reads tool_choice 'auto' output, which stays refused without enable_auto_tool_choice.
            logging.getLogger(__name__).warning(
                "tool_call_parser=%r has no effect without enable_auto_tool_choice: requests with tool_choice "
                "'auto' are refused; 'required' and named choices work either way", self.tool_call_parser)
        return self

    @model_validator(mode="after")
    def _check_pd(self) -> "ServeArgs":
        from pagedserve.cluster.pd_settings import check_pd_args

        check_pd_args(self)
        return self

    @model_validator(mode="after")
    def _check_draft(self) -> "ServeArgs":
        """A draft model is checked here, before any replica starts: a wrong path or a vocabulary that
        differs from the target's is a `speculative_config.model` error at the CLI, not a failing replica."""
        spec = self.speculative
        if spec is None or spec.method != "draft_model" or self.model is None:
            return self
        from pagedserve.engine.spec_decode.config import check_draft_compatible, load_draft_hf_config

        draft = load_draft_hf_config(spec)
        target = self.hf_config or EngineConfig(model=self.model).resolve().hf_config
        check_draft_compatible(spec, target, draft)
        return self

    @property
    def disaggregated(self) -> bool:
        """A prefill pool and a decode pool (`cluster/pd/`) instead of one engine deployment."""
        return self.num_prefill_engines is not None and self.num_decode_engines is not None

    @property
    def autoscaling(self) -> bool:
        """Whether the engine replicas autoscale (min or max replicas given) or are a fixed DP size."""
        return self.min_replicas is not None or self.max_replicas is not None

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, v: str | None) -> str:
        if v is None:
            return resolve_default_model()
        if not (os.path.isdir(v) or (os.path.isfile(v) and v.lower().endswith(".gguf"))):
            raise ValueError(f"{v!r} is neither a local directory nor a .gguf file (pagedserve loads HF-format "
                             "folders and GGUF files)")
        return v

    @property
    def model_name(self) -> str:
        """The name clients put in `model` (served_model_name, else the model argument as given)."""
        if self.served_model_name:
            return self.served_model_name
        if is_default_model(self.model):  # type: ignore[arg-type]
            return DEFAULT_MODEL_NAME
        return self.model  # type: ignore[return-value]

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `EngineConfig`: the engine fields that were set, plus the model."""
        fields = set(EngineConfig.model_fields) - {"hf_config"}
        kwargs = {k: getattr(self, k) for k in fields if k in self.model_fields_set}
        kwargs["model"] = self.model
        return kwargs

    @property
    def api_key_digest(self) -> str | None:
        """SHA-256 (hex) of the API key requests must present, or None when none is required."""
        if self.api_key_sha256 is not None:  # shipped by to_dict: wins over a key in the replica's environment
            return self.api_key_sha256
        if self.api_key is not None:
            return hashlib.sha256(self.api_key.encode()).hexdigest()
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for `build_app(args)` (what a Serve config's `args:` would hold). The API key
        (resolved from the flag, file or environment here, not in the replica's) travels as its SHA-256 only."""
        values = self.model_dump(exclude={"hf_config", "api_key", "api_key_file"}, exclude_unset=True)
        values["model"] = self.model
        if self.api_key_digest is not None:
            values["api_key_sha256"] = self.api_key_digest
        return values


def check_routing_policy(name: str) -> str:
    """`name` when it is one of ROUTING_POLICIES, else a ValueError naming routing_policy."""
    if name not in ROUTING_POLICIES:
        raise ValueError(f"routing_policy: unknown policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}")
    return name


def read_api_key_file(path: str) -> str:
    """The key in `path`, stripped; ValueError naming api_key_file when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file: cannot read {path!r}: {exc}") from None
    if not key:
        raise ValueError(f"api_key_file: {path!r} is empty")
    return key


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` listens on this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(args: ServeArgs) -> str | None:
    """The warning to log at start when the server listens beyond this machine with no API key."""
    if args.api_key_digest is not None or is_loopback_host(args.host):
        return None
    return (f"serving on {args.host}:{args.port} with no API key: anyone who can reach this address can run "
            f"requests on the model (its compute, its KV cache) and read /metrics; set --api-key-file PATH or "
            f"${API_KEY_ENV}, or bind 127.0.0.1")
