"""A short supervised warm start on the answer format, for a real model that never writes it.

    python tools/warm_start.py --model .cache/models/SmolLM2-135M-Instruct --out .cache/models/SmolLM2-warm

GRPO learns only from groups whose rewards differ. SmolLM2-135M-Instruct never writes the
<answer> tags (0 of 200 held-out problems), so every reward is 0 and GRPO has nothing to go on.
This teaches the format from a few hundred of the training problems' own solutions
(simple_grpo/task/warm_start.py: `<think>12+7=19\\n...</think><answer>N</answer>`, a share of them in
other styles), with the same prompt the trainers will use, and saves a model GRPO starts from.
Cached: when --out already holds a warm start made with the same flags, it says so and exits.
"""
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from simple_grpo.flags import flag, parse_flags  # noqa: E402 (after the path fix that lets the script import it)
from simple_grpo.task.problems import SYSTEM_PROMPT, load_jsonl, make_prompt, stop_token_ids  # noqa: E402
from simple_grpo.task.warm_start import make_batch, sft_target  # noqa: E402


@dataclass
class WarmStartConfig:
    model: str = flag("", "the model to teach: an HF model directory")
    out: str = flag("", "where to save the warm-started model")
    train: str = flag("data/toy_math/train.jsonl", "the problems it learns from")
    system_prompt: str = flag(SYSTEM_PROMPT, "the system prompt, as the trainers will be given it")
    steps: int = flag(40, "supervised steps")
    batch_size: int = flag(8, "sequences per step")
    lr: float = flag(5e-5, "AdamW's learning rate (constant after 5 warm-up steps)")
    in_format_share: float = flag(0.5, "share of targets in the <think>/<answer> format; the rest in other styles")
    seed: int = flag(0, "seed of the problem draws and target styles")
    threads: int = flag(2, "torch threads")
    save_every: int = flag(0, "also save out/step_N every this many steps (0: only the end)")


def main(cfg: WarmStartConfig):
    if not cfg.model or not os.path.isdir(cfg.model):
        raise SystemExit(f"--model {cfg.model!r}: give a model directory (e.g. make smollm2's)")
    if not cfg.out:
        raise SystemExit("--out: give the directory to save the warm-started model in")
    if not 0 < cfg.in_format_share <= 1:
        raise SystemExit(f"--in_format_share must be in (0, 1], got {cfg.in_format_share}")
    record_path = os.path.join(cfg.out, "warm_start.json")
    recipe = {k: v for k, v in asdict(cfg).items() if k not in ("out", "threads", "save_every")}  # what makes the model
    if os.path.isfile(record_path):
        with open(record_path) as f:
            if json.load(f)["recipe"] == recipe:
                print(f"warm start: {cfg.out} is already made with these flags (delete it to make it again)")
                return
        raise SystemExit(f"{cfg.out} holds a warm start made with other flags: give another --out, or delete it")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    end_token = tokenizer.convert_ids_to_tokens(stop_token_ids(tokenizer)[-1])  # the chat template's turn end
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    problems = load_jsonl(cfg.train)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    history, t0 = [], time.time()
    print(f"warm start: {cfg.steps} steps x {cfg.batch_size} of {cfg.train} at lr {cfg.lr}, "
          f"{cfg.in_format_share:.0%} of targets in format -> {cfg.out}", flush=True)
    model.train()
    for step in range(1, cfg.steps + 1):
        batch = rng.sample(problems, cfg.batch_size)
        prompts = [make_prompt(tokenizer, p["question"], "chat", cfg.system_prompt) for p in batch]
        ids, labels = make_batch(tokenizer, prompts, [sft_target(p, rng, cfg.in_format_share) for p in batch],
                                 end_token)
        loss = model(input_ids=ids, attention_mask=ids != tokenizer.pad_token_id, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        history.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
        print(f"warm start step {step}/{cfg.steps}: loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            save(model, tokenizer, os.path.join(cfg.out, f"step_{step}"))
    save(model, tokenizer, cfg.out)
    with open(record_path, "w") as f:
        json.dump({"recipe": recipe, "history": history}, f, indent=1)
    print(f"warm start saved to {cfg.out} in {time.time() - t0:.0f} s")


def save(model, tokenizer, out):
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(parse_flags(WarmStartConfig, __doc__))
