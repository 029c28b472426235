"""Figures for `bench serve --plot` (latency against load) and `tune --plot` (every point of the grid)."""

from __future__ import annotations

from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_vs_load(runs: list[dict[str, Any]], path: str) -> None:
    """TTFT, TPOT and e2e (p50/p90/p99) against the achieved request rate, one panel each."""
    plt = _pyplot()
    ordered = sorted(runs, key=lambda r: r["throughput"]["requests_per_s"])
    load = [r["throughput"]["requests_per_s"] for r in ordered]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end")):
        for stat in ("p50", "p90", "p99"):
            ax.plot(load, [(r["latency_ms"][key] or {}).get(stat) for r in ordered], marker="o", label=stat)
        ax.set_xlabel("achieved load (requests/s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} latency vs load")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tune(points: list[dict[str, Any]], best: dict[str, Any] | None, path: str) -> None:
    """Each grid point's output tokens/s against its TTFT p99, labelled by its setting; points inside
    the SLO filled, the best one circled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in points:
        x, y = p["ttft_p99_ms"], p["output_tokens_per_s"]
        if x is None:
            continue
        ax.scatter([x], [y], s=60, marker="o", facecolors="C0" if p["meets_slo"] else "none", edgecolors="C0")
        ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if best is not None and p["label"] == best["label"]:
            ax.scatter([x], [y], s=250, facecolors="none", edgecolors="C3", linewidths=2, label="best inside SLO")
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("tune: throughput against latency (filled: inside the SLO)")
    ax.grid(True, alpha=0.3)
    if best is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
