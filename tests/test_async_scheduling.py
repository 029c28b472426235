"""Async scheduling (`async_scheduling=True`): step N+1 is scheduled while step N runs, and the outputs are
token for token those of synchronous scheduling under every scheduler feature (greedy and seeded sampling,
chunked prefill, prefix hits, preemption, stop tokens and strings, max_tokens, n > 1, logprobs, aborts,
failures, grammars); a request never shows a token from a step after the one that finished it; every KV
block is free afterwards; and the parity suite passes with it on."""

from __future__ import annotations

import inspect
import threading

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.output_processor import OutputKind
import tests.test_engine_parity as parity
from tests.test_engine_parity import assert_all_blocks_free, random_prompts


def _llm(path, async_scheduling: bool, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, async_scheduling=async_scheduling, **kw)


def _count_placeholders(llm: LLM) -> list[int]:
    """Wrap the scheduler: the returned list grows by the number of requests scheduled ahead in each step."""
    scheduler = llm.llm_engine.engine_core.scheduler
    counts: list[int] = []
    schedule = scheduler.schedule

    def recording():
        so = schedule()
        counts.append(sum(c.num_placeholder_tokens for c in so.scheduled_cached_reqs))
        return so

    scheduler.schedule = recording
    return counts


def _summary(outs) -> tuple[list, list[float]]:
    """Everything a user sees of each output, split into what must be identical (tokens, text, finish and
    stop reasons, which tokens have logprob entries and their ranks) and the logprob floats, which may move
    in the last bit: a batch of another composition rounds its matmuls differently."""
    exact, floats = [], []

    def entries(entry):
        if entry is None:
            return None
        floats.extend(lp.logprob for _, lp in sorted(entry.items()))
        return sorted((t, lp.rank) for t, lp in entry.items())

    for out in outs:
        assert out.finished
        prompt_lp = None if out.prompt_logprobs is None else [entries(e) for e in out.prompt_logprobs]
        completions = []
        for c in out.outputs:
            lps = None if c.logprobs is None else [entries(e) for e in c.logprobs]
            if c.cumulative_logprob is not None:
                floats.append(c.cumulative_logprob)
            completions.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
        exact.append((out.request_id, out.error, prompt_lp, completions))
    return exact, floats


def _assert_same(sync: tuple[list, list[float]], async_: tuple[list, list[float]]) -> None:
    assert sync[0] == async_[0]
    assert async_[1] == pytest.approx(sync[1], abs=1e-5)


def _compare(path, prompts, params, generate_kw: dict | None = None, **engine_kw) -> tuple[list, list[int]]:
    """Run the workload synchronously and asynchronously; returns the (equal) summaries and the
    async run's placeholder counts per step."""
    summaries, placeholders = [], []
    for async_on in (False, True):
        llm = _llm(path, async_on, **engine_kw)
        counts = _count_placeholders(llm)
        outs = llm.generate(prompts, params, use_tqdm=False, **(generate_kw or {}))
        summaries.append(_summary(outs))
        assert_all_blocks_free(llm)
        if async_on:
            placeholders = counts
        else:
            assert sum(counts) == 0  # nothing is scheduled ahead without async scheduling
        llm.shutdown()
    _assert_same(*summaries)
    return summaries[1][0], placeholders


def _token_prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[dict]:
    return [{"prompt_token_ids": p} for p in random_prompts(seed, lengths, prefix)]


SEEDED = dict(temperature=1.0, top_p=0.9, seed=7)

