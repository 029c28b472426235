"""Workloads for the benchmarks: seeded synthetic requests (fixed lengths or a LOW:HIGH range), a multi-tenant
shared-prefix workload (`SharedPrefixShape`) and dataset files (JSONL prompts, or a ShareGPT-format JSON file
as vLLM reads it).

Every request carries token ids and an exact output length; the benchmarks run them with
`ignore_eos` so each produces exactly that many tokens, in pagedserve and in any baseline alike.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_DATASET_TOKENS = 4  # vLLM drops ShareGPT turns shorter than this (prompt or answer)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """"128" or "64:256" -> (low, high), inclusive; argparse type (ArgumentTypeError on bad input)."""
    low, _, high = str(text).partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def synthetic(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
              token_ids: Sequence[int]) -> list[BenchRequest]:
    """`num` requests of random tokens drawn from `token_ids`, lengths uniform in the given ranges."""
    if num < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {num}")
    if not token_ids:
        raise ValueError("synthetic workload: no token ids to draw from")
    rng = random.Random(seed)
    return [BenchRequest([rng.choice(token_ids) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(num)]


@dataclass(frozen=True)
class SharedPrefixShape:
    """Many tenants, each a long system context and short follow-up questions (`--workload shared-prefix`:
    the llm-d prefix-cache benchmark's shape, scaled down). Every question of a tenant starts with its
    context; a tenant's question j comes in round j, the tenants of one round in a seeded random order, so
    each tenant's context is wanted again only after every other tenant's: once the contexts together need
    more KV than a cache holds, an LRU cache that sees every tenant loses each context before its reuse."""

    tenants: int
    context_len: int
    questions: int
    question_len: int
    output_len: tuple[int, int]  # each request's, uniform in LOW..HIGH

    def __post_init__(self) -> None:
        for name in ("tenants", "context_len", "questions", "question_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"--output-len: expected 1 <= LOW <= HIGH, got {self.output_len}")

    @property
    def num_requests(self) -> int:
        return self.tenants * self.questions

    @property
    def request_len(self) -> int:
        """Tokens the longest request holds at its end (context, question, output)."""
        return self.context_len + self.question_len + self.output_len[1]

    def context_blocks(self, block_size: int) -> int:
        """The KV demand: blocks the tenants' contexts need to stay cached (their full blocks, all tenants)."""
        return self.tenants * (self.context_len // block_size)

    def cache_blocks(self, block_size: int, demand_ratio: float, concurrency: int) -> int:
        """One engine's KV cache size, in blocks, such that the KV demand is `demand_ratio` x it; ValueError
        when that cache could not hold `concurrency` requests at once (raise the ratio's denominator: fewer
        in flight, more tenants or longer contexts)."""
        if not demand_ratio > 0:
            raise ValueError(f"--kv-demand-ratio: must be > 0, got {demand_ratio}")
        blocks = math.ceil(self.context_blocks(block_size) / demand_ratio)
        needed = concurrency * -(-self.request_len // block_size)
        if blocks < needed:
            raise ValueError(f"--kv-demand-ratio: a cache of {blocks} blocks (the contexts' {self.context_blocks(block_size)} "
                             f"/ {demand_ratio}) cannot hold {concurrency} requests of {self.request_len} tokens at once "
                             f"({needed} blocks); lower --max-concurrency or the ratio, or add tenants")
        return blocks


def shared_prefix(shape: SharedPrefixShape, seed: int, token_ids: Sequence[int]) -> list[BenchRequest]:
    """The requests of `shape` in arrival order (see SharedPrefixShape), tokens drawn from `token_ids`."""
    if not token_ids:
        raise ValueError("shared-prefix workload: no token ids to draw from")
    rng = random.Random(seed)
    contexts = [[rng.choice(token_ids) for _ in range(shape.context_len)] for _ in range(shape.tenants)]
    requests = []
    for _ in range(shape.questions):
        order = list(range(shape.tenants))
        rng.shuffle(order)
        for tenant in order:
            question = [rng.choice(token_ids) for _ in range(shape.question_len)]
            requests.append(BenchRequest(contexts[tenant] + question, rng.randint(*shape.output_len)))
    return requests


def code_edit(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
              tokenizer: Any) -> list[BenchRequest]:
    """Code-editing-shaped requests (`--workload repeat`): a window of real Python source (the standard
    library's, the bundled model's own domain), a blank line, then the same window again cut short, so
    that the natural continuation copies the rest of the first copy. Each prompt has exactly its
    input length: the window is long enough that `output_len` tokens remain to be copied. This is the
    workload n-gram prompt lookup is made for (an editor re-emitting a file with small changes)."""
    import sysconfig

    if num < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {num}")
    sep = list(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    if input_len[0] < len(sep) + 2 or input_len[0] < output_len[1] + len(sep) + 2:
        raise ValueError(f"--input-len: the repeat workload needs input_len >= output_len + {len(sep) + 2} "
                         f"(the source, then the part of it the output re-emits); got {input_len} and {output_len}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4096 and not p.name.startswith("_"))
    if not files:
        raise ValueError(f"--workload repeat: no Python sources under {root}")
    rng = random.Random(seed)
    requests = []
    while len(requests) < num:
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        # The source window s and its cut-short copy k: s + sep + k = n_in and s - k >= n_out.
        s = (n_in - len(sep) + n_out + 1) // 2
        k = n_in - len(sep) - s
        text = rng.choice(files).read_text(errors="replace")
        start = rng.randrange(0, max(1, len(text) - 16 * s))
        ids = list(tokenizer(text[start:start + 16 * s], add_special_tokens=False)["input_ids"])
        if len(ids) < s + 1:
            continue  # a file shorter than the window: draw again
        window = ids[1:s + 1]  # drop the first token: the window may have started mid-token
        requests.append(BenchRequest(window + sep + window[:k], n_out))
    return requests


def vocab_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ordinary token ids of the model: the vocabulary minus the tokenizer's special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(vocab_size) if i not in special]


def load_dataset(path: str | Path, tokenizer: Any, num: int, seed: int, output_len: int | None = None,
                 max_model_len: int | None = None) -> list[BenchRequest]:
    """Requests from a dataset file, sampled (seeded) down to `num`.

    - `*.jsonl`: one object a line with "prompt" (text) and optionally "output_len" (or "max_tokens");
    - `*.json`: ShareGPT format, a list of {"conversations": [{"from": "human", "value": ...},
      {"from": "gpt", "value": ...}, ...]}: the first human turn is the prompt and the length of the
      answer that follows it (in tokens) is the output length, as vLLM's benchmark reads it.

    `output_len` overrides every request's output length. Pairs under 4 tokens either way, or longer
    than `max_model_len` together, are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset: {str(path)!r} is not a file")
    pairs: list[tuple[str, int | None, str | None]] = []  # (prompt, output_len, answer text)
    try:
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError(f"--dataset: {path.name} line {n}: expected an object with a \"prompt\" string")
                length = row.get("output_len", row.get("max_tokens"))
                pairs.append((row["prompt"], int(length) if length is not None else None, None))
        else:
            data = json.loads(path.read_text())
            if not isinstance(data, list):
                raise ValueError(f"--dataset: {path.name}: a ShareGPT file is a JSON list of conversations")
            for item in data:
                turns = item.get("conversations") if isinstance(item, dict) else None
                if not turns or len(turns) < 2:
                    continue
                if turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
                    continue
                pairs.append((turns[0]["value"], None, str(turns[1].get("value", ""))))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset: {path.name}: not valid JSON: {exc}") from None
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, length, answer in pairs:
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if output_len is not None:
            length = output_len
        elif length is None:
            length = len(tokenizer(answer or "", add_special_tokens=False)["input_ids"])
        if len(ids) < MIN_DATASET_TOKENS or length < MIN_DATASET_TOKENS:
            continue
        if max_model_len is not None and len(ids) + length > max_model_len:
            continue
        requests.append(BenchRequest(ids, length))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"--dataset: {path.name}: no usable prompt (need >= {MIN_DATASET_TOKENS} tokens each way"
                         + (f" and at most {max_model_len} together)" if max_model_len else ")"))
    return requests


def totals(requests: Sequence[BenchRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a workload."""
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)
