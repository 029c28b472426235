"""Render ``assets/MODEL_CARD.md`` from the measured ``training_stats.json`` and
``eval_stats.json`` of the shipped models (no figure in the card is typed by hand).

    python -m training.model_card --target assets/default-model --draft assets/draft-model --out assets/MODEL_CARD.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _read(model_dir: Path, name: str) -> dict:
    path = model_dir / name
    if not path.exists():
        raise ValueError(f"{name}: missing in {model_dir}; run training.train and training.evaluate first")
    return json.loads(path.read_text())


def _model_section(title: str, model_dir: Path) -> str:
    cfg, train, ev = _read(model_dir, "config.json"), _read(model_dir, "training_stats.json"), _read(model_dir, "eval_stats.json")
    rc = train["run_config"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    lines = [
        f"## {title} (`{model_dir.as_posix()}`)",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | `{cfg['architectures'][0]}` ({cfg['model_type']}) |",
        f"| parameters | {train['parameters']:,} ({train['parameters'] / 1e6:.2f}M, embeddings tied to the LM head) |",
        f"| layers / hidden / intermediate | {cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['intermediate_size']} |",
        f"| attention heads / KV heads / head dim | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {head_dim} |",
        f"| vocab / max positions / RoPE theta | {cfg['vocab_size']} / {cfg['max_position_embeddings']} / {theta:g} |",
        f"| weights | safetensors, {cfg.get('dtype')} |",
        f"| optimizer steps | {train['steps']:,} (batch {rc['batch_size']} x {rc['seq_len']} tokens) |",
        f"| tokens seen | {train['tokens_seen']:,} ({train['epochs']:.2f} epochs of the {train['train_tokens_in_corpus']:,}-token train split) |",
        f"| schedule | AdamW (0.9, 0.95), peak lr {rc['lr']:g}, {rc['warmup_steps']} warmup steps, cosine to {rc['min_lr_ratio']:g}x, weight decay {rc['weight_decay']:g}, grad clip 1.0 |",
        f"| wall clock | {train['wall_minutes']} min on {train['threads']} CPU thread(s) of a machine shared with other work, bf16 autocast |",
        f"| seed | {rc['seed']} |",
        f"| final train loss | {train['final_train_loss']:.4f} (mean of the last logged steps) |",
        f"| **held-out loss / perplexity** | **{ev['heldout_loss']:.4f} nats / {ev['heldout_perplexity']:.2f}** over {ev['heldout_tokens_scored']:,} tokens (windows of {ev['seq_len']}) |",
        f"| held-out slice loss (first {ev['slice_windows']} windows; checked by the tests) | {ev['slice_loss']:.4f} |",
    ]
    agree = ev.get("greedy_agreement_with_target")
    if agree:
        lines.append(f"| greedy top-1 agreement with the target | {agree['fraction']:.1%} of positions on {agree['windows']} held-out windows (a proxy for the greedy speculative acceptance rate) |")
    lines += [
        "",
        "Commands that ran (in order; later ones resumed the run):",
        "",
        *[f"    {c}" for c in train["commands"]],
        "",
        f"Same data order and a step-based schedule of the same length: `{train['reproduce']}`",
        "",
        f"Greedy continuation of `{ev['greedy_prompt']}` (HF `generate`, float32):",
        "",
        "```python",
        ev["greedy_prompt"] + ev["greedy_completion"],
        "```",
        "",
    ]
    return "\n".join(lines)


def _caveats(target: Path, draft: Path) -> str:
    t_train, d_train = _read(target, "training_stats.json"), _read(draft, "training_stats.json")
    t_loss, d_loss = _read(target, "eval_stats.json")["heldout_loss"], _read(draft, "eval_stats.json")["heldout_loss"]
    tokens_per_param = t_train["tokens_seen"] / t_train["parameters"]
    lines = ["## Caveats", ""]
    if t_loss >= d_loss:
        lines.append(
            f"- The target's held-out loss ({t_loss:.4f}) is not below the draft's ({d_loss:.4f}). "
            f"The target saw {t_train['tokens_seen']:,} tokens, {tokens_per_param:.2f} per parameter: far too "
            "few for its size, so at this budget it is compute-starved and the small model keeps up. "
            "More training time (the same command with a larger `--max-minutes`, on a less loaded machine) "
            "is what widens the gap; speculative decoding still has a real pair with a measured agreement."
        )
    else:
        lines.append(f"- The target saw {t_train['tokens_seen']:,} tokens ({tokens_per_param:.2f} per parameter): "
                     "undertrained by design of the time budget.")
    if len(t_train["commands"]) > 1 or len(d_train["commands"]) > 1:
        lines.append("- A run that was resumed with a new `--max-minutes` stretched the rest of its cosine schedule "
                     "from that point; its `--steps` command repeats the data order, not that exact lr curve.")
    lines.append("- Completions are Python-shaped (indentation, docstrings, calls) but not correct programs.")
    return "\n".join(lines) + "\n"


def render(target: Path, draft: Path) -> str:
    ev = _read(target, "eval_stats.json")
    corpus = ev["corpus"]
    header = f"""# pagedserve's bundled models

