"""Random PEFT LoRA adapters for the tiny models (made with PEFT, nonzero B), and the HF + PEFT oracle."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base: Path, out: Path, rank: int, target_modules: list[str], seed: int, alpha: int = 16,
                 use_rslora: bool = False) -> Path:
    """A PEFT adapter folder for `base`: PEFT's own init, then random lora_B (PEFT starts B at zero, which
    would make the adapter a no-op) large enough that the greedy tokens change."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                        use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
            elif "lora_A" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of HF transformers + PEFT's forward (the adapter unmerged), float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(max_tokens):
                logits = model(input_ids=ids).logits[0, -1]
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            outs.append(ids[0, len(prompt):].tolist())
    return outs
