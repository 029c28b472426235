"""A wheel built from the repository installs one import package, `pagedserve`, and nothing generic;
the runtime requirements alone run every `pagedserve` command.

`kernels` on PyPI (Hugging Face's hub-kernels library) is the name our `kernels/` folder would have
taken in site-packages; the test installs both into one fresh venv and imports both.

Issue 34: `pip install -r requirements.txt && pip install --no-deps -e .` must be enough for
`pagedserve --help`, `serve --help`, `bench --help` and `generate`. The default run checks it in this
environment with everything outside the runtime requirements' dependency closure hidden
(tests/runtime_only/sitecustomize.py); the slow test builds that venv for real.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PYPI_KERNELS = "kernels==0.17.2"
GENERIC_NAMES = ("engine", "kernels", "parallel", "kv_transfer", "cluster", "bench")


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy so that the in-tree build/ and *.egg-info never land in the checkout.
    src = tmp_path_factory.mktemp("src") / "pagedserve"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "assets", "training", "tests"))
    out = tmp_path_factory.mktemp("dist")
    result = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                  str(src))
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("pagedserve-*.whl")
    return path


def test_wheel_holds_only_the_pagedserve_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"pagedserve", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    for folder in GENERIC_NAMES:
        assert f"pagedserve/{folder}/__init__.py" in names
    assert "pagedserve/kernels/cpu/paged_attention.cpp" in names  # the compiled CPU ops' sources ship too
    assert "pagedserve/kernels/cpu/vec_math.h" in names  # and the header they include
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "pagedserve = pagedserve.cli:main" in entry_points


def test_wheel_installs_beside_the_pypi_kernels_package(wheel, tmp_path):
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", str(venv)).returncode == 0
    python = venv / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    downloads = tmp_path / "downloads"
    fetched = _run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(downloads), PYPI_KERNELS)
    if fetched.returncode != 0:
        pytest.skip(f"PyPI not reachable for {PYPI_KERNELS}: {fetched.stderr.strip()[-300:]}")
    installed = _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel),
                     *map(str, downloads.glob("*.whl")))
    assert installed.returncode == 0, installed.stderr
    for folder in ("engine", "parallel", "kv_transfer", "cluster"):
        assert not (site / folder).exists(), f"a top-level {folder}/ was installed"
    # Dependencies (torch, ray, ...) come from the test environment, appended after the venv's own
    # site-packages; a plain path in a .pth does not run that environment's editable-install hooks.
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = (
        "import sys, importlib.util, kernels, pagedserve\n"
        "from pagedserve import LLM, SamplingParams\n"
        "import pagedserve.kernels as ours\n"
        "assert 'ray' not in sys.modules\n"
        "assert kernels.__file__ != ours.__file__ and callable(ours.rms_norm)\n"
        "assert kernels.__name__ == 'kernels' and not hasattr(kernels, 'paged_decode_attention')\n"
        "assert all(importlib.util.find_spec(n) is None for n in ('engine', 'cluster', 'parallel', 'kv_transfer'))\n"
        "print(LLM.__module__, pagedserve.__file__)\n"
    )
    result = _run(str(python), "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(site) in result.stdout


# --------------------------------------------------------------------------- runtime requirements only

# What a fresh venv has besides the requirements (pip, and setuptools on Python 3.11).
VENV_BASE = {"pip", "setuptools"}
TEST_ONLY_SAMPLES = {"pytest", "hypothesis", "openai", "accelerate"}  # must be hidden, or the check is blind


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_lines(path: Path) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def runtime_closure() -> set[str]:
    """The installed distributions a venv with torch + requirements.txt + pagedserve would hold: the
    requirements and, recursively, what each one requires (extras and markers evaluated)."""
    todo = [(r.name, frozenset(r.extras)) for r in _requirement_lines(ROOT / "requirements.txt")]
    todo += [("torch", frozenset()), ("pagedserve", frozenset())]
    seen: set[tuple[str, frozenset]] = set()
    names: set[str] = set()
    while todo:
        name, extras = todo.pop()
        if (_canonical(name), extras) in seen:
            continue
        seen.add((_canonical(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        names.add(_canonical(name))
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return names


def _setuptools_vendored() -> set[str]:
    """Top-level modules setuptools carries in its _vendor folder (jaraco, more_itertools, ...): a fresh venv
    imports them from there (torch's cpp_extension imports setuptools when it builds the CPU ops), so hiding a
    site-packages copy by its module name would hide the vendored one too."""
    spec = importlib.util.find_spec("setuptools")
    if spec is None or spec.origin is None:
        return set()
    vendor = Path(spec.origin).parent / "_vendor"
    return {p.name.removesuffix(".py") for p in vendor.iterdir() if not p.name.endswith(".dist-info")} if vendor.is_dir() else set()


def hidden_environment() -> dict[str, str]:
    """Environment variables for tests/runtime_only/sitecustomize.py: every installed distribution outside
    the runtime closure, and the top-level modules only they provide."""
    keep = runtime_closure() | VENV_BASE
    hidden = {_canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]} - keep
    modules = {module for module, dists in metadata.packages_distributions().items()
               if all(_canonical(d) in hidden for d in dists)} - _setuptools_vendored()
    assert TEST_ONLY_SAMPLES <= hidden, f"not hidden: {TEST_ONLY_SAMPLES - hidden}"
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "tests" / "runtime_only"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "PAGEDSERVE_HIDDEN_DISTRIBUTIONS": ",".join(sorted(hidden)),
            "PAGEDSERVE_HIDDEN_MODULES": ",".join(sorted(modules))}


def _run_commands(pagedserve: str, env: dict[str, str], cwd: Path) -> None:
    """The four commands a user runs first; each must exit 0 without a traceback."""
    def run(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([pagedserve, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stdout, result.stderr)
        return result

    assert "download-default" in run("--help").stdout and "bench" in run("--help").stdout
    assert "--port" in run("serve", "--help").stdout
    assert "throughput" in run("bench", "--help").stdout
    generated = run("generate", "--prompt", "def fibonacci(n):", "--max-tokens", "4", "--kv-cache-memory", "64MiB")
    assert generated.stdout.strip()
    # Without the weights package the bundled demo model runs, and the user is told how to get the real one.
    assert "pagedserve download-default" in generated.stderr


def test_pyproject_declares_the_runtime_requirements():
    """`pip install pagedserve` reads pyproject.toml, `make` reads requirements.txt: the same packages."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = {_canonical(Requirement(r).name): Requirement(r).extras
                for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    pinned = {_canonical(r.name): r.extras for r in _requirement_lines(ROOT / "requirements.txt")}
    assert declared == pinned
    test_only = {_canonical(r.name) for r in _requirement_lines(ROOT / "requirements-test.txt")}
    assert {"httpx", "jsonschema"} <= set(pinned) and not test_only & {"httpx", "jsonschema"}


def test_the_hiding_hook_hides():
    """The control for the next test: a hidden package is really not importable, nor listed."""
    script = ("import importlib.util, importlib.metadata as m\n"
              "assert importlib.util.find_spec('pytest') is None and importlib.util.find_spec('yaml')\n"
              "try:\n    m.version('hypothesis')\nexcept m.PackageNotFoundError:\n    pass\n"
              "else:\n    raise SystemExit('hypothesis is listed')\n"
              "import pagedserve.cluster.cli\n"
              "import pytest\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=hidden_environment(),
                            timeout=120)
    assert result.returncode == 1 and "ModuleNotFoundError: No module named 'pytest'" in result.stderr, result.stderr


def test_every_command_runs_on_the_runtime_requirements_alone(tmp_path):
    pagedserve = Path(sys.executable).with_name("pagedserve")
    assert pagedserve.is_file(), f"no console script at {pagedserve} (pip install -e . makes it)"
    _run_commands(str(pagedserve), hidden_environment(), tmp_path)


def test_serve_and_generate_leave_the_bench_modules_unimported():
    script = ("import sys\n"
              "from pagedserve import cli\n"
              "def bench_modules():\n"
              "    return sorted(m for m in sys.modules if m.startswith('pagedserve.bench.')\n"
              "                  and m != 'pagedserve.bench.cli')\n"
              "for argv in (['serve', '--help'], ['generate', '--help'], ['download-default', '--help'],\n"
              "             ['bench', '--help']):\n"
              "    try:\n"
              "        cli.main(argv)\n"
              "    except SystemExit:\n"
              "        pass\n"
              "    print('MODULES', argv[0], len(bench_modules()))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    counts = dict(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("MODULES"))
    assert counts["serve"] == counts["generate"] == counts["download-default"] == "0"
    assert int(counts["bench"]) > 0  # the control: parsing a bench command does load them


@pytest.mark.slow
def test_every_command_runs_in_a_fresh_venv_with_the_runtime_requirements(tmp_path):
    """For real: python -m venv, torch, requirements.txt, pagedserve --no-deps -e, the four commands."""
    src = tmp_path / "pagedserve"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".pkg"))
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for step in (["torch==2.13.0"], ["-r", str(src / "requirements.txt")], ["--no-deps", "-e", str(src)]):
        result = _run(*pip, *step)
        assert result.returncode == 0, (step, result.stderr[-2000:])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run_commands(str(venv / "bin" / "pagedserve"), env, tmp_path)
