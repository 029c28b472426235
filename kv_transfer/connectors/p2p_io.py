"""The torch_p2p consumer's I/O threads: connects, read starts and releases run here, off the engine's step
thread, so that a slow or unreachable producer never stalls a step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class IOWorkers:
    """A few daemon threads that run one transport's network work, off the engine's step thread."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise ConnectionError("torch_p2p: transport closed")
            while len(self._threads) < self._size:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    if not self._threads:
                        raise
                    break  # fewer threads than wished; those running serve the queue
                self._threads.append(thread)
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def close(self) -> None:
        """Cancel what has not started; the threads end after their current task (daemons: never joined)."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


def done_future(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
