"""tools/toy_math.py: deterministic GSM8K-format problems, knobs respected, fixed disjoint splits."""
import json
import os
import re

import pytest

from simple_grpo.task.problems import load_jsonl
from simple_grpo.task.rewards import true_answer
from tools.toy_math import make_problem, make_splits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "toy_math")


def steps(problem):
    """[(a, op, b, result)] from the <<a op b = r>> annotations."""
    return [(int(a), op, int(b), int(r)) for a, op, b, r in
            re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>", problem["answer"])]


def test_same_seed_same_problems_other_seed_other_problems():
    import random
    a = [make_problem(random.Random(7)) for _ in range(3)]
    b = [make_problem(random.Random(7)) for _ in range(3)]
    c = [make_problem(random.Random(8)) for _ in range(3)]
    assert a == b and a != c


@pytest.mark.parametrize("min_ops, max_ops, max_number", [(1, 1, 10), (2, 3, 50), (3, 4, 99)])
def test_knobs_bound_the_steps_and_every_number(min_ops, max_ops, max_number):
    import random
    rng = random.Random(0)
    for _ in range(300):
        p = make_problem(rng, min_ops=min_ops, max_ops=max_ops, max_number=max_number)
        s = steps(p)
        assert min_ops <= len(s) <= max_ops
        assert all(1 <= n <= max_number for n in re.findall(r"\d+", p["question"]) for n in [int(n)])
        assert all(1 <= r <= max_number for *_, r in s)


def test_answers_are_right_and_in_gsm8k_format():
    import random
    rng = random.Random(1)
    for _ in range(300):
        p = make_problem(rng)
        value = int(re.search(r"has (\d+)", p["question"]).group(1))
        for a, op, b, r in steps(p):
            assert a == value
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            assert r == value and (op != "/" or a % b == 0)
        assert p["answer"].endswith(f"\n#### {value}") and true_answer(p["answer"]) == str(value)


def test_committed_splits_are_the_generators_output():
    splits = make_splits({"test": 500, "dev": 500, "train": 20000}, seed=0)
    for name, rows in splits.items():
        with open(os.path.join(DATA, f"{name}.jsonl")) as f:
            assert [json.loads(line) for line in f] == rows, f"{name}.jsonl differs from the generator"


def test_splits_are_disjoint_and_test_has_at_least_500():
    questions = {name: [p["question"] for p in load_jsonl(os.path.join(DATA, f"{name}.jsonl"))]
                 for name in ("train", "dev", "test")}
    assert len(questions["test"]) >= 500
    for name, qs in questions.items():
        assert len(set(qs)) == len(qs), f"{name} repeats a question"
    assert not set(questions["test"]) & set(questions["train"])
    assert not set(questions["test"]) & set(questions["dev"])
    assert not set(questions["dev"]) & set(questions["train"])


def test_too_many_problems_for_the_knobs_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct problems"):
        make_splits({"train": 5000}, min_ops=1, max_ops=1, max_number=4)  # about 3,000 exist
