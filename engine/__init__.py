"""pagedserve's engine: `LLM` (offline), `AsyncLLM` (serving), and their types."""

from pagedserve.engine.logging_setup import configure_logging

configure_logging()

from pagedserve.engine.config import EngineConfig  # noqa: E402
from pagedserve.engine.llm import LLM  # noqa: E402
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedserve.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
