"""Where an `AsyncLLM`'s outputs go: each request's stream, an asyncio queue on its caller's event loop.

`OutputStreams` is the engine thread's side: the streams of the requests it runs, by request id, and
what an output becomes on its way there. A DELTA stream with a stream interval other than 1 passes its
outputs through its `DeltaCoalescer` (with `stream_interval="auto"`, at the interval the number of open
coalesced streams calls for: `delta_coalescer.auto_interval`); a step's outputs are collected in an
`Outbox` and handed to each event loop in one call (`send`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagedserve.engine.delta_coalescer import AUTO, DeltaCoalescer, auto_interval, validate_stream_interval
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.outputs import RequestOutput


@dataclass
class OutputStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    coalescer: DeltaCoalescer | None = None  # a DELTA stream with stream_interval > 1 or "auto" (engine thread only)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Into the queue from any thread: at once on the stream's own loop, else handed over to it (asyncio
        queues are not thread-safe); nothing if that loop is gone."""
        if _running_loop() is self.loop:
            self.queue.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone
            pass


# A step's outputs by the event loop they go to: (the stream's queue, the output) in delivery order.
Outbox = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """On the event loop: a step's outputs into their streams' queues, in order."""
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


class OutputStreams:
    """The open streams of an engine's requests (touched by the engine thread only, but for `open`)."""

    def __init__(self, stream_interval: int | str = 1) -> None:
        self.stream_interval = validate_stream_interval(stream_interval)
        self._streams: dict[str, OutputStream] = {}
        self._num_coalesced = 0  # open streams with a coalescer: "auto"'s load
        self._interval: int | None = None  # "auto": the interval for that load (None: each coalescer's own)

    def open(self, loop: asyncio.AbstractEventLoop, output_kind: OutputKind) -> OutputStream:
        """A new stream for a request of this kind (any thread: it is not registered until `add`)."""
        coalesce = output_kind == OutputKind.DELTA and self.stream_interval != 1
        interval = 1 if self.stream_interval == AUTO else self.stream_interval
        return OutputStream(loop, asyncio.Queue(), DeltaCoalescer(interval) if coalesce else None)  # type: ignore[arg-type]

    def add(self, request_id: str, stream: OutputStream) -> None:
        self._streams[request_id] = stream
        if stream.coalescer is not None:
            self._count_coalesced(+1)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    @property
    def num_coalesced(self) -> int:
        return self._num_coalesced

    def forget(self, request_id: str) -> None:
        """The request's stream gets nothing more (finished, failed or aborted)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.coalescer is not None:
            self._count_coalesced(-1)

    def _count_coalesced(self, change: int) -> None:
        self._num_coalesced += change
        if self.stream_interval == AUTO:
            self._interval = auto_interval(self._num_coalesced)

    def deliver(self, request_id: str, item: RequestOutput | BaseException, outbox: Outbox | None = None) -> None:
        """Route one output (or a failure) to its request's stream: now, or into `outbox` (a step's
        outputs, handed to each event loop in one call by `send`)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self.forget(request_id)
        if stream.coalescer is not None:
            if isinstance(item, BaseException) or item.error is not None:  # what was held goes out before the error
                held = stream.coalescer.flush()
                if held is not None:
                    self._put(stream, held, outbox)
            else:
                item = stream.coalescer.push(item, self._interval)  # type: ignore[assignment]
                if item is None:
                    return  # held: sent with a later output
        self._put(stream, item, outbox)

    @staticmethod
    def _put(stream: OutputStream, item: RequestOutput | BaseException, outbox: Outbox | None = None) -> None:
        if outbox is not None:
            outbox.setdefault(stream.loop, []).append((stream.queue, item))
        else:
            stream.put(item)

    @staticmethod
    def send(outbox: Outbox) -> None:
        """One hand-over per event loop for a whole step's outputs, not one per request: one write of the
        loop's self-pipe instead of up to one per stream, and one wake-up where the loop would have gone
        back to sleep between them (each a chance to preempt an engine thread on cores the engine fills;
        `AsyncLLM` alone at 64 streams: ~100 context switches a run instead of ~2000)."""
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is gone
                pass
