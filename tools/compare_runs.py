"""Do two runs log the same figures? Compares two runs' metrics.jsonl step by step, timings left out.

    python tools/compare_runs.py runs/demo_vllm_seed0 /elsewhere/runs/demo_vllm_seed0

For a change that should alter no number (a refactor, a move): run the same seed before and after, then
compare. Timings (keys ending in _s) and rates (_per_s) are left out, and so is a count that depends on
timing: how many completions the vLLM trainers' worker had generated when a step was logged ("generated"). The
first run's figures are compared: a figure only the second run logs (a new diagnostic) is listed, not compared; one the
second run lost differs. Prints, per key, the steps compared and the first difference; the last line is JSON
{"same": bool, "steps": n, ...}.
Exits 1 when a figure differs or the runs logged different steps.
"""
import argparse
import json
import math
import os
import sys

TIMING_DEPENDENT = {"generated"}  # the vLLM trainers: the worker's running count when the trainer logs a step


def read_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: pass a run directory (runs/NAME)")
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return {row["step"]: row for row in rows if "warning" not in row}


def compared(key):
    return not key.endswith("_s") and key not in TIMING_DEPENDENT  # _per_s ends in _s too


def differs(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)))
    return a != b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    args = ap.parse_args()
    a, b = read_steps(args.run_a), read_steps(args.run_b)
    if sorted(a) != sorted(b):
        print(f"the runs logged different steps: {len(a)} in {args.run_a}, {len(b)} in {args.run_b}")
    steps = sorted(set(a) & set(b))
    keys_a = {k for s in steps for k in a[s] if compared(k)}
    keys_b = {k for s in steps for k in b[s] if compared(k)}
    added, lost = sorted(keys_b - keys_a), sorted(keys_a - keys_b)
    if added:  # a figure the second run logs and the first did not: a new diagnostic, nothing to compare it with
        print(f"logged only by {args.run_b} (not compared): {', '.join(added)}")
    keys = sorted(keys_a)  # a figure the second run lost differs at every step
    first_difference, differing = None, {}
    for key in keys:
        diffs = [(s, a[s].get(key), b[s].get(key)) for s in steps if differs(a[s].get(key), b[s].get(key))]
        if diffs:
            differing[key] = {"steps": len(diffs), "first_step": diffs[0][0], "first": diffs[0][1:]}
            first_difference = min(first_difference or diffs[0][0], diffs[0][0])
        print(f"{key:<28}{len(steps) - len(diffs):>5}/{len(steps)} steps equal"
              + (f"; first differs at step {diffs[0][0]}: {diffs[0][1]} vs {diffs[0][2]}" if diffs else ""))
    same = not differing and sorted(a) == sorted(b)
    print(json.dumps({"same": same, "steps": len(steps), "keys": len(keys), "differing_keys": sorted(differing),
                      "first_differing_step": first_difference, "added_keys": added, "lost_keys": lost}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
