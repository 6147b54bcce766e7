"""A supervised warm start on worked solutions, for a real model that never writes the answer format.

    python tools/warm_start.py --model .cache/models/SmolLM2-135M-Instruct --out .cache/models/SmolLM2-warm
    python tools/warm_start.py ... --steps 400 --eval_every 20 --patience 3   # to the dev plateau, keeps the best

GRPO learns only from groups whose rewards differ. SmolLM2-135M-Instruct never writes the
<answer> tags (0 of 200 held-out problems), so every reward is 0 and GRPO has nothing to go on.
This teaches the format from a few hundred of the training problems' own solutions
(simple_grpo/task/supervised.py: `<think>12+7=19\\n...</think><answer>N</answer>`, a share of them in
other styles), with the same prompt the trainers will use, and saves a model GRPO starts from.
With --eval_every N it scores greedy answers on --dev_n dev problems every N steps, saves the best
checkpoint so far to --out (the model GRPO starts from is chosen on dev accuracy alone), and with
--patience P stops once P evaluations in a row bring no new best: the plateau. --max_minutes ends it on
a time budget. warm_start.json records the loss and the dev curve against steps and seconds, dev_curve.png
plots it.
Cached: when --out already holds a warm start with the same cache key, it says so and exits. The key is a hash
of every flag that makes the model (all but --out, --threads, --save_every) and of the code and data the start
depends on: START_CODE's files and the --train (and, with --eval_every, --dev) files, as sha256 of their
contents. A --out holding a start with another key is refused, naming what differs; --print_key prints the key
and exits (tools/demo_real.py names the start's directory by it, so a start made by other code or data is
trained again in a directory of its own, not reused).
"""
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from simple_grpo.evaluation import hf_generate, summarize  # noqa: E402
from simple_grpo.flags import flag, parse_flags  # noqa: E402 (after the path fix that lets the script import it)
from simple_grpo.task.problems import SYSTEM_PROMPT, chat_turn_end_id, load_jsonl, make_prompt, stop_token_ids  # noqa: E402
from simple_grpo.task.supervised import make_batch, sft_target  # noqa: E402


@dataclass
class WarmStartConfig:
    model: str = flag("", "the model to teach: an HF model directory")
    out: str = flag("", "where to save the warm-started model")
    train: str = flag("data/toy_math/train.jsonl", "the problems it learns from")
    train_n: int = flag(0, "learn from the first N problems of --train only (0: all of them): the few problems "
                           "with worked solutions, where the rest have final answers only")
    system_prompt: str = flag(SYSTEM_PROMPT, "the system prompt, as the trainers will be given it")
    steps: int = flag(40, "supervised steps")
    batch_size: int = flag(8, "sequences per step")
    lr: float = flag(5e-5, "AdamW's learning rate (after 5 warm-up steps)")
    lr_schedule: str = flag("constant", "constant, or linear: the lr falls linearly to 0 at --steps, so a budget of "
                                        "steps chosen on dev ends the run, not a plateau read from noise")
    in_format_share: float = flag(0.5, "share of targets in the <think>/<answer> format; the rest in other styles")
    seed: int = flag(0, "seed of the problem draws and target styles")
    threads: int = flag(2, "torch threads")
    save_every: int = flag(0, "also save out/step_N every this many steps (0: only the end)")
    dev: str = flag("data/toy_math/dev.jsonl", "the problems the checkpoints are chosen on (never the test split)")
    dev_n: int = flag(200, "dev problems scored at each evaluation (greedy)")
    dev_max_new_tokens: int = flag(96, "the longest greedy answer at each evaluation, in tokens")
    eval_every: int = flag(0, "score dev accuracy every this many steps and keep the best checkpoint in --out "
                              "(0: no evaluation; --out gets the last step)")
    patience: int = flag(0, "stop after this many evaluations in a row without a new best dev accuracy (0: never)")
    max_minutes: float = flag(0.0, "stop after this many minutes of training (0: no limit); evaluations not counted")
    print_key: bool = flag(False, "print the cache key of the start these flags make (a hash of the flags, the code "
                                  "and the data) and exit, training nothing")


