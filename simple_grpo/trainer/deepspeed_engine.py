"""The policy as a DeepSpeed engine: one process or many (deepspeed/torchrun launchers), any ZeRO stage."""
import glob
import os
import random
import time

import torch

from simple_grpo.lora import add_adapters
from simple_grpo.trainer.deepspeed_config import deepspeed_config


def setup_distributed():
    """Let plain `python grpo_train.py` run as a one-process DeepSpeed job (MASTER_PORT 0: any free port)."""
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
    if cfg.use_peft:  # LoRA: the base is frozen, the adapters train (simple_grpo/lora.py)
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
    """End of a trainer's process, after a run that ended well: this rank leaves the process group DeepSpeed made
    (NCCL warns at exit of one left open). Not at the end of main(): a second run in the same process (the tests,
    a notebook) would find DeepSpeed's group destroyed. Not after an error: other ranks may be in a collective."""
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
