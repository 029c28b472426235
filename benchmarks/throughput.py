"""Offline throughput: pagedserve against HF transformers `generate` (static batching at its best batch
size), same random-weight model, dtype and workload, measured in one run.

    python benchmarks/throughput.py                      # small + medium models, mixed workload, shared-prefix
    python benchmarks/throughput.py --sizes small --num-prompts 64
    python benchmarks/throughput.py --model path/to/model.gguf --num-prompts 16   # a real model (or HF folder)

Workloads are seeded: prompts of 32-512 random tokens, 32-256 output tokens each, ignore_eos (every
request produces exactly its output length in both engines). The shared-prefix workload compares
pagedserve with prefix caching on and off.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.engine import LLM, SamplingParams  # noqa: E402

MODEL_SHAPES = {
    # ~12M parameters
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
    # ~190M parameters: Llama shape, hidden 1024, 8 layers, GQA
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False),
}


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class Result:
    name: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def row(self) -> str:
        return (f"{self.name:<34} {self.elapsed_s:8.1f}s {self.requests_per_s:8.2f} req/s "
                f"{self.output_tokens_per_s:9.1f} out tok/s {self.total_tokens_per_s:9.1f} total tok/s")

    def to_dict(self) -> dict:
        return {**asdict(self), "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s}


def make_model(size: str, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         **MODEL_SHAPES[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = directory / f"llama-{size}"
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"[{size}] random-weight Llama, {n / 1e6:.1f}M parameters -> {path}")
    _save_tokenizer(path)
    return path


def _save_tokenizer(path: Path) -> None:
    """The engine loads a tokenizer with the model; the benchmark feeds token ids, so any will do."""
    from tests.tiny_models import make_tokenizer

    make_tokenizer(path)


def mixed_workload(n: int, seed: int, vocab: int, prompt_range=(32, 512), output_range=(32, 256)) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def shared_prefix_workload(n: int, seed: int, vocab: int, num_prefixes: int = 8, prefix_len: int = 384,
                           suffix_range=(16, 64), output_len: int = 32) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        Request(prefixes[i % num_prefixes] + [rng.randrange(3, vocab) for _ in range(rng.randint(*suffix_range))],
                output_len)
        for i in range(n)
    ]


def run_pagedserve(name: str, path: Path, workload: list[Request], dtype: str, **engine_kwargs) -> Result:
    llm = LLM(model=str(path), dtype=dtype, **engine_kwargs)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.output_len for r in workload), "every request must produce its output length"
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    result = Result(name, len(workload), elapsed, sum(len(r.prompt_token_ids) for r in workload), produced)
    if stats.prefix_cache_queries:
        print(f"    prefix cache hit rate {stats.prefix_cache_hit_rate:.1%}, preemptions {stats.num_preemptions}")
    llm.shutdown()
    del llm
    gc.collect()
    return result


def load_hf_model(path: Path, dtype: torch.dtype):
    """The HF model for a safetensors folder or a GGUF file (transformers dequantizes it, as we do)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.models.gguf_loader import find_gguf_file

    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def run_hf(path: Path, workload: list[Request], dtype: torch.dtype, batch_size: int, name: str) -> Result:
    """Static batching as in vLLM's HF baseline: left-padded batches in arrival order, each generating
    the longest output length in its batch; only the requested tokens count as output."""
    model = load_hf_model(path, dtype)
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                           min_new_tokens=max_new, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return Result(name, len(workload), elapsed, sum(len(r.prompt_token_ids) for r in workload),
                  sum(r.output_len for r in workload))


def best_hf_batch_size(path: Path, workload: list[Request], dtype: torch.dtype, candidates: list[int],
                       sample: int) -> int:
    """Pick HF's best static batch size on a sample of the workload (the full sweep would take hours)."""
    scores = {}
    for bs in candidates:
        subset = workload[: max(sample, bs)]
        result = run_hf(path, subset, dtype, bs, f"hf bs={bs} (calibration)")
        scores[bs] = result.output_tokens_per_s
        print(f"    calibration: HF batch {bs:>3}: {result.output_tokens_per_s:8.1f} out tok/s")
    return max(scores, key=scores.get)


def models_to_run(args: argparse.Namespace, tmp: Path):
    """(label, path, vocab size) for --model, else for each random-weight --sizes model."""
    if args.model:
        from pagedserve.engine.config import EngineConfig

        hf_config = EngineConfig(model=args.model).resolve().hf_config
        print(f"[{Path(args.model).name}] {hf_config.architectures[0]}, {hf_config.num_hidden_layers} layers, "
              f"hidden {hf_config.hidden_size}, vocab {hf_config.vocab_size}")
        yield Path(args.model).name, Path(args.model), hf_config.vocab_size
        return
    for size in args.sizes.split(","):
        yield size, make_model(size, tmp), MODEL_SHAPES[size]["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--model", default=None,
                        help="benchmark this model (HF folder or GGUF file) instead of the random-weight --sizes")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64,128")
    parser.add_argument("--hf-calibration-prompts", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="6GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--skip-shared-prefix", action="store_true")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()

    torch_dtype = getattr(torch, args.dtype)
    engine_kwargs = dict(kv_cache_memory=args.kv_cache_memory)
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    report: dict = {"args": vars(args), "torch_threads": torch.get_num_threads(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for size, path, vocab in models_to_run(args, Path(tmp)):
            workload = mixed_workload(args.num_prompts, args.seed, vocab)
            print(f"[{size}] mixed workload: {len(workload)} requests, "
                  f"{sum(len(r.prompt_token_ids) for r in workload)} prompt tokens, "
                  f"{sum(r.output_len for r in workload)} output tokens, {args.dtype}")
            ours = run_pagedserve(f"pagedserve [{size}]", path, workload, args.dtype, **engine_kwargs)
            print("  " + ours.row())
            candidates = [int(b) for b in args.hf_batch_sizes.split(",")]
            best = best_hf_batch_size(path, workload, torch_dtype, candidates, args.hf_calibration_prompts)
            hf = run_hf(path, workload, torch_dtype, best, f"HF generate bs={best} [{size}]")
            print("  " + hf.row())
            ratio = ours.output_tokens_per_s / hf.output_tokens_per_s
            print(f"  ==> [{size}] pagedserve / HF output tok/s: {ratio:.2f}x "
                  f"(total tok/s {ours.total_tokens_per_s / hf.total_tokens_per_s:.2f}x)")
            entry = {"pagedserve": ours.to_dict(), "hf": hf.to_dict(), "hf_batch_size": best, "ratio": ratio}

            if not args.skip_shared_prefix:
                shared = shared_prefix_workload(max(32, args.num_prompts // 2), args.seed + 1, vocab)
                on = run_pagedserve(f"prefix caching on [{size}]", path, shared, args.dtype, **engine_kwargs)
                off = run_pagedserve(f"prefix caching off [{size}]", path, shared, args.dtype,
                                     enable_prefix_caching=False, **engine_kwargs)
                print(f"[{size}] shared-prefix workload: {len(shared)} requests, 8 prefixes of 384 tokens")
                print("  " + on.row())
                print("  " + off.row())
                print(f"  ==> [{size}] prefix caching on / off total tok/s: "
                      f"{on.total_tokens_per_s / off.total_tokens_per_s:.2f}x")
                entry["shared_prefix"] = {"on": on.to_dict(), "off": off.to_dict()}
            report["results"][size] = entry
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.result_json}")


if __name__ == "__main__":
    main()
