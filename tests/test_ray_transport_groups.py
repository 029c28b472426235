"""How the `ray` KV transport groups a read's layers into calls: a fixed `ray_layers_per_call`, or by
default as many layers as carry `ray_min_call_bytes` of KV (a short prompt's KV in one call, a long
prompt's a group at a time so that its later layers still overlap the consumer's forward)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster.pd.ray_transport import DEFAULT_MIN_CALL_BYTES, RayTransport
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.kv_source import ReadSpec
from pagedserve.kv_transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=24, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)


def transport(**extra) -> RayTransport:
    config = KVTransferConfig(kv_connector="ray", kv_role="kv_consumer", kv_secret="s" * 32,
                              kv_connector_extra_config=extra)
    return RayTransport(config, LAYOUT, 0, torch.device("cpu"))


def spec(num_tokens: int, heads: int = 8) -> ReadSpec:
    return ReadSpec("r", "t", 0, num_tokens, tuple(range(LAYOUT.num_layers)), 0, heads)


def test_short_prompts_go_in_one_call_long_ones_in_groups():
    t = transport()
    layer_bytes = lambda n: 2 * n * 8 * 128 * 2  # noqa: E731 - K and V, 8 heads x 128, bf16
    assert t.group_size(spec(32)) == LAYOUT.num_layers  # 128 KiB in all: one call
    long = 4096  # 16 MiB per layer: every layer its own call
    assert layer_bytes(long) >= DEFAULT_MIN_CALL_BYTES and t.group_size(spec(long)) == 1
    middle = 512  # 2 MiB per layer: two layers make the 4 MiB
    assert t.group_size(spec(middle)) == -(-DEFAULT_MIN_CALL_BYTES // layer_bytes(middle)) == 2
    # A TP consumer reads a slice of the heads: fewer bytes per layer, more layers per call.
    assert t.group_size(spec(middle, heads=4)) == 4


@pytest.mark.parametrize("fixed", [1, 3, 64])
def test_a_fixed_layers_per_call_wins(fixed):
    assert transport(ray_layers_per_call=fixed).group_size(spec(32)) == fixed
    assert transport(ray_layers_per_call=fixed).group_size(spec(8192)) == fixed


def test_the_byte_floor_is_configurable():
    assert transport(ray_min_call_bytes=1).group_size(spec(32)) == 1
    assert transport(ray_min_call_bytes=1 << 40).group_size(spec(8192)) == LAYOUT.num_layers
