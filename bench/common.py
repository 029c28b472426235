"""Flags and helpers the bench commands share: the model, engine settings, the roofline figures, output."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.bench import report as rep
from pagedserve.bench.random_model import MODEL_SHAPES
from pagedserve.bench.roofline import Machine, machine_figures


def add_model_args(parser: argparse.ArgumentParser, random_weights: bool = True) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF-format model directory or GGUF file (default: the default model)")
    if random_weights:
        parser.add_argument("--random-weights", choices=list(MODEL_SHAPES), default=None,
                            help="benchmark a random-weight Llama of this shape instead of MODEL")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


BASELINES = ("hf", "llama-cpp")


def parse_baselines(text: str) -> list[str]:
    """"none", "hf", "llama-cpp" or "hf,llama-cpp" -> the baselines to run; argparse type."""
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected none or a comma-separated list of {', '.join(BASELINES)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(names))


# The engine's KV budget on CPU in the benchmarks (offline and served alike, so that they compare).
DEFAULT_KV_CACHE_MEMORY = "1GiB"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY,
                       help=f"KV cache budget on CPU (default {DEFAULT_KV_CACHE_MEMORY})")
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="torch threads of the engine's worker (default: torch's, every core)")
    group.add_argument("--quantization", "-q", choices=["auto", "gguf", "none", "int8", "int4"], default=None,
                       help="'none' runs a quantized GGUF file dequantized (default auto: quantized); 'int8'/'int4' "
                            "quantize a float checkpoint's linear layers at load")
    group.add_argument("--async-scheduling", action="store_true", default=None,
                       help="schedule the next step while this one runs (EngineConfig.async_scheduling)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                            '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'')


def add_output_args(parser: argparse.ArgumentParser, plot: bool = False) -> None:
    parser.add_argument("--output-json", default=None, help="write the report (docs/benchmarks.md) here")
    if plot:
        parser.add_argument("--plot", default=None, help="write a PNG figure here")
    parser.add_argument("--no-roofline", action="store_true", help="skip the roofline (and its one-time probe)")
    parser.add_argument("--roofline-file", default=None,
                        help="machine figures cache (default ~/.cache/pagedserve/roofline.json, or "
                             "$PAGEDSERVE_ROOFLINE_FILE)")
    parser.add_argument("--remeasure", action="store_true", help="probe the machine again, even if cached")


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keywords for the engine flags the user set."""
    kwargs: dict[str, Any] = {"kv_cache_memory": ns.kv_cache_memory, "seed": ns.seed}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
                 "speculative_config", "async_scheduling", "quantization", "cpu_threads"):
        value = getattr(ns, name, None)
        if value is not None:
            kwargs[name] = value
    if "speculative_config" in kwargs:  # checked here so that a bad value names the flag and the field
        from pagedserve.engine.spec_decode.config import parse_speculative_config

        try:
            parse_speculative_config(kwargs["speculative_config"])
        except ValueError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None
    return kwargs


@contextlib.contextmanager
def model_path(ns: argparse.Namespace) -> Iterator[str]:
    """The model to load: --random-weights (built in a temporary folder), MODEL, else the default model."""
    size = getattr(ns, "random_weights", None)
    if size is not None:
        if ns.model is not None:
            raise ValueError("give MODEL or --random-weights, not both")
        from pagedserve.bench.random_model import make_random_model

        with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
            dtype = "float32" if ns.dtype == "float32" else "bfloat16"
            print(f"building a random-weight {size} Llama ({dtype}) ...", file=sys.stderr, flush=True)
            yield str(make_random_model(size, Path(tmp), dtype=dtype))
        return
    if ns.model is None:
        from pagedserve.engine.models.default_model import resolve_default_model

        yield resolve_default_model()
        return
    if not Path(ns.model).exists():
        raise ValueError(f"MODEL: {ns.model!r} does not exist")
    yield ns.model


def machine(ns: argparse.Namespace) -> Machine | None:
    """The roofline's machine figures (probed once and cached), or None with --no-roofline."""
    if ns.no_roofline:
        return None
    path = Path(ns.roofline_file) if ns.roofline_file else None
    cached = None if path is None else path
    print("roofline: reading the machine figures (probing once if not cached) ...", file=sys.stderr, flush=True)
    return machine_figures(cached, remeasure=ns.remeasure)


def finish(report: dict[str, Any], ns: argparse.Namespace, text: str) -> None:
    """Print the tables, then validate and write the JSON report when asked."""
    print(text, flush=True)
    rep.validate_report(report)
    if ns.output_json:
        rep.write_report(report, ns.output_json)
        print(f"wrote {ns.output_json}", flush=True)


def positive(name: str, value: int, minimum: int = 1) -> int:
    if value is None or value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def host_overhead(before: Any, after: Any) -> dict[str, float] | None:
    """The host's share of the engine steps between two `SchedulerStats` snapshots: 1 - (time inside the
    model: forward, logits, sampling; device time on CUDA) / (wall time of the engine steps)."""
    steps = after.num_steps - before.num_steps
    step_s = after.step_seconds - before.step_seconds
    model_s = after.model_seconds - before.model_seconds
    if steps <= 0 or step_s <= 0:
        return None
    return {"steps": steps, "step_ms": 1000 * step_s / steps, "model_ms": 1000 * model_s / steps,
            "host_share": max(0.0, 1 - model_s / step_s)}


def host_overhead_line(figures: dict[str, float] | None, what: str) -> str:
    if not figures:
        return f"host overhead of {what}: not measured"
    return (f"host overhead of {what}: {figures['host_share']:.1%} of a {figures['step_ms']:.1f} ms step "
            f"({figures['model_ms']:.1f} ms in the model) over {figures['steps']} steps")


def spec_decode_delta(before: Any, after: Any) -> dict[str, Any] | None:
    """The speculative-decoding counters of the engine steps between two `SchedulerStats` snapshots, with
    the rates recomputed over that interval; None when the engine does not speculate."""
    from pagedserve.engine.spec_decode.metrics import SpecDecodeStats

    if not after.spec_decoding:
        return None
    old, new = before.spec_decoding or {}, after.spec_decoding
    old_pos = list(old.get("accepted_per_position", []))
    new_pos = list(new["accepted_per_position"])
    old_pos += [0] * (len(new_pos) - len(old_pos))
    delta = SpecDecodeStats(
        num_drafts=new["num_drafts"] - old.get("num_drafts", 0),
        num_draft_tokens=new["num_draft_tokens"] - old.get("num_draft_tokens", 0),
        num_accepted_tokens=new["num_accepted_tokens"] - old.get("num_accepted_tokens", 0),
        accepted_per_position=[b - a for a, b in zip(old_pos, new_pos)],
    )
    return {**delta.as_dict(), "acceptance_rate_per_position": delta.acceptance_rate_per_position}


def spec_decode_line(figures: dict[str, Any] | None, spec_config: str | None) -> str | None:
    """One readable line of acceptance figures (None when the run did not speculate)."""
    if not spec_config:
        return None
    if not figures or not figures["num_drafts"]:
        return "speculative decoding: no drafts were proposed"
    per_pos = " ".join(f"{rate:.2f}" for rate in figures["acceptance_rate_per_position"])
    return (f"speculative decoding: acceptance rate {figures['acceptance_rate']:.1%} "
            f"({figures['num_accepted_tokens']} of {figures['num_draft_tokens']} draft tokens), mean acceptance "
            f"length {figures['mean_acceptance_length']:.2f} over {figures['num_drafts']} drafts; acceptance "
            f"by position {per_pos}")