# The code a start's weights and its kept checkpoint depend on: this script's loop, the targets and batches,
# the prompt, and the dev evaluation that picks the checkpoint (generation and the rewards that score it).
START_CODE = ("tools/warm_start.py", "simple_grpo/task/supervised.py", "simple_grpo/task/problems.py",
              "simple_grpo/task/rewards.py", "simple_grpo/evaluation.py")


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def start_sources(cfg):
    """{path: sha256 of its contents} of the code (START_CODE, relative to the repository) and the data files
    (--train; --dev when dev accuracy is scored) the start depends on."""
    data = [cfg.train] + ([cfg.dev] if cfg.eval_every else [])
    for flag_name, path in zip(("--train", "--dev"), data):
        if not os.path.isfile(path):
            raise SystemExit(f"{flag_name} {path}: no such file")
    return {**{path: file_sha256(os.path.join(ROOT, path)) for path in START_CODE},
            **{path: file_sha256(path) for path in data}}


def start_recipe(cfg):
    """Every flag that makes the model: all but where it is saved, the threads, extra checkpoints and
    --print_key."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("out", "threads", "save_every", "print_key")}


def start_key(recipe, sources):
    """The start's cache key: 12 hex digits of the sha256 of its recipe and its sources."""
    return hashlib.sha256(json.dumps({"recipe": recipe, "sources": sources}, sort_keys=True).encode()).hexdigest()[:12]


def differences(record, recipe, sources):
    """What makes an earlier start (its warm_start.json) another start than these flags, code and data would
    make: the flags, then the files, that differ."""
    old_recipe, old_sources = record.get("recipe", {}), record.get("sources", {})
    flags = [f"--{k} {old_recipe.get(k)!r} there, {recipe.get(k)!r} here" for k in sorted({*recipe, *old_recipe})
             if old_recipe.get(k) != recipe.get(k)]
    files = [f"{path} ({'not recorded' if path not in old_sources else 'another version'} there)"
             for path in sources if old_sources.get(path) != sources[path]]
    return "; ".join(flags + files)


