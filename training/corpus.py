"""The training corpus: the running interpreter's standard-library ``.py`` sources.

The split is by file and uses SHA-256 of the POSIX relative path, so it is the
same on every machine with the same CPython version (Python's own ``hash`` is
salted per process and would not be).
"""
from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories skipped anywhere in the relative path:
# - site-packages: third-party code, differs per machine;
# - test/tests/idle_test: CPython's test suite is 60% of the bytes but full of
#   deliberately odd code (bad encodings, huge literal tables, syntax-error
#   fixtures); with a budget of a few million training tokens, library code is
#   the better use of them and keeps tokenizer training fast;
# - pydoc_data: one 750 KB string of prose, not code;
# - __pycache__: bytecode caches.
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"})
HELDOUT_PERCENT = 5


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """``"heldout"`` for ~HELDOUT_PERCENT% of paths, else ``"train"``; deterministic."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


def iter_sources(root: Path | None = None) -> list[SourceFile]:
    """All eligible ``.py`` files under ``root`` that decode as UTF-8, sorted by path."""
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise ValueError(f"root: {root} is not a directory")
    files: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in Path(rel).parts[:-1]):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel, text))
    return files


def load_split(split: str, root: Path | None = None) -> list[SourceFile]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
    return [f for f in iter_sources(root) if split_of(f.relpath) == split]


def describe() -> dict[str, object]:
    """Corpus facts recorded in the model card."""
    files = iter_sources()
    counts = {"train": 0, "heldout": 0}
    chars = {"train": 0, "heldout": 0}
    for f in files:
        s = split_of(f.relpath)
        counts[s] += 1
        chars[s] += len(f.text)
    return {
        "python_version": sys.version.split()[0],
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "heldout_percent": HELDOUT_PERCENT,
        "files": counts,
        "chars": chars,
    }
