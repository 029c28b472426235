"""Makes this interpreter look like an environment holding only pagedserve's runtime requirements.

tests/test_packaging.py puts this folder first on PYTHONPATH and names, in the environment, what a fresh
venv with only requirements.txt installed would lack: the distributions (PAGEDSERVE_HIDDEN_DISTRIBUTIONS)
and their top-level modules (PAGEDSERVE_HIDDEN_MODULES), comma-separated. Those modules cannot be found
(an import raises ModuleNotFoundError, `importlib.util.find_spec` returns None) and `importlib.metadata`
does not list those distributions, as in that venv. Then the next `sitecustomize` on sys.path runs, as it
would have without this one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_HIDDEN_DISTRIBUTIONS = {_canonical(n) for n in os.environ.get("PAGEDSERVE_HIDDEN_DISTRIBUTIONS", "").split(",") if n}
_HIDDEN_MODULES = {n for n in os.environ.get("PAGEDSERVE_HIDDEN_MODULES", "").split(",") if n}
_PATH_FINDER = importlib.machinery.PathFinder


class HidingPathFinder:
    """sys.meta_path's PathFinder, blind to the hidden modules and distributions."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN_MODULES:
            return None
        return _PATH_FINDER.find_spec(name, path, target)

    @staticmethod
    def find_distributions(context=importlib.metadata.DistributionFinder.Context()):
        if context.name is not None and _canonical(context.name) in _HIDDEN_DISTRIBUTIONS:
            return iter(())
        return (d for d in _PATH_FINDER.find_distributions(context)
                if _canonical(d.metadata["Name"] or "") not in _HIDDEN_DISTRIBUTIONS)

    @staticmethod
    def invalidate_caches():
        _PATH_FINDER.invalidate_caches()


sys.meta_path[:] = [HidingPathFinder if finder is _PATH_FINDER else finder for finder in sys.meta_path]

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    if os.path.abspath(_entry or os.curdir) == _here:
        continue
    _next = os.path.join(_entry or os.curdir, "sitecustomize.py")
    if os.path.isfile(_next):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _next)
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["_next_sitecustomize"] = _module
        _spec.loader.exec_module(_module)
        break
