"""pagedserve's engine: `LLM` (offline), `AsyncLLM` (serving), and their types."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
