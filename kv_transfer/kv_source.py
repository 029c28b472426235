"""The producer side of a read: one rank's paged KV cache, served only for the holds it was granted.

Every rank of a producer learns each hold its scheduler issues (`register`: at once for a rank in the
scheduler's process, else with the next step's connector metadata) and forgets it when the scheduler
frees the blocks (`revoke`, from the metadata of the step that may reuse them, before its forward pass).

A read (`ReadSpec`) names a hold, its token, a token range, layers and heads. The rank checks it in
order, allocating nothing before the checks pass: against the model's layout (`check_request`: ids,
types, a token range within this rank's cache, heads and layers of the model - so whatever a transport
sizes from the spec is bounded by the cache), then against this rank and the hold (`open`: heads and
layers on this rank, the token, the deadline, the token range within the hold's tokens). It gathers
only from the hold's own blocks. A reader that arrives before the hold's
registration reached this rank waits for it briefly (`registration_wait_s`), then is refused.

A gather in progress pins its hold: `revoke` waits for it, so a hold's blocks are never freed and
reused under a reader (the step that reuses them revokes first, on the thread that then writes them;
on CUDA a gather is queued on the default stream, ahead of that step's writes). A read whose hold goes away between two layers is refused at its next layer.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pagedserve.kv_transfer.holds import (
    HoldGrant,
    RateLimitedLog,
    hash_token,
    hold_sequence,
    is_short_printable,
    shown,
)
from pagedserve.kv_transfer.layout import KVLayout

logger = logging.getLogger(__name__)

# How long a read of a hold this rank does not know yet waits for its registration (the next step's
# metadata) before it is refused.
DEFAULT_REGISTRATION_WAIT_S = 5.0


class ReadRefused(ValueError):
    """This rank will not serve the read: no such hold, a wrong token, an expired or released hold, or a
    range outside the hold or this rank."""


@dataclass(frozen=True)
class ReadSpec:
    """What one consumer rank asks of one producer rank for one hold."""

    remote_request_id: str  # the hold's id (kv_transfer_params' remote_request_id)
    hold_token: str  # the hold's token (kv_transfer_params' remote_hold_token)
    token_start: int
    token_end: int
    layers: tuple[int, ...]  # global layer indices, ascending
    head_start: int  # global KV heads [head_start, head_end)
    head_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(eq=False)
class _Hold:
    grant: HoldGrant
    pins: int = 0  # gathers in progress
    revoked: bool = False


@dataclass(frozen=True, eq=False)
class HoldRead:
    """A read this rank admitted: its spec, its hold, and the flat cache slots of its tokens."""

    spec: ReadSpec
    hold: _Hold
    slots: torch.Tensor


class KVSource:
    """One producer rank's KV cache, readable by consumers through a transport."""

    def __init__(self, layout: KVLayout, rank: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 registration_wait_s: float = DEFAULT_REGISTRATION_WAIT_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.layout = layout
        self.rank = rank
        self.kv_caches = kv_caches
        self.layers = layout.layers_of(rank)
        self.heads = layout.heads_of(rank)
        self.num_blocks = int(kv_caches[0][0].shape[0]) if kv_caches else 0
        self.capacity_tokens = self.num_blocks * layout.block_size
        self.registration_wait_s = registration_wait_s
        self._clock = clock
        # Called with [(hold id, token)] when a reader releases a hold (an in-process producer's scheduler).
        self.release_sink: Callable[[list[tuple[str, str]]], None] | None = None
        self._cond = threading.Condition()
        self._holds: dict[str, _Hold] = {}
        self._last_sequence = -1  # the highest sequence number registered (they arrive in order)
        self.bytes_served = 0
        self.reads_refused = 0
        self._refusal_log = RateLimitedLog(logger)

    # ------------------------------------------------------------------ holds

    def register(self, grants: Iterable[HoldGrant]) -> None:
        """Serve these holds from now on (until revoked or past their deadline)."""
        with self._cond:
            for grant in grants:
                if grant.hold_id in self._holds:
                    continue
                sequence = hold_sequence(grant.hold_id) if isinstance(grant.hold_id, str) else None
                if sequence is not None:
                    if sequence <= self._last_sequence:
                        continue  # it was registered and revoked already: never serve it again
                    self._last_sequence = sequence  # (even if refused below: no reader need wait for it)
                problem = self._grant_problem(grant)
                if problem is not None:
                    logger.error("producer rank %d: ignoring hold %s: %s", self.rank, shown(grant.hold_id), problem)
                    continue
                self._holds[grant.hold_id] = _Hold(grant)
            self._cond.notify_all()

    def _grant_problem(self, grant: HoldGrant) -> str | None:
        if not is_short_printable(grant.hold_id):
            return "its id is not a short printable string"
        if not isinstance(grant.token_hash, bytes) or len(grant.token_hash) != 32:
            return "no token hash"
        if any(type(b) is not int or not 0 <= b < self.num_blocks for b in grant.block_ids):
            return f"a block id outside this rank's {self.num_blocks} blocks"
        if type(grant.num_tokens) is not int or not 0 < grant.num_tokens <= len(grant.block_ids) * self.layout.block_size:
            return f"{grant.num_tokens} tokens do not fit its {len(grant.block_ids)} blocks"
        return None

    def revoke(self, hold_ids: Iterable[str]) -> None:
        """Stop serving these holds (their blocks are about to be reused); returns once no gather of them
        is in progress."""
        with self._cond:
            gone = []
            for hold_id in hold_ids:
                hold = self._holds.pop(hold_id, None)
                if hold is not None:
                    hold.revoked = True
                    gone.append(hold)
            self._cond.wait_for(lambda: all(hold.pins == 0 for hold in gone))

    def live_holds(self) -> set[str]:
        with self._cond:
            return set(self._holds)

    def release(self, hold_id: object, token: object) -> None:
        """A reader is done with a hold: pass it on to the scheduler, which checks the token."""
        if not is_short_printable(hold_id) or not is_short_printable(token):
            self._refusal_log.debug("producer rank %d: ignored a release of %s without a usable token", self.rank,
                                    shown(hold_id))
            return
        sink = self.release_sink
        if sink is not None:
            sink([(hold_id, token)])

    # ------------------------------------------------------------------ reads

    def _refuse(self, message: str) -> ReadRefused:
        with self._cond:
            self.reads_refused += 1
        self._refusal_log.debug("producer rank %d refused a read: %s", self.rank, message)
        return ReadRefused(message)

    def check_request(self, spec: object) -> ReadSpec:
        """What the model's layout decides about a read, before any hold is looked up or anything
        allocated: the sizes a transport derives from a spec that passes are bounded by the cache (a
        layer's heads over all of this rank's blocks at most, per layer)."""
        if not isinstance(spec, ReadSpec):
            raise self._refuse(f"not a read spec: {type(spec).__name__}")
        if not is_short_printable(spec.remote_request_id):
            raise self._refuse(f"hold id {shown(spec.remote_request_id)}: not 1-128 printable ASCII characters")
        what = f"read of hold {spec.remote_request_id!r} on producer rank {self.rank}"
        if not is_short_printable(spec.hold_token):
            raise self._refuse(f"{what}: no usable hold token")
        layout = self.layout
        numbers = (spec.token_start, spec.token_end, spec.head_start, spec.head_end)
        if (any(type(n) is not int for n in numbers) or not isinstance(spec.layers, tuple)
                or len(spec.layers) > layout.num_layers or any(type(layer) is not int for layer in spec.layers)):
            raise self._refuse(f"{what}: token range, heads and layers must be integers (layers at most "
                               f"{layout.num_layers})")
        if not 0 <= spec.token_start < spec.token_end <= self.capacity_tokens:
            raise self._refuse(f"{what}: tokens [{spec.token_start}, {spec.token_end}) are not a range within "
                               f"this rank's {self.capacity_tokens} cache slots")
        if not 0 <= spec.head_start < spec.head_end <= layout.num_kv_heads:
            raise self._refuse(f"{what}: heads [{spec.head_start}, {spec.head_end}) are not a range of the "
                               f"model's {layout.num_kv_heads} KV heads")
        if not spec.layers or list(spec.layers) != sorted(set(spec.layers)) or not (
                0 <= spec.layers[0] and spec.layers[-1] < layout.num_layers):
            raise self._refuse(f"{what}: layers {spec.layers} are not ascending layers of the model's "
                               f"{layout.num_layers}")
        return spec

    def _check_on_rank(self, spec: ReadSpec, what: str) -> None:
        if not self.heads.start <= spec.head_start < spec.head_end <= self.heads.stop:
            raise self._refuse(f"{what}: heads [{spec.head_start}, {spec.head_end}) are not on this rank (it "
                               f"holds {self.heads})")
        if any(layer not in self.layers for layer in spec.layers):
            raise self._refuse(f"{what}: layers {spec.layers} are not all on this rank (it holds {self.layers})")

    def _may_still_register(self, hold_id: str) -> bool:
        """Whether a hold this rank does not know may yet be registered (its sequence number is ahead)."""
        sequence = hold_sequence(hold_id)
        return sequence is not None and sequence > self._last_sequence

    def open(self, spec: ReadSpec) -> HoldRead:
        """Admit a read: check it against this rank and its hold; the slots it gathers, from the hold's blocks."""
        self.check_request(spec)
        hold_id = spec.remote_request_id
        what = f"read of hold {hold_id!r} on producer rank {self.rank}"
        self._check_on_rank(spec, what)
        presented = hash_token(spec.hold_token)
        with self._cond:
            hold = self._holds.get(hold_id)
            if hold is None and self._may_still_register(hold_id):
                self._cond.wait_for(lambda: hold_id in self._holds or not self._may_still_register(hold_id),
                                    self.registration_wait_s)
                hold = self._holds.get(hold_id)
        if hold is None:
            raise self._refuse(f"{what}: no such hold (never issued here, released, or expired)")
        grant = hold.grant
        if not hmac.compare_digest(presented, grant.token_hash):
            raise self._refuse(f"{what}: wrong hold token")
        if self._clock() > grant.deadline:
            raise self._refuse(f"{what}: the hold expired")
        if spec.token_end > grant.num_tokens:
            raise self._refuse(f"{what}: tokens up to {spec.token_end}, but the hold has {grant.num_tokens}")
        bs = self.layout.block_size
        pos = torch.arange(spec.token_start, spec.token_end)
        blocks = torch.tensor(grant.block_ids, dtype=torch.long)
        slots = (blocks[pos // bs] * bs + pos % bs).to(self.kv_caches[0][0].device)
        return HoldRead(spec, hold, slots)

    def read_layer(self, spec: ReadSpec, layer: int, read: HoldRead | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for an admitted read (`open`; opened here when not given): two
        [tokens, heads, head_size] tensors gathered from the hold's blocks."""
        if read is None:
            read = self.open(spec)
        spec, hold = read.spec, read.hold
        if layer not in spec.layers:
            raise self._refuse(f"layer {layer} is not part of this read of {spec.layers}")
        with self._cond:
            if hold.revoked:
                refusal = "it was released or expired during the read"
            elif self._clock() > hold.grant.deadline:
                refusal = "it expired during the read"
            else:
                refusal = None
                hold.pins += 1
        if refusal is not None:
            raise self._refuse(f"read of hold {spec.remote_request_id!r} on producer rank {self.rank}: {refusal}")
        try:
            k, v = self._gather(read, layer)
        finally:
            with self._cond:
                hold.pins -= 1
                if hold.pins == 0 and hold.revoked:
                    self._cond.notify_all()
        with self._cond:
            self.bytes_served += 2 * k.numel() * k.element_size()
        return k, v

    def _gather(self, read: HoldRead, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy out of the cache (the hold is pinned meanwhile)."""
        key_cache, value_cache = self.kv_caches[layer - self.layers.start]
        h0, h1 = read.spec.head_start - self.heads.start, read.spec.head_end - self.heads.start
        k = key_cache.flatten(0, 1).index_select(0, read.slots)[:, h0:h1].contiguous()
        v = value_cache.flatten(0, 1).index_select(0, read.slots)[:, h0:h1].contiguous()
        return k, v