def main(cfg: WarmStartConfig):
    if not cfg.model or not os.path.isdir(cfg.model):
        raise SystemExit(f"--model {cfg.model!r}: give a model directory (e.g. make smollm2's)")
    if not cfg.out and not cfg.print_key:
        raise SystemExit("--out: give the directory to save the warm-started model in")
    if not 0 < cfg.in_format_share <= 1:
        raise SystemExit(f"--in_format_share must be in (0, 1], got {cfg.in_format_share}")
    if cfg.eval_every < 0 or cfg.patience < 0 or cfg.max_minutes < 0 or cfg.dev_n < 1:
        raise SystemExit("--eval_every, --patience and --max_minutes must be >= 0, --dev_n >= 1")
    if cfg.patience and not cfg.eval_every:
        raise SystemExit("--patience counts evaluations: give --eval_every too")
    if cfg.lr_schedule not in ("constant", "linear"):
        raise SystemExit(f"--lr_schedule {cfg.lr_schedule!r}: use constant or linear")
    if cfg.train_n < 0:
        raise SystemExit(f"--train_n {cfg.train_n}: give 0 (all problems) or a positive number")
    recipe, sources = start_recipe(cfg), start_sources(cfg)
    key = start_key(recipe, sources)
    if cfg.print_key:
        print(key)
        return
    record_path = os.path.join(cfg.out, "warm_start.json")
    if os.path.isfile(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if record.get("key") == key:
            print(f"warm start: {cfg.out} is already made with these flags, code and data (key {key}; delete it to "
                  "make it again)")
            return
        raise SystemExit(f"{cfg.out} holds a warm start made with other flags, code or data (key "
                         f"{record.get('key')}, here {key}: {differences(record, recipe, sources)}): give another "
                         "--out, or delete it")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    end_token = tokenizer.convert_ids_to_tokens(chat_turn_end_id(tokenizer) or tokenizer.eos_token_id)  # the turn end
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    problems = load_jsonl(cfg.train)[:cfg.train_n or None]
    if len(problems) < cfg.batch_size:
        raise SystemExit(f"--train {cfg.train} --train_n {cfg.train_n}: {len(problems)} problems, fewer than "
                         f"--batch_size {cfg.batch_size}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    decay = (lambda s: max(0.0, 1 - s / cfg.steps)) if cfg.lr_schedule == "linear" else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * decay(s))
    dev = load_jsonl(cfg.dev)[:cfg.dev_n] if cfg.eval_every else []
    history, curve, best = [], [], None  # best: the dev evaluation of the checkpoint in --out
    t0, eval_seconds = time.time(), 0.0  # training time excludes the evaluations
    print(f"warm start: up to {cfg.steps} steps x {cfg.batch_size} of {len(problems)} problems of {cfg.train} at "
          f"lr {cfg.lr} ({cfg.lr_schedule}), "
          f"{cfg.in_format_share:.0%} of targets in format -> {cfg.out}"
          + (f"; dev accuracy on {len(dev)} problems every {cfg.eval_every} steps, the best kept" if dev else ""),
          flush=True)
    model.train()
    for step in range(1, cfg.steps + 1):
        batch = rng.sample(problems, cfg.batch_size)
        prompts = [make_prompt(tokenizer, p["question"], "chat", cfg.system_prompt) for p in batch]
        ids, labels = make_batch(tokenizer, prompts, [sft_target(p, rng, cfg.in_format_share) for p in batch],
                                 end_token)
        loss = model(input_ids=ids, attention_mask=ids != tokenizer.pad_token_id, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = opt.param_groups[0]["lr"]  # this step's
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        train_seconds = time.time() - t0 - eval_seconds
        history.append({"step": step, "loss": round(loss.item(), 4), "lr": lr, "seconds": round(train_seconds, 1)})
        print(f"warm start step {step}/{cfg.steps}: loss {loss.item():.3f} ({train_seconds:.0f} s)", flush=True)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            save(model, tokenizer, os.path.join(cfg.out, f"step_{step}"))
        out_of_time = cfg.max_minutes and train_seconds >= cfg.max_minutes * 60
        if dev and (step % cfg.eval_every == 0 or step == cfg.steps or out_of_time):
            e0 = time.time()
            point = {"step": step, "seconds": round(train_seconds, 1), **dev_accuracy(model, tokenizer, dev, cfg)}
            curve.append(point)
            if best is None or point["accuracy"] > best["accuracy"]:
                best = point
                save(model, tokenizer, cfg.out)
            eval_seconds += time.time() - e0
            print(f"warm start dev at step {step}: accuracy {point['accuracy']:.3f}, format {point['format_rate']:.3f}"
                  f" (best {best['accuracy']:.3f} at step {best['step']})", flush=True)
            if cfg.patience and len(curve) - curve.index(best) > cfg.patience:
                print(f"warm start: dev accuracy has not risen for {cfg.patience} evaluations: the plateau")
                break
        if out_of_time:
            print(f"warm start: {cfg.max_minutes} minutes of training reached at step {step}")
            break
    if not dev:
        save(model, tokenizer, cfg.out)
    with open(record_path, "w") as f:
        json.dump({"key": key, "recipe": recipe, "sources": sources, "best": best, "dev_curve": curve,
                   "history": history}, f, indent=1)
    if curve:
        plot_dev_curve(curve, best, os.path.join(cfg.out, "dev_curve.png"))
    kept = f"step {best['step']} (dev accuracy {best['accuracy']:.3f})" if best else f"step {step}"
    print(f"warm start: {kept} saved to {cfg.out}; {train_seconds:.0f} s of training, {eval_seconds:.0f} s of "
          f"evaluation")


def dev_accuracy(model, tokenizer, problems, cfg):
    """Greedy accuracy and format rate on the dev problems, scored by the training rewards."""
    prompts = [make_prompt(tokenizer, p["question"], "chat", cfg.system_prompt) for p in problems]
    model.eval()
    completions, lengths = hf_generate(model, tokenizer, prompts, max_new_tokens=cfg.dev_max_new_tokens,
                                       batch_size=50, progress=False, stop_ids=stop_token_ids(tokenizer))
    model.train()
    figures = summarize(problems, completions, lengths)
    return {k: round(figures[k], 4) for k in ("accuracy", "format_rate", "mean_tokens")}


def plot_dev_curve(curve, best, path):
    """Dev accuracy against steps and against minutes of training, the kept checkpoint marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, key, scale, label in ((axes[0], "step", 1, "supervised steps"),
                                  (axes[1], "seconds", 60, "minutes of training")):
        ax.plot([p[key] / scale for p in curve], [p["accuracy"] for p in curve], marker="o")
        ax.plot([best[key] / scale], [best["accuracy"]], marker="*", markersize=14, color="tab:red",
                label=f"kept: step {best['step']}, {best['accuracy']:.3f}")
        ax.set_xlabel(label), ax.grid(alpha=0.3)
    axes[0].set_ylabel("dev accuracy (greedy)"), axes[1].legend(loc="lower right")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)


def save(model, tokenizer, out):
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(parse_flags(WarmStartConfig, __doc__))
