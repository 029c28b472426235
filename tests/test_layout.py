"""The package's shape, enforced: one import package, imports that run one way, modules of a readable size.

The rule (docs/architecture.md): cluster -> engine -> kv_transfer, parallel -> kernels. A module may
import its own layer and the layers below it, never one above; `engine` (and what it sits on) never
imports `ray`; every internal import goes through `pagedserve.` so that nothing depends on the
repository root being on sys.path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("cluster", "engine", "kv_transfer", "parallel", "kernels")
# What each layer may import from the others (its own layer is always allowed).
ALLOWED: dict[str, set[str]] = {
    "cluster": {"engine", "kv_transfer", "parallel", "kernels"},
    "engine": {"kv_transfer", "parallel", "kernels"},
    "kv_transfer": {"parallel", "kernels"},
    "parallel": {"kernels"},
    "kernels": set(),
}
NO_RAY = ("engine", "kv_transfer", "parallel", "kernels")
MAX_LINES = 450


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """Absolute module names imported by a file (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["pagedserve", *path.relative_to(ROOT).parent.parts]
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module == "pagedserve":  # `from pagedserve import kernels`
                names += [(node.lineno, f"pagedserve.{alias.name}") for alias in node.names]
            else:
                names.append((node.lineno, node.module or ""))
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "pagedserve" and len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return None


@pytest.mark.parametrize("layer", SUBPACKAGES)
def test_imports_run_one_way(layer):
    bad = []
    for path in _modules(layer):
        for line, name in _imported_names(path):
            target = _layer(name)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, f"{layer} may import only {sorted(ALLOWED[layer])}:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", NO_RAY)
def test_lower_layers_never_import_ray(layer):
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _modules(layer)
           for line, name in _imported_names(p) if name == "ray" or name.startswith("ray.")]
    assert not bad, "\n".join(bad)


def test_every_internal_import_goes_through_pagedserve():
    """`import engine` would only work with the repository root on sys.path, never when installed."""
    files = [p for folder in (*SUBPACKAGES, "pagedserve", "tests", "benchmarks") for p in _modules(folder)]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in files
           for line, name in _imported_names(p) if name.split(".")[0] in SUBPACKAGES]
    assert not bad, "\n".join(bad)


def test_public_api_is_lazy_and_does_not_import_ray():
    import subprocess
    import sys

    script = ("import sys, pagedserve; assert 'ray' not in sys.modules and 'torch' not in sys.modules\n"
              "from pagedserve import LLM, SamplingParams, AsyncLLM, RequestOutput, CompletionOutput, EngineArgs\n"
              "assert 'ray' not in sys.modules, 'ray imported'\n"
              "assert LLM.__module__.startswith('pagedserve.engine')\n"
              "print(pagedserve.__version__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=str(ROOT.parent))
    assert result.returncode == 0, result.stderr


def test_no_module_grows_past_a_readable_size():
    """Big files hide their structure; split them into modules with one job each (C++ kernels excepted)."""
    files = [p for folder in (*SUBPACKAGES, "pagedserve", "benchmarks") for p in _modules(folder)]
    big = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
