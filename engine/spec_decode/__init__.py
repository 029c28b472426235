"""Speculative decoding: the config, the proposers, exact verification (rejection sampling), the
scheduler's part (scheduling.py), the counters."""

from pagedserve.engine.spec_decode.config import (
    SpeculativeConfig,
    check_draft_compatible,
    load_draft_hf_config,
    parse_speculative_config,
)
from pagedserve.engine.spec_decode.metrics import SpecDecodeStats
from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer
from pagedserve.engine.spec_decode.rejection_sampler import SpecResult, SpecRow, rejection_sample

__all__ = [
    "NgramProposer",
    "SpecDecodeStats",
    "SpecResult",
    "SpecRow",
    "SpeculativeConfig",
    "check_draft_compatible",
    "load_draft_hf_config",
    "parse_speculative_config",
    "rejection_sample",
]
