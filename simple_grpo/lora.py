"""LoRA (--use_peft): a frozen base model plus low-rank adapters (PEFT), and only the adapters train.

Each adapted linear layer computes W x + (lora_alpha / lora_r) * B A x, B starting at zero, so step 0's policy is
the base model. With its adapters off the policy is the base exactly: the KL term's reference needs no second
copy (trainer/update.py's reference_logps). vLLM samples with the adapters merged into the weights it holds
(generation/weight_sync.py's merged_weights).
"""
import json
import os

import torch


def target_modules(spec):
    """--lora_target_modules as PEFT takes it: None (PEFT's choice for the architecture), "all-linear",
    or a list of module names."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        return None
    return "all-linear" if names == ["all-linear"] else names


def add_adapters(model, cfg):
    """The model wrapped by PEFT with fresh LoRA adapters; the base's weights are frozen."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=lora_dropout(cfg),
                        target_modules=target_modules(cfg.lora_target_modules), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module name the model does not have
        raise SystemExit(f"--use_peft: PEFT could not add the adapters ({e})") from None


def lora_dropout(cfg):
    """--lora_dropout, or its default: TRL's 0.05, and 0 under --disable_dropout."""
    if getattr(cfg, "disable_dropout", False):
        return 0.0
    return 0.05 if cfg.lora_dropout is None else cfg.lora_dropout


def is_adapter_dir(path):
    """A LoRA checkpoint (PEFT's adapter_config.json) rather than a whole model."""
    return os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
        os.path.join(path, "config.json"))


def merge_adapter_dir(adapter_dir, out_dir, dtype=torch.float32):
    """Write the base model of adapter_dir with its adapters merged in, and its tokenizer, to out_dir:
    a whole HF model, for evaluate.py, vLLM or another trainer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    if not os.path.isdir(base) and base.startswith(("models/", "runs/", ".", "/")):
        raise SystemExit(f"{adapter_dir}: its base model {base!r} is not here (run from the repository root, "
                         f"or edit base_model_name_or_path in adapter_config.json)")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter_dir)
    model.merge_and_unload().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    return out_dir
