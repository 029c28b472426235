"""`pagedserve tune`: the engine settings that give the most throughput inside a latency budget.

For every point of the grid `--max-num-seqs` x `--max-num-batched-tokens` (x `--block-size` when given
several), a server is started for MODEL on 127.0.0.1 (`serve_app.start_server`), the serving benchmark
(`bench serve`'s load generator, same workload every time) runs at each `--request-rate`, and the app
is deleted before the next point. A (point, rate) run is inside the SLO when at least
`--slo-attainment` of its requests meet every `--slo` target; the best is the run inside the SLO with
the highest goodput (requests/s meeting the SLO), then output tokens/s. The table of every run, a plot
(`--plot`) and a Serve config of the best setting (`--output-config`, the shape of
manifests/serve_config.yaml, validated by the app builder before it is written) come out.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import yaml

from pagedserve.bench import common
from pagedserve.bench import report as rep
from pagedserve.bench.loadgen import server_info
from pagedserve.bench.serve_load import (
    LocalServer, add_load_args, check_fits, check_load_args, runs_table, server_settings, sweep,
)
from pagedserve.bench.slo import parse_slo
from pagedserve.bench.workload import synthetic

IMPORT_PATH = "pagedserve.cluster.serve.app:build_app"
GRID_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def _int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated integers, got {text!r}") from None
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag}: expected positive integers, got {text!r}")
        return sorted(set(values))

    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="find the max_num_seqs / max_num_batched_tokens with the most "
                                           "throughput inside a latency SLO",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p, random_weights=False)
    p.add_argument("--slo", required=True, help="latency targets, e.g. ttft:500ms,tpot:50ms")
    p.add_argument("--max-num-seqs", type=_int_list("--max-num-seqs"), default=[16, 64])
    p.add_argument("--max-num-batched-tokens", type=_int_list("--max-num-batched-tokens"), default=[512, 2048])
    p.add_argument("--block-size", type=_int_list("--block-size"), default=None,
                   help="block sizes to sweep too (default: the engine's)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--num-cpus-per-engine", type=float, default=None)
    p.add_argument("--port", type=int, default=None, help="(default: a free one; always on 127.0.0.1)")
    p.add_argument("--output-config", default=None, help="write the best setting as a Serve config YAML here")
    add_load_args(p, num_prompts=50)
    common.add_output_args(p, plot=True)
    p.set_defaults(bench_func=run)


def grid(ns: argparse.Namespace) -> list[dict[str, int]]:
    sizes = ns.block_size or [None]
    return [{k: v for k, v in zip(GRID_KEYS, combo) if v is not None}
            for combo in itertools.product(ns.max_num_seqs, ns.max_num_batched_tokens, sizes)]


def pick_best(runs: list[dict[str, Any]], min_attainment: float) -> dict[str, Any] | None:
    """The run inside the SLO with the most goodput, then output tokens/s; None when none is inside."""
    inside = [r for r in runs if r["goodput"]["attainment"] + 1e-12 >= min_attainment]
    if not inside:
        return None
    return max(inside, key=lambda r: (r["goodput"]["requests_per_s"], r["throughput"]["output_tokens_per_s"]))


def serve_config(model: str | None, settings: dict[str, Any], comment: str) -> tuple[dict[str, Any], str]:
    """A Serve config (manifests/serve_config.yaml's shape) for `settings`, as (dict, YAML text)."""
    args: dict[str, Any] = {}
    if model is not None:
        args["model"] = str(Path(model).resolve())
    else:
        args["served_model_name"] = "pagedserve-default"
    args.update(settings)
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
              "applications": [{"name": "pagedserve", "route_prefix": "/", "import_path": IMPORT_PATH,
                                "args": args}]}
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return config, header + yaml.safe_dump(config, sort_keys=False)


def validate_serve_config(config: dict[str, Any]) -> None:
    """Serve's own schema, then the app builder on every application's args (a bad value raises)."""
    from ray.serve.schema import ServeDeploySchema

    from pagedserve.cluster.serve import app as serve_app

    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        if app["import_path"] != IMPORT_PATH:
            raise ValueError(f"serve config: unexpected import_path {app['import_path']!r}")
        serve_app.build_app(dict(app["args"]))


