"""One JSON report shape for every `pagedserve bench` command and `pagedserve tune` (docs/benchmarks.md),
its JSON Schema, latency summaries and the readable tables printed beside it."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
COMMANDS = ("latency", "throughput", "serve", "tune")

_NUMBER = {"type": "number"}
_NONNEG = {"type": "number", "minimum": 0}
_COUNT = {"type": "integer", "minimum": 0}
_SUMMARY = {
    "type": ["object", "null"],
    "required": ["count", "mean", "min", "p50", "p90", "p99", "max"],
    "properties": {"count": {"type": "integer", "minimum": 1}, **{k: _NONNEG for k in
                                                                   ("mean", "min", "p50", "p90", "p99", "max")}},
    "additionalProperties": False,
}
_STEP_ROOFLINE = {
    "type": "object",
    "required": ["steps", "tokens", "context_tokens", "weight_bytes", "kv_bytes", "flops", "t_memory", "t_compute",
                 "ideal_s", "measured_s", "percent_of_ideal", "verdict"],
    "properties": {
        "steps": {"type": "integer", "minimum": 1}, "tokens": {"type": "integer", "minimum": 1},
        "context_tokens": _COUNT,
        "weight_bytes": _NONNEG, "kv_bytes": _NONNEG, "flops": _NONNEG, "t_memory": _NONNEG, "t_compute": _NONNEG,
        "ideal_s": {"type": "number", "exclusiveMinimum": 0}, "measured_s": {"type": "number", "exclusiveMinimum": 0},
        "percent_of_ideal": {"type": "number", "exclusiveMinimum": 0},
        # What the verdict rests on (roofline.verdict); reports written before they were recorded lack them.
        "bandwidth_use": _NONNEG, "matmul_use": _NONNEG,
        "host_share": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "verdict": {"enum": ["memory-bound", "compute-bound", "host-bound", "unexplained"]},
    },
}
_RUN = {
    "type": "object",
    "required": ["name", "params", "num_requests", "completed", "failed", "prompt_tokens", "output_tokens",
                 "duration_s", "throughput", "latency_ms", "roofline"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "params": {"type": "object"},
        "num_requests": _COUNT, "completed": _COUNT, "failed": _COUNT,
        "prompt_tokens": _COUNT, "output_tokens": _COUNT,
        "duration_s": {"type": "number", "exclusiveMinimum": 0},
        "throughput": {
            "type": "object", "required": ["requests_per_s", "output_tokens_per_s", "total_tokens_per_s"],
            "properties": {k: _NONNEG for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")},
        },
        "latency_ms": {"type": "object", "additionalProperties": _SUMMARY},
        "goodput": {
            "type": "object", "required": ["slo_ms", "requests_per_s", "good_requests", "attainment"],
            "properties": {"slo_ms": {"type": "object", "additionalProperties": _NONNEG},
                           "requests_per_s": _NONNEG, "good_requests": _COUNT,
                           "attainment": {"type": "number", "minimum": 0, "maximum": 1}},
        },
        "roofline": {"type": "object", "additionalProperties": _STEP_ROOFLINE},
        # 1 - time in the model / engine step time (common.host_overhead), where the command measures it.
        "host_overhead": {
            "type": "object", "required": ["steps", "step_ms", "model_ms", "host_share"],
            "properties": {"steps": _COUNT, "step_ms": _NONNEG, "model_ms": _NONNEG,
                           "host_share": {"type": "number", "minimum": 0, "maximum": 1}},
        },
        "errors": {"type": "array", "items": {"type": "string"}},
        # `bench serve --offline-baseline`: this run's output tokens/s over the offline engine's on the workload.
        "served_to_offline": _NONNEG,
        # `bench serve`: the server's overhead split over the run (bench/overhead_split.py), in milliseconds.
        "overhead": {
            "type": "object", "required": ["stage_ms"],
            "properties": {"stage_ms": {"type": "object", "additionalProperties": _NONNEG},
                           "ttft_ms": {"type": "object", "additionalProperties": _NONNEG},
                           "tpot_ms": {"type": "object", "additionalProperties": _NONNEG}},
        },
        # Speculative decoding (with --speculative-config): the run's counters (common.spec_decode_delta).
        "spec_decode": {
            "type": "object",
            "required": ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                         "acceptance_rate", "mean_acceptance_length", "acceptance_rate_per_position"],
            "properties": {
                "num_drafts": _COUNT, "num_draft_tokens": _COUNT, "num_accepted_tokens": _COUNT,
                "accepted_per_position": {"type": "array", "items": _COUNT},
                "acceptance_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "mean_acceptance_length": _NONNEG,
                "acceptance_rate_per_position": {"type": "array",
                                                 "items": {"type": "number", "minimum": 0, "maximum": 1}},
            },
        },
    },
}
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pagedserve benchmark report",
    "type": "object",
    "required": ["schema_version", "command", "created", "model", "environment", "config", "machine", "runs",
                 "summary"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "command": {"enum": list(COMMANDS)},
        "created": {"type": "string"},
        "model": {"type": "string"},
        "environment": {"type": "object", "required": ["pagedserve", "torch", "torch_threads", "cpu_count",
                                                       "platform"]},
        "config": {"type": "object"},
        "machine": {
            "type": ["object", "null"],
            "required": ["memory_bandwidth_gb_s", "matmul_gflop_s", "device", "threads", "measured_at"],
            "properties": {"memory_bandwidth_gb_s": {"type": "number", "exclusiveMinimum": 0},
                           "matmul_gflop_s": {"type": "object", "minProperties": 1,
                                              "additionalProperties": {"type": "number", "exclusiveMinimum": 0}}},
        },
        "runs": {"type": "array", "minItems": 1, "items": _RUN},
        "summary": {"type": "object"},
    },
}


def summarize(values_s: Iterable[float]) -> dict[str, float | int] | None:
    """Seconds -> {"count", "mean", "min", "p50", "p90", "p99", "max"} in milliseconds; None when empty."""
    import numpy as np

    arr = np.asarray(list(values_s), dtype=float) * 1e3
    if arr.size == 0:
        return None
    return {"count": int(arr.size), "mean": float(arr.mean()), "min": float(arr.min()),
            "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def throughput(num_requests: int, prompt_tokens: int, output_tokens: int, duration_s: float) -> dict[str, float]:
    return {"requests_per_s": num_requests / duration_s, "output_tokens_per_s": output_tokens / duration_s,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / duration_s}


def environment() -> dict[str, Any]:
    from importlib import metadata

    import torch

    try:
        version = metadata.version("pagedserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"pagedserve": version, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count() or 0, "platform": platform.platform(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, **cpu_features()}


def cpu_features() -> dict[str, Any]:
    """What a CPU figure depends on: the CPU's model name, the vector ISA torch's kernels run with
    (`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...), and how it multiplies bf16 (natively
    with AVX-512 BF16 or AMX, else emulated: about 3x slower than float32)."""
    import torch

    from pagedserve.engine.device_limits import cpu_capabilities

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    caps = cpu_capabilities()
    native = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16")) if caps.get(flag)]
    return {"cpu_model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": f"native ({', '.join(native)})" if native else "emulated"}


def make_report(command: str, model: str, config: dict[str, Any], runs: list[dict[str, Any]],
                machine: dict[str, Any] | None, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    if command not in COMMANDS:
        raise ValueError(f"command: one of {COMMANDS}, got {command!r}")
    return {"schema_version": SCHEMA_VERSION, "command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": model, "environment": environment(), "config": jsonable(config), "machine": machine,
            "runs": jsonable(runs), "summary": jsonable(summary or {})}


def jsonable(value: Any) -> Any:
    """Plain JSON: tuples as lists, infinite floats as "inf", NaN as null."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, Path):
        return str(value)
    return value


def validate_report(report: dict[str, Any]) -> None:
    """Raise ValueError when `report` does not follow REPORT_SCHEMA (plus p50 <= p99 in every summary)."""
    import jsonschema

    try:
        jsonschema.validate(report, REPORT_SCHEMA)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top)"
        raise ValueError(f"report: {where}: {exc.message}") from None
    for run in report["runs"]:
        for name, s in run["latency_ms"].items():
            if s is not None and not s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]:
                raise ValueError(f"report: run {run['name']!r}: latency {name}: percentiles out of order")


def write_report(report: dict[str, Any], path: str | Path) -> None:
    validate_report(report)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def load_report(path: str | Path) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON report: {exc}") from None
    validate_report(report)
    return report


# --------------------------------------------------------------------------- tables


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned first column, right-aligned figures; floats to 4 significant digits or one decimal."""
    text_rows = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text_rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in text_rows])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def latency_table(run: dict[str, Any]) -> str:
    rows = [[name, s["mean"], s["p50"], s["p90"], s["p99"]] for name, s in run["latency_ms"].items() if s]
    return table(["latency (ms)", "mean", "p50", "p90", "p99"], rows)


def roofline_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = []
    for run in runs:
        for phase, r in (run.get("roofline") or {}).items():
            rows.append([f"{run['name']} / {phase}", r["steps"], r["tokens"], r["context_tokens"], r["measured_s"] * 1e3,
                         r["ideal_s"] * 1e3, f"{r['percent_of_ideal']:.3g}%", _share(r.get("bandwidth_use")),
                         _share(r.get("matmul_use")), _share(r.get("host_share")), r["verdict"]])
    if not rows:
        return "(no roofline: the machine figures are not available)"
    text = table(["roofline (one step)", "steps", "tokens", "context", "measured ms", "ideal ms", "of ideal",
                  "of bandwidth", "of matmul", "host share", "verdict"], rows)
    if any(r["percent_of_ideal"] > 100 for run in runs for r in (run.get("roofline") or {}).values()):
        text += ("\nAbove 100%: this run beat the probed figures, so they are low (probed under load?): "
                 "probe again on an idle machine with --remeasure.")
    if any(r["verdict"] == "unexplained" for run in runs for r in (run.get("roofline") or {}).values()):
        text += ("\nunexplained: the step reached under half of both roofs and no measured host share of half "
                 "the step accounts for the rest.")
    return text


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def machine_line(machine: dict[str, Any] | None) -> str:
    if not machine:
        return "machine: not measured"
    flops = ", ".join(f"{k} {v:.1f}" for k, v in machine["matmul_gflop_s"].items())
    return (f"machine ({machine['device']}, {machine['threads']} threads, probed {machine['measured_at']}): "
            f"memory {machine['memory_bandwidth_gb_s']:.1f} GB/s, matmul GFLOP/s {flops}")
