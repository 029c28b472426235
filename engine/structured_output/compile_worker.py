"""The grammar compile worker process (`python -m pagedserve.engine.structured_output.compile_worker`).

It reads pickled frames on stdin and answers on the stdout it had at start (its fd 1 then points at
stderr, so that nothing else printed can corrupt a frame). The first frame sets it up: {"sys_path",
"tokenizer_info", "compile_threads", "memory_limit_bytes"}; it answers ("ready",). Then each frame is
a job, (compile_fn, spec dict), answered ("ok", the compiled grammar in xgrammar's JSON form) or
("error", exception type name, message). It exits when stdin closes (the engine went away).

A plain subprocess rather than a multiprocessing child: nothing of the engine's `__main__` is
imported again here (a user's script without a main guard would otherwise run twice).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("!Q")


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`; EOFError when it closes first."""
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    (size,) = _HEADER.unpack(read_exactly(fd, _HEADER.size))
    return pickle.loads(read_exactly(fd, size))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the engine process dies, even in the middle of a compile. (The
    signal follows the thread that started the worker: the manager's compile threads, which live as
    long as the manager; a worker found dead is simply started again.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into a frame
    stdin = sys.stdin.fileno()
    try:
        setup = read_frame(stdin)
    except EOFError:
        return
    for entry in setup["sys_path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    limit = setup["memory_limit_bytes"]
    if limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    import xgrammar as xgr

    from pagedserve.engine.structured_output.params import StructuredOutputsParams

    info = xgr.TokenizerInfo.deserialize_json(setup.pop("tokenizer_info"))
    # No cache here: the engine caches compiled grammars (bounded in bytes), and a worker may be replaced.
    compiler = xgr.GrammarCompiler(info, max_threads=setup["compile_threads"], cache_enabled=False)
    write_frame(out, ("ready",))
    while True:
        try:
            compile_fn, spec = read_frame(stdin)
        except EOFError:
            return
        try:
            reply: tuple = ("ok", compile_fn(compiler, StructuredOutputsParams.model_validate(spec)).serialize_json())
        except BaseException as exc:  # noqa: BLE001 - reported to the engine; this worker goes on
            reply = ("error", type(exc).__name__, str(exc))
        try:
            write_frame(out, reply)
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    main()