FEATURES = {
    "plain": dict(kv_cache_memory="16MiB"),
    "chunked_prefill": dict(kv_cache_memory="16MiB", max_num_batched_tokens=7),
    "preemption": dict(num_kv_blocks=16, enable_prefix_caching=False),
    "preemption_prefix_chunked": dict(num_kv_blocks=18, max_num_batched_tokens=9),
    "priority": dict(num_kv_blocks=16, scheduling_policy="priority", max_num_seqs=3),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_token_identical_to_sync_under_each_scheduler_feature(tiny_llama, feature, sampling):
    shared = random_prompts(21, [9])[0]
    prompts = _token_prompts(22, [4, 13, 7, 20, 2], prefix=shared) + _token_prompts(23, [11, 5])
    base = dict(max_tokens=14, logprobs=2, **(dict(temperature=0.0) if sampling == "greedy" else SEEDED))
    params = [SamplingParams(**{**base, "max_tokens": 6 + 3 * i}) for i in range(len(prompts))]
    kw = FEATURES[feature]
    generate_kw = {"priority": [i % 3 for i in range(len(prompts))]} if feature == "priority" else None
    summary, placeholders = _compare(tiny_llama, prompts, params, generate_kw, **kw)
    assert sum(placeholders) > 0, "no step was scheduled ahead"
    for (_, _, _, completions), p in zip(summary, params):
        assert len(completions[0][1]) <= p.max_tokens


def test_preemption_and_prefix_hits_really_happen_with_async(tiny_llama):
    shared = random_prompts(24, [12])[0]
    prompts = _token_prompts(25, [5, 9, 3, 12, 6], prefix=shared)
    llm = _llm(tiny_llama, True, num_kv_blocks=18, max_num_batched_tokens=9)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_all_blocks_free(llm)


def test_stop_tokens_n_and_prompt_logprobs(tiny_llama):
    # Stop token ids taken from what the synchronous greedy run generates: several requests stop early.
    prompts = _token_prompts(26, [6, 15, 9, 4])
    probe = _llm(tiny_llama, False, kv_cache_memory="16MiB")
    generated = [o.outputs[0].token_ids for o in probe.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                               use_tqdm=False)]
    probe.shutdown()
    stops = sorted({ids[4] for ids in generated} | {ids[1] for ids in generated[:1]})
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stops, include_stop_str_in_output=False),
        SamplingParams(n=3, max_tokens=10, stop_token_ids=stops, logprobs=1, **SEEDED),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, prompt_logprobs=1, logprobs=3),
    ]
    summary, _ = _compare(tiny_llama, prompts, params, kv_cache_memory="16MiB", max_num_batched_tokens=8)
    first = summary[0][3][0]
    assert first[3] == "stop" and first[4] in stops and len(first[1]) < 12
    assert [c[0] for c in summary[1][3]] == [0, 1, 2]


def test_stop_strings_end_the_text_with_nothing_from_later_steps(tiny_llama):
    """A stop string is found by the output processor after the step that completed it; the step scheduled
    behind it has already run: its token must never reach the user."""
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os"]
    probe = _llm(tiny_llama, False, kv_cache_memory="16MiB")
    texts = [o.outputs[0].text for o in probe.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                                       use_tqdm=False)]
    probe.shutdown()
    stops = [t[len(t) // 3: len(t) // 3 + 2] for t in texts if len(t) >= 6]
    assert stops
    for kind in (OutputKind.FINAL_ONLY, OutputKind.DELTA):
        results = []
        for async_on in (False, True):
            engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4,
                                            kv_cache_memory="16MiB", async_scheduling=async_on))
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=16, stop=stops),
                                   output_kind=kind)
            seen: dict[str, list] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    assert out.request_id not in seen or not seen[out.request_id][-1].finished, \
                        "an output after the request finished"
                    seen.setdefault(out.request_id, []).append(out)
            results.append({rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs
                                  for c in o.outputs] for rid, outs in seen.items()})
            assert engine.engine_core.kv_cache_manager.num_free_blocks == engine.engine_core.num_blocks
            engine.shutdown()
        assert results[0] == results[1]
        assert any(parts[-1][2] == "stop" and parts[-1][3] in stops for parts in results[1].values())


def test_aborts_mid_generation_and_an_id_reused_at_once(tiny_llama):
    """Abort while the request's next step is in flight: no output after the abort, the others unchanged,
    every block free; a new request taking the aborted id right away gets exactly a fresh run's tokens."""
    prompts = random_prompts(27, [7, 12, 5])
    params = SamplingParams(temperature=0.0, max_tokens=20)
    reference = _llm(tiny_llama, False, kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in
                reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    reference.shutdown()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="16MiB",
                                    async_scheduling=True))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, output_kind=OutputKind.CUMULATIVE)
    final: dict[str, list[int]] = {}
    aborted_at = None
    reused = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not (out.request_id == "r1" and aborted_at is not None and not reused), "output after abort"
            tokens = out.outputs[0].token_ids
            if out.request_id == "r1" and aborted_at is None and len(tokens) >= 4:
                aborted_at = list(tokens)
                assert engine.engine_core.scheduler.in_flight, "the abort lands while a batch is in flight"
                engine.abort_request("r1")
                engine.add_request("r1", {"prompt_token_ids": prompts[2]}, params)  # the id, reused at once
                assert [r.request_id for r in engine.engine_core._held] == ["r1"]  # added once its batch is back
                reused = True
            if out.finished:
                final[out.request_id] = tokens
    assert aborted_at == expected[1][: len(aborted_at)]
    assert final == {"r0": expected[0], "r1": expected[2], "r2": expected[2]}
    assert engine.engine_core.kv_cache_manager.num_free_blocks == engine.engine_core.num_blocks
    engine.shutdown()


