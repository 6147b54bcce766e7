"""Evaluate a model on GSM8K-format problems with the training rewards.

    python evaluate.py --model models/tiny-math --dataset data/toy_math/test.jsonl
    python evaluate.py --model runs/demo/step_200 --temperature 1.0 --samples 4 --json
    python evaluate.py --model runs/qwen/step_400 --dataset openai/gsm8k --dataset_config main --split test
    python evaluate.py --model .cache/models/SmolLM2-135M-Instruct --accuracy_reward answer_is \
        --system_prompt "Solve the math problem step by step. End with: The answer is N." --max_new_tokens 256

Greedy decoding by default. Generates with vLLM when it is installed (fast, batched),
otherwise with transformers' generate (KV cache on), in --dtype float32 (default) or
bfloat16; either backend on the GPU where there is one (--device). A completion ends at EOS or the chat template's turn end (stop_token_ids in
simple_grpo/task/problems.py); vLLM's context is sized to the longest prompt + max_new_tokens,
so no answer is cut short by it (a model whose max_position_embeddings is smaller is refused). Each completion is scored by
simple_grpo/task/rewards.py, the same code training uses, and the script prints a small table; with
--json it also prints one last line {"accuracy": a, "format_rate": f, "n": n, ...}. Accuracy is the
mean of --accuracy_reward: correctness (the <answer> tags), or answer_is for a model never taught them
("The answer is 42.").
accuracy_strict is the share whose <answer> text is a plain integer equal to the true answer ("50", "1,000";
not "21+29", "50.0" or "$50", which math-verify accepts): strict_integer_correct in rewards.py.
With K samples per problem at T > 0 the rates are over all n*K samples and pass@k is
the fraction of problems with at least one correct sample. vLLM logs only its errors unless
VLLM_LOGGING_LEVEL is set (VLLM_LOGGING_LEVEL=INFO shows its notes and warnings).
"""
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from simple_grpo.devices import auto_device
from simple_grpo.evaluation import context_length, hf_generate, summarize, vllm_generate, write_details
from simple_grpo.flags import flag, parse_flags
from simple_grpo.generation.vllm_sampler import quiet_vllm
from simple_grpo.lora import is_adapter_dir, merge_adapter_dir
from simple_grpo.task.problems import DataConfig, load_data, make_prompt, stop_token_ids
from simple_grpo.task.rewards import REWARD_FUNCS
from simple_grpo.trainer.deepspeed_engine import DTYPES


@dataclass
class EvalConfig(DataConfig):
    model: str = flag("models/tiny-math", "the model to evaluate: an HF model directory (a run's checkpoint; "
                                          "a LoRA one is merged into its base first)")
    dataset: str = flag("data/toy_math/test.jsonl", "problems: a file or a hub dataset name, as in the trainers")
    split: str = flag("test", "a hub dataset's split")
    n: int = flag(0, "evaluate the first n problems (0: all)")
    temperature: float = flag(0.0, "sampling temperature; 0: greedy")
    samples: int = flag(1, "completions per problem (needs temperature > 0 when > 1)")
    max_new_tokens: int = flag(64, "the longest completion, in tokens: above the trainers' 48 (task/problems.py), so "
                                   "that an answer a little longer than training allowed is still read whole; the "
                                   "before/after figures of make demo (README) are at 64")
    backend: str = flag("auto", "auto (vllm if installed, else hf), vllm or hf")
    dtype: str = flag("float32", "float32 or bfloat16, in either backend")
    device: str = flag("auto", "where the hf backend runs: auto (the first visible GPU, else cpu), cpu, cuda, "
                               "cuda:1, ...; vLLM takes the visible GPU by itself")
    accuracy_reward: str = flag("correctness", "the reward whose mean is reported as accuracy: correctness "
                                               "(<answer> tags) or answer_is (the model's own 'The answer is N.')")
    answer_prefix: str = flag("", "text every answer is made to begin with (e.g. <think>), scored as part of it: "
                                  "what the model does once started in a format")
    seed: int = flag(0, "seed of the sampling")
    json: bool = flag(False, "print one last JSON line with the figures")
    details: str = flag("", "also write each problem's question, completions and scores to this .jsonl "
                            "(tools/demo_real.py pairs two of them)")


