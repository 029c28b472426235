"""`bench serve --offline-baseline`: the workload a started server is about to get, run first through an
offline engine (`LLM`, timed as `bench throughput` times it) with the server's engine settings, so that
each rate's served throughput reads as a ratio of the offline one. It runs before the server starts:
nothing of Ray or Serve runs beside it."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

from pagedserve.bench.loadgen import SEED_TEXT
from pagedserve.bench.workload import BenchRequest


def offline_engine_kwargs(model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The engine part of the server's settings (`ServeArgs.engine_kwargs`, what the served engine is built
    from; the model included), with the threads its engine runs when `num_cpus_per_engine` is set (the CPUs
    it reserves, `ray_utils.engine_threads`; without it the served engine, like this one, uses every core)."""
    from pagedserve.cluster.executor.ray_utils import engine_threads
    from pagedserve.cluster.settings import ServeArgs

    args = ServeArgs(model=model, **settings)
    kwargs = args.engine_kwargs()
    if "cpu_threads" not in kwargs and "num_cpus_per_engine" in args.model_fields_set:
        threads = engine_threads(None, args.num_cpus_per_engine, 0, None)
        if threads is not None:
            kwargs["cpu_threads"] = threads
    return kwargs


def offline_baseline(model: str, settings: dict[str, Any],
                     make_workload: Callable[[list[int]], list[BenchRequest]]) -> dict[str, Any]:
    """Run the workload `make_workload` builds from the token ids the server's /tokenize gives for SEED_TEXT
    (what `bench serve` draws its prompts from) through an offline `LLM` with `settings`' engine part."""
    from pagedserve.bench.throughput import timed_generate
    from pagedserve.engine.llm import LLM

    llm = LLM(**offline_engine_kwargs(model, settings))
    try:
        token_ids = sorted(set(llm.get_tokenizer().encode(SEED_TEXT, add_special_tokens=False)))
        workload = make_workload(token_ids)
        print(f"offline baseline: {len(workload)} requests through an offline engine ...", file=sys.stderr,
              flush=True)
        _, outputs, seconds = timed_generate(llm, workload, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    failed = sum(1 for o in outputs if o.error)
    if failed:
        raise RuntimeError(f"--offline-baseline: {failed} of {len(outputs)} requests failed offline")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_requests": len(workload), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "duration_s": seconds, "output_tokens_per_s": output_tokens / seconds}
