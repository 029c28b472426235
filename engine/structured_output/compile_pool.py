"""Grammar compiles in worker processes, each killed when its compile runs past the time limit.

A compile is C++ work that cannot be interrupted: run in a thread, one that never ends keeps its
thread (and its memory) for good, and a few of them starve every later structured-output request.
Here a compile runs in a worker process (`compile_worker`), bounded in time (killed with SIGKILL
past its time limit; the next job starts a fresh worker) and in memory (RLIMIT_DATA: a compile over
it fails alone). The compiled grammar comes back in xgrammar's JSON form, to be deserialized in the
engine against its own tokenizer info. A worker exits when the engine process goes away (its stdin
closes, or, on Linux, its parent-death signal).

One caller thread per worker drives the pool (`compile` blocks until its worker answers): a
stuck compile holds its own worker until its time limit, never the others.
"""

from __future__ import annotations

import logging
import queue
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedserve.engine.structured_output.compile_worker import read_frame, write_frame
from pagedserve.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A fresh worker (imports, tokenizer info, compiler) must be ready within this many seconds.
STARTUP_TIMEOUT_S = 120.0

CompileFn = Callable[[Any, StructuredOutputsParams], Any]  # (xgr.GrammarCompiler, params) -> CompiledGrammar


class CompileTimeoutError(TimeoutError):
    """The compile ran past its time limit; its worker was killed."""


class CompileWorkerDied(RuntimeError):
    """The worker process ended in the middle of a compile (out of its memory limit, or a crash)."""


class CompileError(RuntimeError):
    """The compile itself failed (xgrammar's error, or out of the worker's memory limit)."""


class _Worker:
    """One worker process (started on first use, replaced after it was killed or died)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self, setup: dict[str, Any]) -> None:
        """Start the process and send its setup (it imports and answers while the caller goes on)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.engine.structured_output.compile_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )
        try:
            self.send(setup)
        except BaseException:
            self.stop()
            raise

    def await_ready(self) -> None:
        try:
            if self.wait(STARTUP_TIMEOUT_S) is None:
                raise CompileWorkerDied(f"a grammar compile worker did not start within {STARTUP_TIMEOUT_S:g} s")
        except BaseException:
            self.stop()
            raise

    def send(self, obj: Any) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            write_frame(self.process.stdin, obj)
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def wait(self, timeout_s: float) -> Any | None:
        """The worker's next frame, or None if it sends none within `timeout_s`."""
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        poller = select.poll()  # not select.select: an engine process may hold fds past FD_SETSIZE
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(max(0, int(timeout_s * 1000))):
            return None
        try:
            return read_frame(fd)
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> CompileWorkerDied:
        code = None
        if self.process is not None:
            try:
                code = self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        return CompileWorkerDied(f"the grammar compile worker ended (exit code {code}); the grammar may need "
                                 "more memory than a compile may use")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            pass


class CompilePool:
    """`num_workers` worker processes; `compile` is blocking and thread-safe (a caller waits for a free
    worker; with as many caller threads as workers, none waits)."""

    def __init__(self, tokenizer_info_json: str, num_workers: int, memory_limit_bytes: int | None = None,
                 compile_threads: int = 2) -> None:
        self.num_workers = num_workers
        self.num_killed = 0
        self._setup = {"sys_path": list(sys.path), "tokenizer_info": tokenizer_info_json,
                       "compile_threads": compile_threads, "memory_limit_bytes": memory_limit_bytes}
        self._workers = [_Worker() for _ in range(num_workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._closed = False

    def start(self) -> None:
        """Start every worker that is not running, side by side (else each starts on its next job)."""
        workers = [self._idle.get() for _ in range(self.num_workers)]
        try:
            starting = [w for w in workers if not w.alive]
            for worker in starting:
                worker.stop()
                worker.spawn(self._setup)
            for worker in starting:
                worker.await_ready()
        finally:
            for worker in workers:
                self._idle.put(worker)

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process is not None]

    def compile(self, compile_fn: CompileFn, params: StructuredOutputsParams, timeout_s: float) -> str:
        """The compiled grammar of `params` in xgrammar's JSON form. Raises CompileTimeoutError (the compile
        ran past `timeout_s`: its worker was killed), CompileWorkerDied, or CompileError carrying the
        compile's own error."""
        worker = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("structured_outputs: the grammar compiler is shut down")
            if not worker.alive:
                worker.stop()
                worker.spawn(self._setup)
                worker.await_ready()
            start = time.monotonic()
            worker.send((compile_fn, params.model_dump(by_alias=True)))
            reply = worker.wait(timeout_s)
            if reply is None:
                pid = worker.process.pid if worker.process is not None else None
                worker.stop()
                self.num_killed += 1
                logger.warning("grammar compile worker %s killed: a %s grammar compiled for more than %g s",
                               pid, params.kind, timeout_s)
                raise CompileTimeoutError(f"compiling the grammar took longer than {timeout_s:g} s")
            logger.debug("compiled a %s grammar in %.1f ms", params.kind, 1000 * (time.monotonic() - start))
            if reply[0] == "ok":
                return reply[1]
            raise CompileError(f"{reply[1]}: {reply[2]}")
        finally:
            self._idle.put(worker)

    def shutdown(self) -> None:
        """Stop the workers (a compile in progress fails with CompileWorkerDied)."""
        self._closed = True
        for worker in self._workers:
            worker.stop()