def run(ns: argparse.Namespace) -> int:
    slo = check_load_args(ns)
    if not slo:
        raise ValueError("--slo: required, e.g. ttft:500ms,tpot:50ms")
    parse_slo(ns.slo)
    figures = common.machine(ns)
    model = ns.model
    if model is None:
        from pagedserve.engine.models.default_model import resolve_default_model

        model = resolve_default_model()
    from pagedserve.bench.roofline import model_facts
    from pagedserve.cluster.executor.ray_utils import free_port

    facts = model_facts(model, ns.dtype) if figures is not None else None
    port = ns.port or free_port()
    base = {k: v for k, v in server_settings(ns).items() if k not in GRID_KEYS}
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    server = None
    workload = None
    try:
        for point in grid(ns):
            try:
                from pagedserve.cluster.settings import ServeArgs

                ServeArgs(model=model, **base, **point).resolve()
            except ValueError as exc:
                skipped.append({"params": point, "error": str(exc).splitlines()[0]})
                print(f"tune: skipping {point}: {skipped[-1]['error']}", file=sys.stderr, flush=True)
                continue
            server = LocalServer.start(model, port, {**base, **point})
            try:
                info = server_info(server.url, {}, ns.timeout)
                check_fits(info, ns)
                if workload is None:
                    workload = synthetic(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, info.token_ids)
                runs += sweep(server.url, info, workload, ns, slo, facts, figures, params=point)
            finally:
                server.stop(everything=False)
    finally:
        if server is not None:
            server.stop()
    if not runs:
        raise ValueError("tune: no grid point could run: " + "; ".join(s["error"] for s in skipped))
    best = pick_best(runs, ns.slo_attainment)
    summary: dict[str, Any] = {"slo_ms": {k: v * 1e3 for k, v in slo.items()}, "slo_attainment": ns.slo_attainment,
                               "grid": grid(ns), "skipped": skipped,
                               "best": None if best is None else {"name": best["name"], "params": best["params"],
                                                                  "goodput_requests_per_s":
                                                                      best["goodput"]["requests_per_s"],
                                                                  "output_tokens_per_s":
                                                                      best["throughput"]["output_tokens_per_s"]}}
    parts = [f"pagedserve tune: {model}, SLO {ns.slo} (>= {ns.slo_attainment:.0%} of requests)", runs_table(runs)]
    if best is None:
        parts.append("no setting meets the SLO at these rates: lower --request-rate / --max-concurrency, or loosen "
                     "--slo")
    else:
        setting = {k: v for k, v in best["params"].items() if k in GRID_KEYS}
        parts.append(f"best inside the SLO: {setting} at request rate {best['params']['request_rate']}: goodput "
                     f"{best['goodput']['requests_per_s']:.2f} req/s, {best['throughput']['output_tokens_per_s']:.1f} "
                     "out tok/s")
        if ns.output_config:
            comment = (f"Written by `pagedserve tune` ({rep.environment()['platform']}): the setting with the most "
                       f"goodput\ninside the SLO {ns.slo} (>= {ns.slo_attainment:.0%} of requests) at request rate "
                       f"{best['params']['request_rate']}.\nDeploy: serve run {ns.output_config}")
            settings = {**{k: v for k, v in base.items() if k != "api_key"}, **setting}
            config, text = serve_config(ns.model, settings, comment)
            validate_serve_config(config)
            Path(ns.output_config).write_text(text)
            summary["serve_config"] = ns.output_config
            parts.append(f"wrote {ns.output_config}")
    parts += [rep.machine_line(figures.to_dict() if figures else None), rep.roofline_table(runs)]
    if ns.plot:
        from pagedserve.bench.plots import plot_tune

        points = [{"label": ",".join(str(r["params"][k]) for k in GRID_KEYS if k in r["params"])
                   + f"@{r['params']['request_rate']}",
                   "ttft_p99_ms": (r["latency_ms"]["ttft"] or {}).get("p99"),
                   "output_tokens_per_s": r["throughput"]["output_tokens_per_s"],
                   "meets_slo": r["goodput"]["attainment"] + 1e-12 >= ns.slo_attainment} for r in runs]
        best_point = None if best is None else points[runs.index(best)]
        plot_tune(points, best_point, ns.plot)
        parts.append(f"wrote {ns.plot}")
    config = {k: v for k, v in vars(ns).items() if k != "bench_func"}
    report = rep.make_report("tune", model, config, runs, figures.to_dict() if figures else None, summary)
    common.finish(report, ns, "\n\n".join(parts))
    return 0
