"""Train the bundled default model (``--model target``) or its draft (``--model draft``).

    python -m training.train --model target --out assets/default-model --max-minutes 40
    python -m training.train --model target --out assets/default-model --resume

Full-precision master weights, bf16 autocast on CPU, AdamW, linear warmup then
cosine decay. ``--steps N`` fixes the schedule by steps (bit-for-bit repeatable
data order and learning rates). ``--max-minutes M`` instead runs the cosine over
wall-clock time: progress is elapsed/M and training stops at M minutes. On a
machine shared with other work the throughput swings by 3x within minutes, so a
step count estimated up front overruns or undertrains; the time schedule keeps
the budget and still decays to the floor. The step count it reached is recorded
in ``training_stats.json``; ``--steps`` with that count repeats the run's data
order and a step-based cosine of the same length. A checkpoint is written every
``--ckpt-minutes``; ``--resume`` continues from it with the same schedule,
data order and elapsed time (``--resume --max-minutes M`` changes a time budget).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

from training.data import cached_split, sample_batch
from training.model_configs import build_config
from training.tokenizer import save_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = REPO / "training" / "checkpoints"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass
class RunConfig:
    model: str
    seed: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    total_steps: int  # 0 for a time-based schedule
    max_minutes: float  # 0 for a step-based schedule


def lr_at(step: int, cfg: RunConfig, elapsed_s: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.total_steps > 0:
        total = max(cfg.total_steps, cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
    else:
        progress = min(1.0, elapsed_s / (cfg.max_minutes * 60))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def ensure_tokenizer(tokenizer_dir: Path, vocab_size: int) -> None:
    if (tokenizer_dir / "tokenizer.json").exists():
        return
    from training.corpus import load_split

    print(f"training tokenizer -> {tokenizer_dir}", flush=True)
    save_tokenizer(train_tokenizer(load_split("train"), vocab_size), tokenizer_dir)


def save_checkpoint(path: Path, model, opt, cfg: RunConfig, step: int, tokens: int, elapsed: float,
                    losses: list[float], commands: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cfg": asdict(cfg), "step": step,
                "tokens": tokens, "elapsed": elapsed, "losses": losses, "commands": commands}, tmp)
    tmp.replace(path)


def export(model: LlamaForCausalLM, tokenizer, tokenizer_dir: Path, out: Path) -> None:
    """Final weights in bf16 safetensors + config + generation config + tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["target", "draft"], required=True)
    p.add_argument("--out", type=Path, required=True, help="where the final model is saved")
    p.add_argument("--steps", type=int, default=0, help="total optimizer steps (fixes the schedule)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="size the schedule to this wall-clock budget")
    p.add_argument("--resume", action="store_true", help="continue from the run's checkpoint")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tokenizer-dir", type=Path, default=CHECKPOINTS / "tokenizer")
    p.add_argument("--run-dir", type=Path, default=None, help="checkpoint dir (default training/checkpoints/<model>)")
    args = p.parse_args(argv)
    if not args.resume and (args.steps <= 0) == (args.max_minutes <= 0):
        p.error("give exactly one of --steps or --max-minutes (or --resume)")
    for name in ("batch_size", "seq_len", "warmup_steps", "vocab_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    run_dir = args.run_dir or CHECKPOINTS / args.model
    ckpt_path = run_dir / "ckpt.pt"

    ensure_tokenizer(args.tokenizer_dir, args.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    stream = cached_split(args.tokenizer_dir, tokenizer, "train", CHECKPOINTS.parent / "data")
    print(f"train stream: {len(stream):,} tokens", flush=True)

    state = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.exists() else None
    if args.resume and state is None:
        raise SystemExit(f"--resume: no checkpoint at {ckpt_path}")
    if state is not None:
        cfg = RunConfig(**state["cfg"])
    else:
        cfg = RunConfig(model=args.model, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
                        lr=args.lr, min_lr_ratio=0.1, warmup_steps=args.warmup_steps,
                        weight_decay=args.weight_decay, total_steps=max(args.steps, 0),
                        max_minutes=args.max_minutes if args.steps <= 0 else 0.0)
    if state is not None and args.max_minutes > 0:
        if cfg.total_steps > 0:
            raise SystemExit("--max-minutes: this run has a step-based schedule; it cannot be given a time budget")
        # Extending (or shortening) a time budget on resume stretches the rest of the cosine.
        print(f"time budget {cfg.max_minutes:g} -> {args.max_minutes:g} minutes", flush=True)
        cfg.max_minutes = args.max_minutes
    if cfg.model != args.model:
        raise SystemExit(f"--model: checkpoint is for {cfg.model!r}, not {args.model!r}")

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(build_config(cfg.model, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    step, tokens, elapsed_before, losses = 0, 0, 0.0, []
    command = "python -m training.train " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [command]  # every invocation of this run, resumes included
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens, elapsed_before, losses = state["step"], state["tokens"], state["elapsed"], state["losses"]
        commands = state.get("commands", []) + [command]
        print(f"resumed at step {step}/{cfg.total_steps}", flush=True)
    print(f"{cfg.model}: {n_params / 1e6:.2f}M params, threads={torch.get_num_threads()}", flush=True)

    model.train()
    start = time.monotonic()
    last_ckpt = start
    window_loss, window_t = [], time.monotonic()

    def done() -> bool:
        if cfg.total_steps > 0:
            return step >= cfg.total_steps
        return elapsed_before + time.monotonic() - start >= cfg.max_minutes * 60

    while not done():
        lr = lr_at(step, cfg, elapsed_before + time.monotonic() - start)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = torch.from_numpy(sample_batch(stream, cfg.batch_size, cfg.seq_len, cfg.seed, step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += cfg.batch_size * cfg.seq_len
        window_loss.append(loss.item())
        if step % args.log_every == 0 or step == cfg.total_steps:
            now = time.monotonic()
            mean = float(np.mean(window_loss))
            losses.append(mean)
            tps = len(window_loss) * cfg.batch_size * cfg.seq_len / (now - window_t)
            elapsed = elapsed_before + now - start
            if cfg.total_steps:
                eta = (cfg.total_steps - step) * (now - window_t) / len(window_loss)
            else:
                eta = cfg.max_minutes * 60 - elapsed
            print(f"step {step}/{cfg.total_steps or '?'} loss {mean:.4f} lr {lr:.2e} {tps:,.0f} tok/s "
                  f"tokens {tokens:,} elapsed {elapsed / 60:.1f}m eta {eta / 60:.1f}m", flush=True)
            window_loss, window_t = [], now
        if time.monotonic() - last_ckpt > args.ckpt_minutes * 60:
            save_checkpoint(ckpt_path, model, opt, cfg, step, tokens, elapsed_before + time.monotonic() - start, losses, commands)
            last_ckpt = time.monotonic()
            print(f"checkpoint at step {step} -> {ckpt_path}", flush=True)

    elapsed = elapsed_before + time.monotonic() - start
    save_checkpoint(ckpt_path, model, opt, cfg, step, tokens, elapsed, losses, commands)
    export(model, tokenizer, args.tokenizer_dir, args.out)
    stats = {
        "model": cfg.model, "parameters": n_params, "steps": step, "tokens_seen": tokens,
        "train_tokens_in_corpus": int(len(stream)), "epochs": tokens / len(stream),
        "final_train_loss": losses[-1] if losses else None, "wall_minutes": round(elapsed / 60, 1),
        "threads": torch.get_num_threads(), "run_config": asdict(cfg),
        "commands": commands,
        "reproduce": f"python -m training.train --model {cfg.model} --out {args.out} --steps {step} "
                     f"--seed {cfg.seed} --batch-size {cfg.batch_size} --seq-len {cfg.seq_len} --lr {cfg.lr} "
                     f"--warmup-steps {cfg.warmup_steps} --weight-decay {cfg.weight_decay}",
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"done: {step} steps, {tokens:,} tokens, {elapsed / 60:.1f} min -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
