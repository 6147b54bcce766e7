"""Build models/tiny-math: the tiny default model, from a seed, on this CPU (~10 minutes).

    python tools/build_tiny_model.py            # writes models/tiny-math/ (committed; no run needs this)

1. A byte-level BPE tokenizer trained on the toy task's text, built like Qwen2's: digits
   stay single tokens (so arithmetic is learnable), the four tags are single tokens.
   Chat template with system/user/assistant roles; eos <|im_end|> != pad <|endoftext|>.
2. A Qwen2-architecture causal LM (~3M parameters), loadable by transformers, vLLM and
   DeepSpeed alike.
3. A short supervised warm start on train.jsonl. Targets are mostly in format,
   `<think>12+7=19\\n19-5=14</think><answer>14</answer>`, mixed with some out of format
   (answer outside the tags, no reasoning), so sampling at T=1 is in format only part of
   the time. Training stops at the first checkpoint whose greedy accuracy on dev.jsonl
   reaches --target_accuracy: a model that is good but not done, leaving reinforcement
   learning room to gain on both accuracy and format.
"""
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from simple_grpo.task.problems import SYSTEM_PROMPT, load_jsonl, make_prompt  # noqa: E402
from simple_grpo.evaluation import hf_generate, summarize  # noqa: E402
from simple_grpo.flags import flag, parse_flags  # noqa: E402
from simple_grpo.task.supervised import make_batch, sft_target  # noqa: E402

TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
# Qwen's ChatML layout; a system message is used only when given.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass
class BuildConfig:
    out: str = flag(os.path.join(ROOT, "models", "tiny-math"), "where to save the model and tokenizer")
    train: str = flag(os.path.join(ROOT, "data", "toy_math", "train.jsonl"), "the supervised warm-start problems")
    dev: str = flag(os.path.join(ROOT, "data", "toy_math", "dev.jsonl"), "problems it is checked on while it trains")
    seed: int = flag(0, "seed of the weights, the batches and the target styles")
    vocab_size: int = flag(1024, "at most; the toy text saturates at ~560 word-level tokens")
    hidden_size: int = flag(192, "the width of the model")
    layers: int = flag(4, "transformer layers")
    batch_size: int = flag(64, "sequences per supervised step")
    lr: float = flag(2e-3, "the learning rate of AdamW")
    max_steps: int = flag(3000, "supervised steps at most")
    eval_every: int = flag(50, "steps between dev evaluations")
    eval_start: int = flag(600, "first dev evaluation (accuracy is near 0 until then)")
    target_accuracy: float = flag(0.37, "stop at the first checkpoint with dev greedy accuracy >= this")
    in_format_share: float = flag(0.55, "share of supervised targets written in the <think>/<answer> format")


def build_tokenizer(texts, vocab_size):
    """A byte-level BPE trained on `texts`, built exactly like Qwen2's tokenizer (transformers
    loads any qwen2 model's tokenizer as Qwen2Tokenizer, with Qwen's pre-tokenizer regex),
    so transformers and vLLM split text the same way it was trained."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # Qwen's regex keeps every digit a token
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bpe = json.loads(tok.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]],
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=specials[1:], model_max_length=512)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def main(cfg: BuildConfig):
    from transformers import AutoModelForCausalLM, Qwen2Config
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train, dev = load_jsonl(cfg.train), load_jsonl(cfg.dev)

    # 1. tokenizer, trained on chat-formatted examples with every style of target
    corpus = [f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{p['question']}"
              f"<|im_end|>\n<|im_start|>assistant\n{sft_target(p, rng, cfg.in_format_share)}<|im_end|>\n"
              for p in train]
    tokenizer = build_tokenizer(corpus, cfg.vocab_size)
    print(f"tokenizer: {len(tokenizer)} tokens; eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r}")

    # 2. model: Qwen2 architecture, tied embeddings like Qwen2.5-0.5B
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                         intermediate_size=3 * cfg.hidden_size, num_hidden_layers=cfg.layers,
                         num_attention_heads=cfg.hidden_size // 64, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    # 3. supervised warm start, stopped early at the target dev accuracy
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    train_prompts = [make_prompt(tokenizer, p["question"]) for p in train]
    dev_prompts = [make_prompt(tokenizer, p["question"]) for p in dev]
    history, t0 = [], time.time()
    bar = tqdm(range(1, cfg.max_steps + 1), desc="warm start")
    for step in bar:
        idx = rng.sample(range(len(train)), cfg.batch_size)
        ids, labels = make_batch(tokenizer, [train_prompts[i] for i in idx],
                                 [sft_target(train[i], rng, cfg.in_format_share) for i in idx],
                                 tokenizer.eos_token)
        model.train()
        loss = model(input_ids=ids, attention_mask=ids != tokenizer.pad_token_id, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.eval_every or step < cfg.eval_start:
            continue
        model.eval()
        completions, lengths = hf_generate(model, tokenizer, dev_prompts, progress=False)
        greedy = summarize(dev, completions, lengths)
        torch.manual_seed(cfg.seed + step)
        completions, lengths = hf_generate(model, tokenizer, dev_prompts[:250], samples=2,
                                           temperature=1.0, progress=False)
        sampled = summarize(dev[:250], completions, lengths)
        record = {"step": step, "loss": round(loss.item(), 4), "minutes": round((time.time() - t0) / 60, 2),
                  "dev_greedy_accuracy": greedy["accuracy"], "dev_greedy_format": greedy["format_rate"],
                  "dev_sampled_accuracy": sampled["accuracy"], "dev_sampled_format": sampled["format_rate"]}
        history.append(record)
        tqdm.write(json.dumps(record))
        if greedy["accuracy"] >= cfg.target_accuracy and greedy["format_rate"] >= 0.9:
            break
    else:
        raise SystemExit(f"dev greedy accuracy never reached {cfg.target_accuracy} in {cfg.max_steps} steps")

    os.makedirs(cfg.out, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    with open(os.path.join(cfg.out, "build_report.json"), "w") as f:
        json.dump({"config": vars(cfg) | {"out": "models/tiny-math", "train": "data/toy_math/train.jsonl",
                                          "dev": "data/toy_math/dev.jsonl"},
                   "history": history}, f, indent=1)
    print(f"saved {cfg.out} at step {history[-1]['step']}")


if __name__ == "__main__":
    main(parse_flags(BuildConfig, __doc__))
