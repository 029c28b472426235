"""Build and load the C++ CPU ops (torch.ops.pagedserve.*) once per process.

The library is compiled with -march=native (or the target `PAGEDSERVE_CPU_MARCH` names, e.g. `x86-64-v3`
for a build that also runs on AVX2-only CPUs) against one torch installation's headers and libraries, so
the build directory is keyed (`build_key()`) by the sources, the torch version and install path, the
Python ABI, the compiler and its flags, and this CPU's model and feature flags: a home directory shared
by machines of different CPUs never loads a library built for another, and two environments on one
machine (two venvs, each with its torch) keep one build each instead of rebuilding in turn.
Concurrent builds of one directory (several Ray workers starting together) queue on an OS file lock
(`build_lock`), which dies with its holder: torch.utils.cpp_extension's own lock file stays behind when a
build is killed (Ctrl-C on the first start, a replica killed while it compiles), and every later load
would then wait on it forever; under our lock no live build can own it, so a leftover one is removed.

    python -m pagedserve.kernels.cpu     # build ahead of time (make install does), print where and how long

PAGEDSERVE_CPU_OPS=0 turns the compiled ops off (the twins run their pure-torch paths instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("registration.cpp", "paged_attention.cpp", "cache.cpp",
                                                      "gguf_linear.cpp", "elementwise.cpp", "decode_layers.cpp",
                                                      "sampling.cpp")]
# Included by the sources: not compiled on their own, but part of what a build directory is keyed by.
HEADERS = [Path(__file__).with_name(name) for name in ("vec_math.h", "ops.h", "work_sharing.h")]
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # and -march (`compile_flags`)
LDFLAGS = ["-fopenmp"]
ENV_SWITCH = "PAGEDSERVE_CPU_OPS"
MARCH_ENV = "PAGEDSERVE_CPU_MARCH"
_MARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once a load was attempted; "error": str on failure


def _cpu_signature() -> str:
    """The CPU model and feature flags from /proc/cpuinfo (the machine name where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(sorted(set(wanted)))


def compile_flags() -> list[str]:
    """CFLAGS and the target: `-march=native` unless PAGEDSERVE_CPU_MARCH names another (a gcc -march value:
    the AVX-512/AMX code paths are compiled in only where that target has them). ValueError on a malformed one."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(f"{MARCH_ENV}: expected a compiler -march value such as native or x86-64-v3, got {march!r}")
    return [*CFLAGS, f"-march={march}"]


def build_key() -> dict[str, str]:
    """What the compiled library depends on besides its sources (each a part of the directory's name)."""
    compiler = os.environ.get("CXX", "c++")
    return {
        "torch_version": torch.__version__,
        "torch_path": str(Path(torch.__file__).resolve().parent),
        "python_abi": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
        "compiler": f"{compiler} ({shutil.which(compiler) or 'not found'})",
        "cflags": " ".join(compile_flags()),
        "ldflags": " ".join(LDFLAGS),
        "cpu": _cpu_signature(),
    }


def build_directory() -> Path:
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:  # by path too: torch's build file names them, two checkouts would rebuild in turn
        digest.update(f"{src.resolve()}\0".encode())
        digest.update(src.read_bytes())
    for name, value in sorted(build_key().items()):
        digest.update(f"\0{name}={value}".encode())
    root = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return root / "cpu_ops" / digest.hexdigest()[:16]


# torch.utils.cpp_extension's lock file in a build directory (its FileBaton).
TORCH_BATON = "lock"


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Exclusive use of a build directory among processes, released by the OS if the holder dies; a
    torch lock file found inside was left by a build that died, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pagedserve-build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = directory / TORCH_BATON
            if baton.exists():
                logger.warning("removing %s, left by a CPU-ops build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_cpu_ops() -> bool:
    """Build (if needed) and load the ops; True when torch.ops.pagedserve is usable. Never raises:
    a failed build is logged once and the twins use their pure-torch paths."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            _state["ok"] = False
            _state["error"] = f"disabled by {ENV_SWITCH}"
            return False
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        try:
            directory = build_directory()  # ValueError on a malformed PAGEDSERVE_CPU_MARCH: logged below
            with build_lock(directory):
                load(
                    name="pagedserve_cpu_ops",
                    sources=[str(s) for s in SOURCES],
                    extra_cflags=compile_flags(),
                    extra_ldflags=list(LDFLAGS),  # torch's load() appends its own to the list it is given
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, a compile error: fall back, say why once
            _state["ok"] = False
            _state["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU ops unavailable, using pure-torch kernels (slower decode attention): %s",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return False
        _state["ok"] = True
        logger.debug("CPU ops loaded from %s in %.1f s", directory, time.perf_counter() - start)
        return True


def cpu_ops_available() -> bool:
    """Whether torch.ops.pagedserve.* can be called (loads them on the first call). Called per op call,
    so the answer, once known, is read without the lock."""
    known = _state.get("ok")
    return bool(known) if known is not None else load_cpu_ops()


def cpu_ops_error() -> str | None:
    """Why the compiled ops are not in use, after a failed load_cpu_ops()."""
    return _state.get("error")  # type: ignore[return-value]

