"""The policy as a DeepSpeed engine (one process or many: deepspeed/torchrun launchers, any ZeRO stage), and the
DeepSpeed config it is built from: the flags', or a --deepspeed FILE (HF/TRL style) on top of them.

One engine.step() clips the gradients to a global 2-norm of --max_grad_norm, takes one AdamW step (torch's; --lr,
constant, --adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay) and zeroes the gradients. bfloat16: bf16
weights, gradients and activations, fp32 master weights and Adam moments."""
import glob
import json
import os
import random
import time

import torch

DTYPES = ("float32", "bfloat16")


def setup_distributed():
    """Let plain `python -m simple_grpo.train` run as a one-process DeepSpeed job (MASTER_PORT 0: any free port)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0"}.items():
        os.environ.setdefault(key, value)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(root, ".cache", "torch_extensions"))  # built ops kept
    clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])


def clear_stale_build_locks(extensions_dir, max_age_s=900.0):
    """Remove, saying so, a `lock` file older than max_age_s that a killed build of DeepSpeed's ops left behind:
    torch would wait for it to go away, silently and forever."""
    for lock in glob.glob(os.path.join(extensions_dir, "*", "lock")):
        age = time.time() - os.path.getmtime(lock)
        if age > max_age_s:
            print(f"removing {lock}: a build of DeepSpeed's ops left it {age / 60:.0f} min ago and never finished")
            os.remove(lock)


def make_engine(cfg):
    """The policy as a DeepSpeed engine, and its tokenizer (seeds set first)."""
    if cfg.lr is None:
        raise ValueError("cfg.lr is None: check_options(cfg) fills in the model's default lr, or set it")
    setup_distributed()
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.use_peft:  # LoRA: the base is frozen, the adapters train
        from simple_grpo.lora import add_adapters
        model = add_adapters(model, cfg)
    if cfg.disable_dropout:
        disable_dropout(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=deepspeed_config(cfg)[0])
    if cfg.offload_optimizer:  # the host-side optimizer step: all of this rank's share of the cores
        threads = cfg.offload_threads or host_threads()
        use_threads_in_step(engine.optimizer.optimizer, threads)
        print(f"optimizer offload: AdamW steps on the host with {threads} threads (--offload_threads)")
    return engine, tokenizer


def leave_process_group():
    """This rank leaves the process group DeepSpeed made (NCCL warns at exit of one left open), at the end of a
    trainer's process after a run that ended well (after an error, other ranks may be in a collective)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def disable_dropout(model):
    """Every dropout of the model at 0, so training mode computes what evaluation mode does (TRL's
    disable_dropout_in_model, and also the attention's own rate, which transformers applies without a module)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def host_threads():
    """The cores this process may use, shared among the node's training ranks (deepspeed: LOCAL_SIZE, torchrun:
    LOCAL_WORLD_SIZE)."""
    ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(len(os.sched_getaffinity(0)) // ranks, 1)


def use_threads_in_step(optimizer, threads):
    """Run the optimizer's step() on `threads` torch threads, and the rest of the process on as many as before:
    a trainer on a GPU keeps one thread (--threads) for its own work, but the offloaded AdamW works through
    every parameter's master copy and moments on the host."""
    before = []

    def more_threads(*_):  # a pre-hook that returns nothing leaves step()'s arguments alone
        before.append(torch.get_num_threads())
        torch.set_num_threads(threads)

    optimizer.register_step_pre_hook(more_threads)
    optimizer.register_step_post_hook(lambda *_: torch.set_num_threads(before.pop()))



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
              f"{'none' if old is None else repr(old)} (trainer/deepspeed_engine.py's flag_config)"
              for key, old, new in notes if key.startswith(fixed) and key not in changed | {"optimizer.params.lr"}]
    return merged, lines
