"""Toy arithmetic word problems in GSM8K's format: the task of the tiny default world.

    python tools/toy_math.py                      # rewrites data/toy_math/{train,dev,test}.jsonl
    python tools/toy_math.py --max_ops 2 --max_number 20 --out /tmp/easy

Each problem is a short story: someone starts with some things, then 1..max_ops events
change the count (+, -, x, /), then a question. The answer is written the GSM8K way,
one line per step with <<calculator>> annotations, and `#### N` on the last line:

    {"question": "Mia has 12 apples. She buys 7 more apples. ...",
     "answer": "She buys 7 more: 12+7=<<12+7=19>>19\\n...\\n#### 14"}

Every number in a problem, intermediate results included, lies in 1..max_number, so
the knobs set the difficulty directly. Generation is deterministic for a given seed.
"""
import argparse
import json
import os
import random

NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben", "Lily", "Noah"]
PRONOUN = {n: ("She" if n in {"Mia", "Ava", "Zoe", "Ivy", "Eva", "Lily"} else "He") for n in NAMES}
ITEMS = ["apples", "marbles", "stickers", "cookies", "books", "pencils", "cards", "shells"]

# Each event: (name, story sentence, short reason for the answer line). {p} = pronoun,
# {x} = the event's number, {i} = the item. The arithmetic is chosen in `make_problem`.
ADD = [("{p} buys {x} more {i}.", "buys {x} more"),
       ("{p} finds {x} more {i}.", "finds {x} more"),
       ("A friend gives {o} {x} {i}.", "gets {x} from a friend")]
SUB = [("{p} gives {x} {i} to a friend.", "gives away {x}"),
       ("{p} loses {x} {i}.", "loses {x}"),
       ("{p} uses {x} of the {i}.", "uses {x}")]
MUL = [("Then {p_low} gets {x} times as many {i} as {p_low} has.", "gets {x} times as many"),
       ("The number of {i} {p_low} has grows {x} times.", "grows {x} times")]
DIV = [("{p} splits the {i} into {x} equal piles and keeps one pile.", "keeps 1 of {x} piles"),
       ("{p} packs the {i} into {x} equal bags and keeps one bag.", "keeps 1 of {x} bags")]


def make_problem(rng, min_ops=1, max_ops=3, max_number=50):
    """One problem as a dict with `question` and `answer` (GSM8K format)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    p = PRONOUN[name]
    value = rng.randint(2, max_number)
    story, lines = [f"{name} has {value} {item}."], []
    for _ in range(rng.randint(min_ops, max_ops)):
        # the operations possible from this value, keeping every number in 1..max_number
        ops = []
        if value < max_number:
            ops.append("+")
        if value > 1:
            ops.append("-")
        if 2 * value <= max_number:
            ops.append("*")
        if any(value % k == 0 for k in range(2, 10) if k < value):
            ops.append("/")
        op = rng.choice(ops)
        if op == "+":
            x = rng.randint(1, max_number - value)
            (sentence, reason), new = rng.choice(ADD), value + x
        elif op == "-":
            x = rng.randint(1, value - 1)
            (sentence, reason), new = rng.choice(SUB), value - x
        elif op == "*":
            x = rng.randint(2, min(9, max_number // value))
            (sentence, reason), new = rng.choice(MUL), value * x
        else:
            x = rng.choice([k for k in range(2, 10) if k < value and value % k == 0])
            (sentence, reason), new = rng.choice(DIV), value // x
        fill = dict(p=p, p_low=p.lower(), o="him" if p == "He" else "her", x=x, i=item)
        story.append(sentence.format(**fill))
        expr = f"{value}{op}{x}"
        lines.append(f"{p} {reason.format(**fill)}: {expr}=<<{expr}={new}>>{new}")
        value = new
    story.append(f"How many {item} does {name} have now?")
    return {"question": " ".join(story), "answer": "\n".join(lines) + f"\n#### {value}"}


def make_splits(sizes, seed=0, **knobs):
    """Disjoint splits {name: [problems]} (no question appears in two splits or twice)."""
    rng, seen, splits = random.Random(seed), set(), {}
    for split, n in sizes.items():
        rows, tries = [], 0
        while len(rows) < n:
            tries += 1
            if tries > 50 * n + 1000:
                raise ValueError(f"only {len(rows)} distinct problems for split {split!r} "
                                 f"with {knobs}: widen max_ops or max_number, or ask fewer")
            prob = make_problem(rng, **knobs)
            if prob["question"] not in seen:
                seen.add(prob["question"])
                rows.append(prob)
        splits[split] = rows
    return splits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data", "toy_math"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min_ops", type=int, default=1)
    ap.add_argument("--max_ops", type=int, default=3)
    ap.add_argument("--max_number", type=int, default=50)
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--dev", type=int, default=500, help="for choosing the warm-start checkpoint")
    ap.add_argument("--test", type=int, default=500)
    args = ap.parse_args()
    if not 1 <= args.min_ops <= args.max_ops or args.max_number < 4:
        ap.error("need 1 <= min_ops <= max_ops and max_number >= 4")
    splits = make_splits({"test": args.test, "dev": args.dev, "train": args.train}, seed=args.seed,
                         min_ops=args.min_ops, max_ops=args.max_ops, max_number=args.max_number)
    os.makedirs(args.out, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(args.out, f"{split}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {len(rows):6d} problems to {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
