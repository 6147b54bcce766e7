"""Greedy held-out accuracy of every checkpoint of some runs, as one PNG and a JSON line per run.

    python tools/checkpoint_curve.py runs/demo_seed0 runs/demo_seed1 --out docs/demo_accuracy.png

Step 0 is the model the run started from (its config.json names it)."""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.launch import evaluate  # noqa: E402 - after the path fix that lets the script import it


def accuracy(model_dir, data):
    return evaluate(model_dir, os.environ, data)["accuracy"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--data", default="data/toy_math/test.jsonl")
    ap.add_argument("--out", default="docs/demo_accuracy.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in args.runs:
        with open(os.path.join(run, "config.json")) as f:
            start = json.load(f)["model"]
        steps = sorted(int(m.group(1)) for d in os.listdir(run) if (m := re.fullmatch(r"step_(\d+)", d)))
        if not steps:
            raise SystemExit(f"{run}: no step_N checkpoints")
        curve = {0: accuracy(start, args.data)}
        curve.update({s: accuracy(os.path.join(run, f"step_{s}"), args.data) for s in steps})
        print(json.dumps({"run": run, "accuracy": curve}), flush=True)
        ax.plot(list(curve), list(curve.values()), marker="o", label=os.path.basename(run.rstrip("/")))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"greedy accuracy, {os.path.basename(args.data)}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
