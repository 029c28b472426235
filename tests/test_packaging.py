"""A wheel built from the repository installs one import package, `pagedserve`, and nothing generic.

`kernels` on PyPI (Hugging Face's hub-kernels library) is the name our `kernels/` folder would have
taken in site-packages; the test installs both into one fresh venv and imports both.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPI_KERNELS = "kernels==0.17.2"
GENERIC_NAMES = ("engine", "kernels", "parallel", "kv_transfer", "cluster")


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
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "pagedserve = pagedserve.cluster.cli:main" in entry_points


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