def print_table(metrics, title):
    print(f"\n{title}")
    print(f"{'metric':<20}{'value':>10}")
    for key, value in metrics.items():
        print(f"{key:<20}{value:>10.3f}" if isinstance(value, float) else f"{key:<20}{value:>10}")


def evaluate(cfg: EvalConfig, label=None):
    if cfg.samples > 1 and cfg.temperature <= 0:
        raise SystemExit("--samples > 1 needs --temperature > 0 (greedy samples are all the same)")
    if not os.path.isdir(cfg.model):
        raise SystemExit(f"model directory {cfg.model!r} not found")
    if cfg.dtype not in DTYPES:
        raise SystemExit(f"unknown --dtype {cfg.dtype!r}: use one of {', '.join(DTYPES)}")
    if cfg.accuracy_reward not in REWARD_FUNCS:
        raise SystemExit(f"unknown --accuracy_reward {cfg.accuracy_reward!r}: use one of "
                         f"{', '.join(sorted(REWARD_FUNCS))}")
    if is_adapter_dir(cfg.model):  # a LoRA checkpoint: base + adapters, merged into a whole model for now
        print(f"{cfg.model} holds LoRA adapters: merging them into their base model to evaluate it")
        with tempfile.TemporaryDirectory(prefix="merged_lora_") as merged:
            return evaluate(dataclasses.replace(cfg, model=merge_adapter_dir(cfg.model, merged)), label=cfg.model)
    problems = load_data(cfg)
    problems = problems[:cfg.n] if cfg.n > 0 else problems
    backend = cfg.backend
    quiet_vllm()  # before vLLM is first imported, just below or in vllm_generate
    if backend == "auto":
        try:
            import vllm  # noqa: F401
            backend = "vllm"
        except ImportError:
            backend = "hf"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) + cfg.answer_prefix
               for p in problems]
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    max_model_len = context_length(tokenizer, prompts, cfg.max_new_tokens, cfg.model)
    device = auto_device(cfg.device) if backend == "hf" else auto_device("auto")  # vLLM: the visible GPU, else CPU
    t0 = time.time()
    if backend == "vllm":
        completions, lengths = vllm_generate(cfg.model, prompts, samples=cfg.samples,
                                             temperature=cfg.temperature,
                                             max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                             dtype=cfg.dtype, max_model_len=max_model_len, stop_ids=stop_ids)
    elif backend == "hf":
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
        model = model.to(device).eval()
        completions, lengths = hf_generate(model, tokenizer, prompts, samples=cfg.samples,
                                           temperature=cfg.temperature,
                                           max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids)
    else:
        raise SystemExit(f"unknown --backend {cfg.backend!r}: use auto, vllm or hf")
    completions = [[cfg.answer_prefix + c for c in cs] for cs in completions]
    metrics = summarize(problems, completions, lengths, cfg.accuracy_reward)
    if cfg.details:
        write_details(cfg.details, problems, completions, cfg.accuracy_reward)
    metrics["seconds"] = round(time.time() - t0, 1)
    if cfg.samples == 1:
        metrics.pop("pass_at_k")
    mode = "greedy" if cfg.temperature <= 0 else f"T={cfg.temperature}, {cfg.samples} samples"
    if cfg.accuracy_reward != "correctness":
        mode += f", accuracy by {cfg.accuracy_reward}"
    print_table(metrics, f"{label or cfg.model} on {cfg.dataset} ({mode}, {backend}, {cfg.dtype}, {device})")
    if cfg.json:
        print(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    evaluate(parse_flags(EvalConfig, __doc__))
