"""Rewards for "think, then answer" completions: each is `fn(completion, answer) -> float`, of the model's text
and the true answer ("1000" for GSM8K's "... #### 1,000"). Add your own with `@reward_function("name")` in a file
--reward_file loads.
"""
import importlib.util
import math
import numbers
import os
import re
import threading

from math_verify import parse, verify

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
REWARD_FUNCS = {}  # name -> fn(completion, answer) -> float
DEFAULT_WEIGHTS = {"correctness": 1.0, "format": 0.5}
CORRECTNESS_REWARDS = ("correctness", "answer_is")  # earned only by a right answer: what accuracy can mean


def reward_function(name):
    """`@reward_function("name")`, or bare `@reward_function` (the function's name): adds it to REWARD_FUNCS."""
    def register(fn):
        REWARD_FUNCS[name if isinstance(name, str) else fn.__name__] = fn
        return fn
    return register(name) if callable(name) else register


def true_answer(gsm8k_answer: str) -> str:
    """'...\\n#### 1,234' -> '1234': GSM8K puts the final answer after '####'."""
    if "####" not in gsm8k_answer:
        raise ValueError(f"answer has no '####' line: {gsm8k_answer[-80:]!r}")
    return gsm8k_answer.split("####")[-1].strip().replace(",", "")


def extract_answer(completion: str):
    """The text inside the last <answer>...</answer>, or None when there is none."""
    found = ANSWER_RE.findall(completion)
    return found[-1].strip() if found else None


def extract_stated_answer(completion: str):
    """The number stated right after the last "answer is" ("final answer is" too), past spaces, ':', '**' and '$'
    ("The answer is $1,000." -> "1000"; "-4", "3.50"), or None when there is no such phrase or no number follows it."""
    found = list(re.finditer(r"\banswer\s+is", completion, re.IGNORECASE))
    if not found:
        return None
    number = re.compile(r"[\s:*$]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)").match(completion, found[-1].end())
    return number.group(1).replace(",", "") if number else None


def _equal(predicted, answer) -> float:
    """1.0 when math-verify finds `predicted` (None: nothing found) equal to `answer`, else 0.0."""
    if not predicted:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None  # SIGALRM: main thread only
    gold, pred = parse(answer, parsing_timeout=timeout), parse(predicted, parsing_timeout=timeout)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout))


@reward_function("correctness")
def correctness_reward(completion: str, answer: str) -> float:
    """1.0 when the tagged answer equals `answer` (a plain number or expression), else 0.0."""
    return _equal(extract_answer(completion), answer)


@reward_function("answer_is")
def answer_is_reward(completion: str, answer: str) -> float:
    """1.0 when the number after the last "answer is" equals `answer`, else 0.0."""
    return _equal(extract_stated_answer(completion), answer)


def strict_integer_correct(completion: str, answer: str) -> float:
    """evaluate.py's accuracy_strict: 1.0 when the tagged answer is a plain integer ("50", "-3", "1,000"; not
    "21+29", "50.0", "$50" or "+7") equal to `answer` (itself such an integer), else 0.0."""
    integer = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)", re.ASCII)  # ASCII digits, bare or with commas by 3s
    predicted = extract_answer(completion)
    if predicted is None or not integer.fullmatch(predicted) or not integer.fullmatch(answer.strip()):
        return 0.0
    return float(int(predicted.replace(",", "")) == int(answer.strip().replace(",", "")))


@reward_function("format")
def format_reward(completion: str, answer: str = None) -> float:
    """1.0 for `<think>...</think><answer>...</answer>` with each tag exactly once."""
    once = all(completion.count(tag) == 1 for tag in TAGS)
    return float(once and FORMAT_RE.match(completion) is not None)


def load_reward_file(path) -> list:
    """Run a Python file whose @reward_function decorators add rewards; returns their names."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reward file {path} not found")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    if spec is None:
        raise ValueError(f"reward file {path} is not a Python (.py) file")
    before = dict(REWARD_FUNCS)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ModuleNotFoundError as e:
        if e.name == "rewards":  # a reward file written before rewards.py moved into the package
            raise ImportError(f"reward file {path}: `from rewards import reward_function` is now "
                              "`from simple_grpo.task.rewards import reward_function`") from None
        raise ImportError(f"reward file {path} failed to load: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ImportError(f"reward file {path} failed to load: {type(e).__name__}: {e}") from e
    added = [name for name, fn in REWARD_FUNCS.items() if before.get(name) is not fn]
    if not added:
        raise ValueError(f"reward file {path} registers no reward functions: decorate them with "
                         "@reward_function (from simple_grpo.task.rewards import reward_function)")
    return added


def _known(names):
    unknown = [name for name in names if name not in REWARD_FUNCS]
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; known: {sorted(REWARD_FUNCS)} "
                         "(a reward file adds more)")


def parse_reward_spec(names: str, weights: str = "") -> dict:
    """'correctness,format', '1.0,0.5' -> {"correctness": 1.0, "format": 0.5}; no weights: 1.0 each."""
    names = [n.strip() for n in names.split(",") if n.strip()]
    parts = [w.strip() for w in weights.split(",")] if weights.strip() else ["1"] * len(names)
    if not names:
        raise ValueError("no reward functions named: give e.g. --reward_funcs correctness,format")
    if len(set(names)) != len(names):
        raise ValueError(f"a reward function is named twice in {names}")
    _known(names)
    if len(parts) != len(names):
        raise ValueError(f"{len(names)} reward functions {names} but {len(parts)} weights {parts}: "
                         "give one weight per function, in the same order")
    try:
        values = [float(w) for w in parts]
    except ValueError:
        raise ValueError(f"reward weights must be numbers, got {weights!r}") from None
    if not all(map(math.isfinite, values)):
        raise ValueError(f"reward weights must be finite numbers, got {weights!r}")
    return dict(zip(names, values))


def pick_accuracy_reward(weights) -> str:
    """The reward logged as accuracy: the first of CORRECTNESS_REWARDS among `weights`, else correctness."""
    return next((name for name in weights if name in CORRECTNESS_REWARDS), "correctness")


def score(completion: str, answer: str, weights=None, report=("correctness", "format")) -> dict:
    """Each reward in `weights` (default DEFAULT_WEIGHTS) and `report`, and `reward`: the weighted sum."""
    weights, out = weights or DEFAULT_WEIGHTS, {}
    _known([*weights, *report])
    for name in dict.fromkeys([*report, *weights]):  # in order, once each
        try:
            value = REWARD_FUNCS[name](completion, answer)
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"reward function {name!r} returned {value!r}; it must return a finite number")
        out[name] = float(value)
    out["reward"] = sum(w * out[name] for name, w in weights.items())
    return out
