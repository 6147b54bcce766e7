"""The flags both trainers take (each script's Config extends TrainerConfig), and check_options."""
import dataclasses
import multiprocessing
import os
import textwrap
from dataclasses import dataclass
from typing import Optional

from grpo_math import ADVANTAGE_ESTIMATORS, LOSS_TYPES
from simple_grpo.flags import flag
from simple_grpo.protocol import DEFAULT_REF_URL
from simple_grpo.run.doctor import parse_stop_on
from simple_grpo.run.metrics import Tracker
from simple_grpo.task.problems import TINY_MODEL, TaskConfig, check_task
from simple_grpo.trainer.deepspeed_engine import deepspeed_config
from triton_loss import check_loss_impl

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class TrainerConfig(TaskConfig):
    """The flags both trainers share; each script's Config adds its own (run_name, threads, ...)."""
    SECTIONS = {"model": "model and data", "num_generations": "sampling", "beta": "objective (grpo_math.py)",
                "lr": "optimisation", "use_peft": "LoRA (simple_grpo/lora.py)", "zero_stage": "systems",
                "save_every": "output", "stop_on": "the run doctor"}
    batch_prompts: int = flag(8, "problems per step")
    beta: float = flag(0.04, "weight of the KL penalty to the reference model; 0: no reference server")
    kl_estimator: str = flag("k3", "k1, k2 or k3 (grpo_math.kl_estimate)")
    epsilon: float = flag(0.2, "PPO clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = flag(None, "upper clip (default: epsilon; 0.28 for dapo, 4.0 for cispo)")
    loss_type: str = flag("grpo", "how the token losses are averaged, over the whole batch (every rank and "
                                  "micro-batch): grpo: each sequence's token mean, then the mean over sequences; "
                                  "bnpo, dapo, cispo: the sum / the batch's kept tokens; dr_grpo: the sum / "
                                  "(sequences x --max_new_tokens). TRL's names; TRL's bnpo divides each micro-batch "
                                  "by its own tokens (docs/guide.md, Research options)")
    importance_sampling_level: str = flag("token", "token, or sequence (GSPO)")
    advantage_estimator: str = flag("grpo", "grpo: group-relative (r - mean) / std; raft: 1 for each correct "
                                            "completion, 0 else (grpo_math.group_advantages)")
    scale_rewards: str = flag("", "advantage scale: group, batch or none (default: group; none for dr_grpo)")
    advantage_eps: float = flag(1e-4, "added to the std the advantages are divided by: equal rewards give 0, not 0/0")
    mask_truncated_completions: bool = flag(False, "completions cut off without a stop token get no gradient (at "
                                                   "--max_new_tokens; grpo_vllm_one: or at vLLM's --max_model_len)")
    lr: Optional[float] = flag(None, "AdamW's learning rate; None: 1e-4 for the tiny default model and 1e-6 (TRL's) "
                                     "for any other (LoRA adapters want ~1e-4)")
    adam_beta1: float = flag(0.9, "AdamW's beta1: the decay of its gradient mean")
    adam_beta2: float = flag(0.99, "AdamW's beta2: the decay of its squared-gradient mean")
    adam_epsilon: float = flag(1e-8, "AdamW's eps, added to the root of the squared-gradient mean (torch's default)")
    weight_decay: float = flag(0.0, "AdamW's decoupled weight decay")
    max_grad_norm: float = flag(1.0, "the gradients' global 2-norm is clipped to this before each step")
    steps: int = flag(200, "training steps: one batch of rollouts each, --num_iterations optimizer steps on it")
    num_iterations: int = flag(1, "optimizer steps per batch of rollouts (TRL's num_iterations, PPO's epochs)")
    micro_batch_groups: int = flag(0, "groups per forward/backward (0: the whole batch); less memory, same step")
    use_peft: bool = flag(False, "train LoRA adapters (PEFT) on a frozen base model; with beta > 0 the base, "
                                 "adapters off, is the reference (no ref server unless --ref_url)")
    lora_r: int = flag(16, "LoRA rank (TRL's default)")
    lora_alpha: int = flag(32, "LoRA scale numerator: the update is (lora_alpha / lora_r) * B @ A (TRL's default)")
    lora_dropout: Optional[float] = flag(None, "dropout on the adapters' input while training (default: TRL's 0.05, "
                                               "or 0 with --disable_dropout)")
    lora_target_modules: str = flag("", "comma-separated module names, or all-linear (every linear layer but the "
                                        "output head); default: PEFT's for the architecture")
    zero_stage: int = flag(0, "DeepSpeed ZeRO stage (0-3)")
    dtype: str = flag("float32", "float32, or bfloat16 (bf16 weights and activations, fp32 master weights and Adam)")
    disable_dropout: bool = flag(False, "every dropout of the policy at 0, LoRA's too: the trainer's log-probs are "
                                        "then those of the policy that sampled (vLLM has no dropout)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward: less memory, ~1/3 more compute")
    offload_optimizer: bool = flag(False, "ZeRO-1/2/3: optimizer state and fp32 master weights in host RAM")
    offload_threads: int = flag(0, "--offload_optimizer: torch threads for the host's optimizer step (0: the cores "
                                   "this process may use / the node's training ranks)")
    deepspeed: str = flag("", "a whole DeepSpeed config (JSON): its values win over these flags, 'auto' takes theirs")
    loss_impl: str = flag("torch", "triton: fused kernels (triton_loss/), the same numbers; torch where Triton can't")
    plan: bool = flag(False, "print the memory plan (simple_grpo/trainer/memory_plan.py) and exit")
    plan_gpu_gb: float = flag(0.0, "the GPU size to plan for (0: this machine's GPU)")
    plan_gpus: int = flag(0, "GPUs on the node to plan for (0: this machine's; none here: vLLM on a GPU of its "
                             "own); where vLLM shares a training GPU, its share counts there")
    ref_url: str = flag("", f"the reference server (python ref_server.py); default {DEFAULT_REF_URL}, and none "
                            "with --use_peft (the base model with the adapters off is the reference)")
    ref_token: str = flag("", "the ref server's shared token, if it has one (default: $SIMPLE_GRPO_TOKEN)")
    ref_model_differs_ok: bool = flag(False, "go on when the ref server serves another model than --model (its /health "
                                             "fingerprint differs): a different reference is meant")
    ref_timeout: float = flag(120.0, "seconds an upload waits for room in a full queue, and grpo_train.py for a "
                                     "finished group (grpo_vllm_one.py's trainer waits --data_timeout)")
    peer_timeout: float = flag(30.0, "seconds the ref server may not answer at all before the run stops")
    local_rank: int = flag(-1, "set by the deepspeed launcher")
    save_every: int = flag(100, "steps between checkpoints (and one at the end)")
    resume: bool = flag(False, "continue runs/RUN_NAME from its latest checkpoint")
    overwrite: bool = flag(False, "replace runs/RUN_NAME if an earlier run used it (its checkpoints are deleted)")
    log_completions_every: int = flag(10, "every N steps, one group's completions to completions.jsonl (0: never)")
    report_to: str = flag("none", "none, tensorboard or wandb: send the metrics there too (metrics.jsonl stays)")
    preflight: bool = flag(False, "first probe preflight_n problems (tools/probe.py); stop if no group has signal")
    preflight_n: int = flag(64, "problems the pre-flight probe samples")
    preflight_timeout: float = flag(1200.0, "seconds the pre-flight probe may take (vLLM's start-up and its "
                                            "sampling) before the run stops")
    stop_on: str = flag("", "doctor rules that stop the run: no_signal, kl, entropy, truncated, mismatch, ratio, "
                                 "tis")
    doctor_window: int = flag(10, "batches in a row with no signal (no_signal); steps the other rules average")
    doctor_kl_max: float = flag(5.0, "kl: KL to the reference above this (the tiny demo peaks near 1.3)")
    doctor_kl_jump: float = flag(20.0, "kl: or above 1 and this many times its mean over the window before")
    doctor_entropy_drop: float = flag(0.1, "entropy: the window's mean below this fraction of the first window's")
    doctor_truncated_max: float = flag(0.5, "truncated: more than this share of completions cut off")
    doctor_gap_max: float = flag(0.1, "mismatch: vLLM vs trainer log-prob gap per token (bf16 SmolLM2: ~0.03)")
    doctor_ratio_band: float = flag(0.1, "ratio: the window's mean importance ratio further than this from 1")
    doctor_tis_capped_max: float = flag(0.5, "tis: the window's mean share of tokens whose TIS weight is at "
                                             "--tis_cap above this (the weights collapse)")


def check_options(cfg):
    """Refuse bad values before the slow start-up, fill in the defaults that depend on other flags, and print
    every number of a step as one block (rank 0), each default filled in with why (step_numbers)."""
    check_values(cfg)
    derived = {}  # flag -> (value, why): the defaults filled in below, printed at the end
    if cfg.epsilon_high is None:
        cfg.epsilon_high = {"dapo": 0.28, "cispo": 4.0}.get(cfg.loss_type, cfg.epsilon)
        derived["epsilon_high"] = (cfg.epsilon_high, f"--loss_type {cfg.loss_type}'s upper clip"
                                   if cfg.loss_type in ("dapo", "cispo") else "--epsilon's value: a symmetric clip")
    if not cfg.scale_rewards:
        cfg.scale_rewards = "none" if cfg.loss_type == "dr_grpo" else "group"
        derived["scale_rewards"] = (cfg.scale_rewards, "--loss_type dr_grpo's: advantages are not divided by a std"
                                    if cfg.loss_type == "dr_grpo" else "each group's reward std divides its advantages")
    lr_given = cfg.lr is not None
    if not lr_given:
        cfg.lr = default_lr(cfg.model)
        derived["lr"] = (cfg.lr, "the default for the tiny model" if is_tiny(cfg.model) else
                         "the default for a model other than the tiny one" +
                         ("; LoRA adapters usually want ~1e-4" if cfg.use_peft else ""))
    if not cfg.ref_url:  # whether a reference server is used follows from it (protocol.uses_ref_server)
        cfg.ref_url, why = default_ref_url(cfg)
        derived["ref_url"] = (cfg.ref_url or "(none)", why)
    # deepspeed_config refuses a bad --dtype, or --offload_optimizer without ZeRO. defaults: every flag at its
    # default (lr: this model's), to tell the flags set; a --deepspeed file's stage, dtype and optimizer go into cfg
    defaults = type(cfg)(lr=None if lr_given else cfg.lr)
    ds_config, notes = deepspeed_config(cfg, defaults)
    if cfg.deepspeed:
        derived.update(from_deepspeed_file(cfg, ds_config, defaults))
    if os.environ.get("RANK", "0") == "0" and multiprocessing.parent_process() is None:  # not grpo_vllm_one's workers
        print(*notes, step_numbers(cfg, derived), sep="\n")


# the numbers that decide what one step computes, printed as one block at start; generation: grpo_vllm_one.py's
STEP_NUMBERS = {
    "sampling": ("batch_prompts", "num_generations", "max_new_tokens", "min_new_tokens", "temperature"),
    "objective": ("beta", "kl_estimator", "epsilon", "epsilon_high", "loss_type", "importance_sampling_level",
                  "advantage_estimator", "scale_rewards", "advantage_eps", "mask_truncated_completions"),
    "optimisation": ("lr", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm",
                     "num_iterations", "micro_batch_groups"),
    "generation": ("tis_cap", "sync_every", "max_policy_lag", "gen_memory", "max_model_len"),
}


def step_numbers(cfg, derived):
    """One block: every number of a step by section, a * on each default filled in from other flags (derived:
    {flag: (value, why)}), and why for each of those."""
    def shown(value):
        return f"{value:g}" if isinstance(value, float) else str(value)
    flags = {f.name for f in dataclasses.fields(cfg)}  # TrainerConfig alone has no generation worker's flags
    lines = ["one step's numbers (* filled in from other flags; runs/RUN_NAME/config.json holds every flag):"]
    for section, names in STEP_NUMBERS.items():
        values = [f"{name}={shown(getattr(cfg, name))}{'*' * (name in derived)}" for name in names if name in flags]
        lines += textwrap.wrap(", ".join(values), 110, initial_indent=f"  {section + ':':<14}",
                               subsequent_indent=" " * 16, break_on_hyphens=False)
    lines += [f"  * {name} {shown(value)}: {why}" for name, (value, why) in derived.items()]
    return "\n".join(lines)


def from_deepspeed_file(cfg, ds_config, defaults):
    """Set cfg's flags to the values a --deepspeed file gave ds_config (the stage, dtype and optimizer the
    rest reads, and config.json records); returns {flag: (value, why)} for those the user left at default."""
    adamw = ds_config.get("optimizer", {}).get("params", {})
    betas = adamw.get("betas", [cfg.adam_beta1, cfg.adam_beta2])
    from_file = {"zero_stage": int(ds_config.get("zero_optimization", {}).get("stage", 0)),
                 "dtype": "bfloat16" if ds_config.get("bf16", {}).get("enabled") else "float32",
                 "lr": adamw.get("lr", cfg.lr), "adam_beta1": betas[0], "adam_beta2": betas[1],
                 "adam_epsilon": adamw.get("eps", cfg.adam_epsilon),
                 "weight_decay": adamw.get("weight_decay", cfg.weight_decay),
                 "max_grad_norm": ds_config.get("gradient_clipping", cfg.max_grad_norm)}
    derived = {}
    for name, value in from_file.items():  # a flag the user left at its default, which the file sets
        if value != getattr(cfg, name) and getattr(cfg, name) == getattr(defaults, name):
            derived[name] = (value, f"from --deepspeed {cfg.deepspeed}")
        setattr(cfg, name, value)
    return derived


def check_values(cfg):
    """Stop with an error naming the flag on an unknown name, a bad number or an impossible combination
    (the task's flags: task/problems.py's check_task, which loads a --reward_file). Sets nothing."""
    if cfg.loss_type not in LOSS_TYPES:
        raise SystemExit(f"unknown --loss_type {cfg.loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if cfg.scale_rewards not in ("", "group", "batch", "none"):  # "": check_options fills it in
        raise SystemExit(f"unknown --scale_rewards {cfg.scale_rewards!r}: use one of group, batch, none")
    for name, allowed in (("kl_estimator", ("k1", "k2", "k3")), ("advantage_estimator", ADVANTAGE_ESTIMATORS),
                          ("importance_sampling_level", ("token", "sequence"))):
        if getattr(cfg, name) not in allowed:
            raise SystemExit(f"unknown --{name} {getattr(cfg, name)!r}: use one of {', '.join(allowed)}")
    if getattr(cfg, "regroup", False) and cfg.advantage_estimator != "grpo":
        raise SystemExit(f"--advantage_estimator {cfg.advantage_estimator} with --regroup: the regrouping server "
                         "computes GRPO's advantages itself; leave one of them out")
    if cfg.use_peft:
        check_lora(cfg)
    check_loss_impl(cfg.loss_impl)  # triton where Triton cannot run stops here
    check_task(cfg)  # the model, data, reward and sampling flags (task/problems.py)
    parse_stop_on(cfg.stop_on)
    Tracker.check(cfg.report_to)


def default_ref_url(cfg):
    """--ref_url's default, and why: the ref server holds the reference model; with LoRA the trainer's own
    base is it (regrouping still needs the server's pools)."""
    if getattr(cfg, "regroup", False):
        return DEFAULT_REF_URL, "the default reference server: --regroup's pools live there"
    if cfg.use_peft:
        return "", ("--use_peft: the base model with its adapters off is the reference, no server" if cfg.beta != 0
                    else "--beta 0 has no KL term, so no reference")
    if cfg.beta == 0:
        return DEFAULT_REF_URL, "the default, unused: --beta 0 has no KL term, so no reference server is asked"
    return DEFAULT_REF_URL, f"the default reference server (python ref_server.py), for --beta {cfg.beta:g}'s KL term"


def default_lr(model):
    """--lr's default: 1e-4 for the tiny default model (docs/tuning.md's grpo_train runs: 2e-4 did worse, 5e-4
    collapsed); 1e-6, TRL's, for any other, as a pretrained model trained in full wants: Adam's first steps move every
    weight by about lr, and 1e-4 took SmolLM2-135M's KL to the reference to 239 in one update."""
    return 1e-4 if is_tiny(model) else 1e-6


def is_tiny(model):
    """Whether model is this repository's tiny model, whatever the working directory."""
    return os.path.realpath(model) == os.path.realpath(os.path.join(REPOSITORY, TINY_MODEL))


def check_lora(cfg):
    """LoRA's flags, before the slow start-up: PEFT installed, a positive rank, a dropout in [0, 1)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise SystemExit("--use_peft needs PEFT: pip install peft (it is in requirements*.txt)") from None
    if cfg.lora_r < 1 or cfg.lora_alpha <= 0:
        raise SystemExit(f"--lora_r {cfg.lora_r}, --lora_alpha {cfg.lora_alpha}: both must be positive")
    if cfg.lora_dropout is not None and not 0 <= cfg.lora_dropout < 1:
        raise SystemExit(f"--lora_dropout {cfg.lora_dropout}: must be in [0, 1)")
    if cfg.lora_dropout and cfg.disable_dropout:
        raise SystemExit(f"--lora_dropout {cfg.lora_dropout} does nothing while --disable_dropout holds every dropout "
                         "at 0: leave one of them out")