def test_steps_really_overlap(tiny_llama):
    """Each step, while it executes, sees the scheduler start on the step after it (the worker step waits for
    that schedule() call); without async scheduling it never does. No clocks: a missed overlap times out."""
    for async_on in (True, False):
        llm = _llm(tiny_llama, async_on, kv_cache_memory="16MiB")
        core = llm.llm_engine.engine_core
        worker = core.executor.worker
        scheduled_after = threading.Condition()
        calls = {"schedule": 0}
        issued_at: dict[int, int] = {}  # id(scheduler output) -> schedule() calls when it was made
        overlapped: list[bool] = []
        schedule, execute = core.scheduler.schedule, worker.execute_model

        def recording_schedule():
            with scheduled_after:
                calls["schedule"] += 1
                scheduled_after.notify_all()
            so = schedule()
            issued_at[id(so)] = calls["schedule"]
            return so

        def waiting_execute(so):
            with scheduled_after:
                seen = issued_at[id(so)]
                # Async: the engine thread schedules the next step while this one runs. Sync: it cannot.
                overlapped.append(scheduled_after.wait_for(lambda: calls["schedule"] > seen,
                                                           timeout=5.0 if async_on else 0.2))
            return execute(so)

        core.scheduler.schedule, worker.execute_model = recording_schedule, waiting_execute
        prompts = _token_prompts(28, [5, 9])
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        if async_on:
            assert overlapped and all(overlapped)
        else:
            assert overlapped and not any(overlapped)
        assert_all_blocks_free(llm)
        llm.shutdown()


def test_a_failed_step_fails_its_own_requests_only(tiny_llama):
    """A forward pass that raises fails its batch; the batch behind it (already handed out) runs on, the
    requests only it carries finish normally, and the engine keeps serving."""
    from tests.test_step_failure import _inject, _Poison

    llm = _llm(tiny_llama, True, num_kv_blocks=64, max_model_len=128)
    prompts = random_prompts(29, [9, 13, 6])
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o.outputs[0].token_ids for o in
                _llm(tiny_llama, False, num_kv_blocks=64, max_model_len=128).generate(
                    [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for stage in ("sample", "forward"):
        first_id = int(next(llm._request_counter)) + 1
        _inject(llm.llm_engine, _Poison(stage, str(first_id + 1)))
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            _inject(llm.llm_engine, None)
        assert outs[1].outputs[0].finish_reason == "error" and f"injected {stage} failure" in outs[1].error
        if stage == "sample":  # the others in the batch are untouched
            assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [expected[0], expected[2]]
        for out, ref in zip(outs, expected):
            if out.error is None:
                assert out.outputs[0].token_ids == ref
        assert_all_blocks_free(llm)
        again = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
        assert again.error is None and again.outputs[0].token_ids == expected[1]


def test_grammar_requests_match_sync(tiny_llama):
    """A constrained request is never scheduled ahead (its bitmask needs its real last token) and its
    output equals the synchronous one; unconstrained neighbours still run ahead."""
    prompts = _token_prompts(30, [6, 8, 5])
    spec = {"regex": "[a-z]{3,8}"}
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec),
              SamplingParams(max_tokens=12, structured_outputs=spec, **SEEDED),
              SamplingParams(temperature=0.0, max_tokens=12)]
    _, placeholders = _compare(tiny_llama, prompts, params, kv_cache_memory="16MiB")
    assert sum(placeholders) > 0


@pytest.mark.parametrize("kw, why", [
    (dict(tensor_parallel_size=2), "in-process executor"),
    (dict(distributed_executor_backend="ray"), "in-process executor"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(kv_transfer_config={"kv_connector": "ray", "kv_role": "kv_producer"}), "kv_transfer_config"),
])
def test_unsupported_combinations_are_value_errors(kw, why):
    with pytest.raises(ValueError, match=f"async_scheduling: .*{why}"):
        EngineConfig(model="unused", async_scheduling=True, **kw)


# ----------------------------------------------------------------------------- the parity suite, async


def _parity_cases():
    for name, fn in vars(parity).items():
        if not name.startswith("test_") or not inspect.isfunction(fn):
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            yield pytest.param(name, {}, id=name)
            continue
        (argname, values), = [m.args for m in marks]
        for value in values:
            yield pytest.param(name, {argname: value}, id=f"{name}[{value}]")


@pytest.mark.parametrize("name, params", list(_parity_cases()))
def test_parity_suite_with_async_scheduling(monkeypatch, tiny_model_factory, tmp_path, name, params):
    """tests/test_engine_parity.py (greedy parity with HF under every scheduler feature), every engine built
    with async_scheduling=True."""
    built: list[LLM] = []

    def async_llm(*args, **kwargs):
        llm = LLM(*args, async_scheduling=True, **kwargs)
        built.append(llm)
        return llm

    monkeypatch.setattr(parity, "LLM", async_llm)
    fn = getattr(parity, name)
    fixtures = {"tiny_model_factory": tiny_model_factory, "tmp_path": tmp_path}
    wanted = inspect.signature(fn).parameters
    fn(**{k: v for k, v in fixtures.items() if k in wanted}, **params)
    assert built and all(llm.llm_engine.config.async_scheduling for llm in built)

