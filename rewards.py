"""Rewards for "think, then answer" completions: correctness and format.

Both trainers and evaluate.py score with these functions, so a reward means the same
thing everywhere. A completion is the model's decoded text after the prompt:

    <think> 12+7=19 ... </think><answer>14</answer>

- correctness: the text inside the last <answer>...</answer> equals the reference answer
  (the part after `####` in GSM8K's format), checked by math-verify, so "1,000" = 1000,
  "3.50" = 3.5 and "7/2" = 3.5. No answer tags, no credit.
- format: <think>...</think> then <answer>...</answer>, each tag exactly once, nothing
  but whitespace around them.
"""
import re
import threading

from math_verify import parse, verify

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def reference_answer(gsm8k_answer: str) -> str:
    """'...\\n#### 1,234' -> '1234': GSM8K puts the final answer after '####'."""
    if "####" not in gsm8k_answer:
        raise ValueError(f"answer has no '####' line: {gsm8k_answer[-80:]!r}")
    return gsm8k_answer.split("####")[-1].strip().replace(",", "")


def extract_answer(completion: str):
    """The text inside the last <answer>...</answer>, or None when there is none."""
    found = ANSWER_RE.findall(completion)
    return found[-1].strip() if found else None


def _timeout():
    # math-verify's time limit uses SIGALRM, which Python allows only in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def correctness_reward(completion: str, answer: str) -> float:
    """1.0 when the tagged answer equals `answer` (a plain number or expression), else 0.0."""
    predicted = extract_answer(completion)
    if not predicted:
        return 0.0
    gold = parse(answer, parsing_timeout=_timeout())
    pred = parse(predicted, parsing_timeout=_timeout())
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=_timeout()))


def format_reward(completion: str) -> float:
    """1.0 for `<think>...</think><answer>...</answer>` with each tag exactly once."""
    once = all(completion.count(tag) == 1 for tag in TAGS)
    return float(once and FORMAT_RE.match(completion) is not None)


def score(completion: str, answer: str, weights=None) -> dict:
    """Every reward of one completion, plus `reward`: their weighted sum.

    `weights` maps reward names to weights (default: correctness 1.0, format 0.5)."""
    weights = weights or {"correctness": 1.0, "format": 0.5}
    out = {"correctness": correctness_reward(completion, answer), "format": format_reward(completion)}
    out["reward"] = sum(w * out[name] for name, w in weights.items())
    return out