`assets/default-model` is a small Python code model trained from scratch on this
repository's own machine, so that `pagedserve serve` / `pagedserve generate` work
with no model hub; `assets/draft-model` is a ~9x smaller model with the same
tokenizer, the draft for speculative decoding. Both load with
`AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained` offline.
They are completion models for Python source: they were never trained on chat
or instructions. The chat template exists so chat endpoints have a well-defined
format; expect code-like text back, not answers.

## Corpus

The `.py` files of the CPython {corpus['python_version']} standard library
(`sysconfig.get_paths()["stdlib"]`), read as UTF-8 (files that do not decode
are skipped), skipping any directory named {', '.join(f'`{d}`' for d in corpus['excluded_dirs'])}:
third-party code differs per machine, CPython's test suite is full of
deliberately odd code (bad encodings, syntax-error fixtures, huge tables), and
`pydoc_data` is prose. Files are split by SHA-256 of their POSIX path relative to
the stdlib root: {corpus['heldout_percent']}% held out, so the split is the same on every
machine with the same Python version (`training/corpus.py`).

| split | files | characters |
|---|---|---|
| train | {corpus['files']['train']} | {corpus['chars']['train']:,} |
| held-out | {corpus['files']['heldout']} | {corpus['chars']['heldout']:,} |

Each file is one document, `<|bos|>` ... `<|eos|>`; training samples random
windows from the concatenated train stream (`training/data.py`).

## Tokenizer

Byte-level BPE trained with `tokenizers` on the train split, 8192 tokens,
special tokens `<|bos|>` (0), `<|eos|>` (1), `<|pad|>` (2) and chat markers
`<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`. Encoding prepends `<|bos|>`.
The chat template renders each message as `<|role|>\\ncontent<|end|>\\n`, and
`add_generation_prompt` opens `<|assistant|>\\n`; `generation_config.json` lists
both `<|eos|>` and `<|end|>` as EOS. Each model folder carries its own copy.

## Reproduce

```
make train-default-model
```

runs, from a clean checkout (`training/README.md`):

```
python -m training.train --model target --out assets/default-model --max-minutes 41 --threads 2 --batch-size 8
python -m training.train --model draft --out assets/draft-model --max-minutes 14 --threads 1 --batch-size 8 --lr 3e-3
python -m training.evaluate assets/default-model assets/draft-model --draft assets/draft-model
python -m training.model_card --target assets/default-model --draft assets/draft-model --out assets/MODEL_CARD.md
```

A wall-clock budget (`--max-minutes`) runs the cosine schedule over time, so the
number of steps depends on the machine's load; `--steps N` (below) fixes it.
Interrupted runs continue with `--resume` from `training/checkpoints/<model>/ckpt.pt`.

"""
    return header + _model_section("Target model", target) + "\n" + _model_section("Draft model", draft) + _caveats(target, draft) + """
## License

The corpus is the CPython standard library (PSF License); the weights are
released with this repository.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.write_text(render(args.target, args.draft))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
