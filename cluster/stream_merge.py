"""Interleaving several engine output streams: the prompts of one HTTP request (cluster/serving/streams.py)
and the legs of a migrated request (cluster/serve/migration.py) share this one merge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

_END = object()


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as (stream index, output); closing this closes them all (aborts)."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for output in stream:
                yield 0, output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # closes each stream inside its task: the coordinator aborts unfinished requests
        await asyncio.gather(*tasks, return_exceptions=True)
