"""When each part of one request happened inside its engine, beyond the few timestamps of
`RequestMetrics`: its prefill chunks (when each was scheduled and when its step landed) and its KV
pull from a prefill engine (when, how many bytes). Plain data (it travels inside `RequestOutput`s over
Ray); the serving layer turns it into trace spans and overhead histograms, so that the engine itself
never imports a tracing library. Wall-clock seconds (`time.time()`), like `RequestMetrics`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# A request records at most this many prefill chunks (more are counted, not kept): spans stay bounded.
MAX_CHUNKS = 16


@dataclass
class PrefillChunk:
    start: float  # the step that computes it was scheduled
    num_tokens: int
    end: float | None = None  # that step's results landed


@dataclass
class KVLoad:
    """The prompt's KV pulled from a prefill engine (disaggregated prefill/decode)."""

    start: float  # the step that starts the pull was scheduled
    num_tokens: int
    end: float | None = None
    num_bytes: int = 0
    ok: bool | None = None
    transport: str = ""  # the KV connector (inproc, torch_p2p, ray)
    num_layers: int = 0  # pulled layer by layer, each beside the forward pass that needs it


@dataclass
class RequestTimeline:
    chunks: list[PrefillChunk] = field(default_factory=list)
    num_chunks: int = 0  # every chunk, kept or not
    kv_load: KVLoad | None = None

    def chunk_scheduled(self, now: float, num_tokens: int) -> None:
        self.num_chunks += 1
        if len(self.chunks) < MAX_CHUNKS:
            self.chunks.append(PrefillChunk(now, num_tokens))

    def step_landed(self, now: float) -> None:
        """The request's step returned: its open chunk (if any) ends now."""
        if self.chunks and self.chunks[-1].end is None:
            self.chunks[-1].end = now

    def load_started(self, now: float, num_tokens: int, transport: str = "", num_layers: int = 0) -> None:
        self.kv_load = KVLoad(now, num_tokens, transport=transport, num_layers=num_layers)

    def load_landed(self, now: float, num_bytes: int, ok: bool) -> None:
        if self.kv_load is not None and self.kv_load.end is None:
            self.kv_load.end, self.kv_load.num_bytes, self.kv_load.ok = now, num_bytes, ok

    def snapshot(self) -> RequestTimeline:
        """A copy that later steps do not change (an output carries it out of the engine thread)."""
        return RequestTimeline([replace(c) for c in self.chunks], self.num_chunks,
                               None if self.kv_load is None else replace(self.kv_load))
