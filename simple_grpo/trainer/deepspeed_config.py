"""The DeepSpeed config of both trainers: built from their flags, or read from --deepspeed FILE.

    python grpo_train.py --dtype bfloat16 --zero_stage 2 --offload_optimizer
    deepspeed grpo_vllm_one.py --deepspeed my_zero3.json      # a whole DeepSpeed config (HF/TRL style)

One engine.step() clips the gradients to a global 2-norm of --max_grad_norm, takes one AdamW step (torch's; --lr,
constant, --adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay) and zeroes the gradients. bfloat16: bf16
weights, gradients and activations, fp32 master weights and Adam moments.
"""
import json
import os

DTYPES = ("float32", "bfloat16")


def flag_config(cfg):
    """The DeepSpeed config the flags ask for."""
    zero = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:  # optimizer state and fp32 master weights live in host RAM
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    adamw = {"lr": cfg.lr, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_epsilon,
             "weight_decay": cfg.weight_decay, "torch_adam": True,  # torch's AdamW, no C++ build
             **({"fused": True} if cfg.offload_optimizer else {})}  # one pass over the host's weights and moments
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.max_grad_norm, "bf16": {"enabled": cfg.dtype == "bfloat16"},
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on offloaded state: no DeepSpeedCPUAdam build
            "optimizer": {"type": "AdamW", "params": adamw}}


def merge(base, override, path="", notes=None):
    """base with override's values on top ("auto" keeps base's); notes: (key, base's, override's)
    for every value the override changes."""
    notes = [] if notes is None else notes
    merged = dict(base)
    for key, value in override.items():
        where = f"{path}.{key}" if path else key
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = merge(base[key], value, where, notes)[0]
        elif value != "auto":
            if base.get(key, None) != value:  # a key base lacks: its value was None
                notes.append((where, base.get(key), value))
            merged[key] = value
    return merged, notes


def deepspeed_config(cfg, defaults=None):
    """The config DeepSpeed gets, and lines that say where a --deepspeed file overrode a flag the
    user set (defaults: the Config with every flag at its default, to tell set flags from default)."""
    if cfg.dtype not in DTYPES:
        raise SystemExit(f"unknown --dtype {cfg.dtype!r}: use one of {', '.join(DTYPES)}")
    if cfg.offload_optimizer and cfg.zero_stage == 0:
        raise SystemExit("--offload_optimizer needs ZeRO (--zero_stage 1, 2 or 3): ZeRO-0 has no offload")
    return file_config(cfg, defaults) if cfg.deepspeed else (flag_config(cfg), [])


def file_config(cfg, defaults=None):
    """flag_config's config with the --deepspeed file's values on top (merge), and the lines that name the
    values the file changed. A file's values win over the flags, except "auto", which takes the flag's (as in
    transformers' and TRL's DeepSpeed integration). The lines name each flag set to other than its default that
    the file overrides, and each change to the optimizer, the clipping or the scheduler (none: the lr is constant)."""
    base = flag_config(cfg)
    if not os.path.isfile(cfg.deepspeed):
        raise SystemExit(f"--deepspeed {cfg.deepspeed}: no such file")
    try:
        with open(cfg.deepspeed) as f:
            override = json.load(f)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--deepspeed {cfg.deepspeed}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(override, dict):
        raise SystemExit(f"--deepspeed {cfg.deepspeed}: expected a JSON object, got {type(override).__name__}")
    if override.get("fp16", {}).get("enabled") is True:
        raise SystemExit(f"--deepspeed {cfg.deepspeed}: fp16 is not supported (its loss scaling is not wired in); "
                         "use bf16")
    merged, notes = merge(base, override)
    steps = merged.get("gradient_accumulation_steps")
    if steps != 1:
        raise SystemExit(f"--deepspeed {cfg.deepspeed}: gradient_accumulation_steps {steps!r}: the trainers call "
                         "engine.step() once per update and expect one optimizer step from each call, which DeepSpeed "
                         f"would then take only once every {steps} calls; set it to 1 or \"auto\" "
                         "(--micro_batch_groups splits an update into passes with one optimizer step)")
    fixed = ("optimizer", "gradient_clipping", "scheduler")  # a file's change to these is named even at the defaults
    set_by_user = flag_config(defaults) if defaults is not None else base
    _, user_notes = merge(set_by_user, base)  # the values the flags changed from their defaults
    changed = {key for key, _, _ in user_notes}
    lines = [f"--deepspeed {cfg.deepspeed}: {key} = {new!r} from the file, not {old!r} from the flags"
             for key, old, new in notes if key in changed]
    lines += [f"--deepspeed {cfg.deepspeed}: {key} = {new!r} from the file, where the trainers set "
              f"{'none' if old is None else repr(old)} (trainer/deepspeed_config.py's flag_config)"
              for key, old, new in notes if key.startswith(fixed) and key not in changed | {"optimizer.params.lr"}]
    return merged, lines


def uses_bf16(ds_config):
    return bool(ds_config.get("bf16", {}).get("enabled"))


def zero_stage(ds_config):
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))
