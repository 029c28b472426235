"""The package's shape, enforced: one import package, imports that run one way, modules of a readable size.

The rule (docs/architecture.md): bench -> cluster -> engine -> kv_transfer, parallel -> kernels. A module may
import its own layer and the layers below it, never one above; `engine` (and what it sits on) never
imports `ray`; every internal import goes through `pagedserve.` so that nothing depends on the
repository root being on sys.path. Inside cluster/ the rooms (serving, serve, executor, pd, and the
modules at its top) follow their own one-way rule: serving -> top <- serve, pd; serve -> pd, executor.
And no two engine modules import each other, directly or round a longer loop (type-only and
function-level imports count: a cycle only type hints need still says that two modules share one job).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("bench", "cluster", "engine", "kv_transfer", "parallel", "kernels")
# What each layer may import from the others (its own layer is always allowed).
ALLOWED: dict[str, set[str]] = {
    "bench": {"cluster", "engine", "kv_transfer", "parallel", "kernels"},
    "cluster": {"engine", "kv_transfer", "parallel", "kernels"},
    "engine": {"kv_transfer", "parallel", "kernels"},
    "kv_transfer": {"parallel", "kernels"},
    "parallel": {"kernels"},
    "kernels": set(),
}
NO_RAY = ("engine", "kv_transfer", "parallel", "kernels")
MAX_LINES = 450

# cluster/, room by room. "top" is what every room reads (ServeArgs, the PD settings, fleet stats);
# the CLI at the top is the one entry point above all rooms.
ROOMS = ("serving", "serve", "executor", "pd")
CLUSTER_ALLOWED: dict[str, set[str]] = {
    "top": set(),
    "serving": {"top"},  # the HTTP API reaches the engines only through the client it is handed
    "serve": {"top", "serving", "pd", "executor"},
    "pd": {"top", "executor"},
    "executor": {"top"},
    "cli": {"top", "serve"},
}


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


def _room(module: str) -> str | None:
    """The cluster/ room of a `pagedserve.cluster...` module name (None outside cluster/)."""
    parts = module.split(".")
    if parts[:2] != ["pagedserve", "cluster"] or len(parts) < 3:
        return None
    if parts[2] in ROOMS:
        return parts[2]
    return "cli" if parts[2] == "cli" else "top"


def _room_edges() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> where, for every import between two rooms of cluster/."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _modules("cluster"):
        source = _room(".".join(["pagedserve", *path.relative_to(ROOT).with_suffix("").parts]))
        for line, name in _imported_names(path):
            target = _room(name)
            if target is not None and source is not None and target != source:
                edges.setdefault((source, target), []).append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return edges


def test_cluster_rooms_import_one_way():
    bad = [where for (source, target), places in _room_edges().items()
           if target not in CLUSTER_ALLOWED[source] for where in places]
    assert not bad, "cluster/ rooms may import only " + str(CLUSTER_ALLOWED) + ":\n" + "\n".join(bad)


def test_no_two_cluster_rooms_import_each_other():
    edges = _room_edges()
    both = sorted({tuple(sorted(pair)) for pair in edges if pair[::-1] in edges})
    assert not both, "\n".join(f"{a} <-> {b}: {edges[(a, b)][:1] + edges[(b, a)][:1]}" for a, b in both)


def test_cluster_rooms_are_the_documented_ones():
    """A new folder under cluster/ is a new room: give it a rule above (and a paragraph in the docs)."""
    folders = {p.name for p in (ROOT / "cluster").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ROOMS), folders


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pagedserve", *parts])


def _import_graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules among `paths` (name -> file) it imports, anywhere in the file: TYPE_CHECKING
    blocks and function bodies included. `from package import name` is an edge to the module `name`
    when there is one, else to the package; a package a module merely sits in is no edge."""
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in paths:
                        edges.add(f"{base}.{alias.name}")
                    elif base in paths:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_type_only_and_function_level_cycles(tmp_path: Path):
    """The rule below can fail: a loop closed only by a TYPE_CHECKING import or by an import inside a
    function is a cycle; a chain is not."""
    files = {
        "pkg.a": "from pkg.b import B\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "pkg.c": "def f():\n    from pkg import d\n",
        "pkg.d": "from . import c\n",
        "pkg.e": "import pkg.a\n",
    }
    paths = {}
    for name, text in files.items():
        path = tmp_path / f"{name.split('.')[1]}.py"
        path.write_text(text)
        paths[name] = path
    assert _cycles(_import_graph(paths)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_import_cycles_between_engine_modules():
    """Two modules that import each other share one job: split it, or move the shared part below both."""
    cycles = _cycles(_import_graph({_module_name(p): p for p in _modules("engine")}))
    assert not cycles, "import cycles between engine modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)
