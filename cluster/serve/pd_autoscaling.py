"""Autoscaling the PD pools on signals that suit each role (a Ray Serve custom autoscaling policy).

Every engine replica reports custom autoscaling metrics (`EngineHost.record_autoscaling_stats`):
"queued_prompt_tokens" (prompt tokens of the requests in flight on it: for a prefill replica, whose
requests each compute a prompt and one token, that is its queue of prefill work), "num_seqs"
(sequences running or waiting in its scheduler) and "kv_cache_usage". Serve averages them per replica
over `look_back_period_s`; this policy turns their sum into a replica count:

- prefill: sum(queued_prompt_tokens) / target_queued_prompt_tokens (`--prefill-target-queued-prompt-tokens`)
- decode: the larger of sum(num_seqs) / target_num_seqs (`--decode-target-num-seqs`) and
  sum(kv_cache_usage) / target_kv_usage (`--decode-target-kv-usage`): long outputs fill the KV cache
  before they fill the batch.

Serve then applies min/max replicas and the upscale/downscale delays (its wrapper around every custom
policy). Until a replica has reported, the count stays where it is.
"""

from __future__ import annotations

from typing import Any

POLICY_FUNCTION = "pagedserve.cluster.serve.pd_autoscaling:RoleAutoscalingPolicy"


class RoleAutoscalingPolicy:
    """Serve instantiates it once per deployment (`policy_kwargs`) and calls it every control-loop tick."""

    def __init__(self, metric: str, target: float, kv_usage_target: float | None = None) -> None:
        if target <= 0:
            raise ValueError(f"target: must be > 0, got {target}")
        if kv_usage_target is not None and not 0 < kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target: must be in (0, 1], got {kv_usage_target}")
        self.metric = metric
        self.target = float(target)
        self.kv_usage_target = kv_usage_target

    def desired(self, metrics: dict[str, dict[Any, float]]) -> float | None:
        """Replicas wanted for these per-replica averages (None: nothing reported yet)."""
        values = metrics.get(self.metric)
        if not values:
            return None
        wanted = sum(values.values()) / self.target
        usage = metrics.get("kv_cache_usage") if self.kv_usage_target is not None else None
        if usage:
            wanted = max(wanted, sum(usage.values()) / self.kv_usage_target)
        return wanted

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        wanted = self.desired(ctx.aggregated_metrics or {})
        return (ctx.target_num_replicas if wanted is None else wanted), {}


def role_policy(role: str, args: Any) -> dict[str, Any]:
    """The `policy` entry of one pool's autoscaling_config."""
    if role == "prefill":
        kwargs: dict[str, Any] = {"metric": "queued_prompt_tokens", "target": args.prefill_target_queued_prompt_tokens}
    else:
        kwargs = {"metric": "num_seqs", "target": args.decode_target_num_seqs,
                  "kv_usage_target": args.decode_target_kv_usage}
    return {"policy_function": POLICY_FUNCTION, "policy_kwargs": kwargs}
