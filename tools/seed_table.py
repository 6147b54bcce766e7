"""The seeds of a demo in one table: each model's test accuracy per seed and its mean with the 95% interval
across seeds, then one model's paired gains over the others, per seed (with the per-problem interval) and
across seeds.

    python tools/seed_table.py runs/demo_answers_seed0 runs/demo_answers_seed1 runs/demo_answers_seed2

Each directory holds a demo's evaluations, eval_NAME.jsonl (tools/demo_real.py writes them; the same test
problems in each), and its report.json, whose "start" names the supervised start the seed ran from: directories
from different starts are refused (a table across seeds holds one start). Accuracy is the mean over every
completion of every problem, a gain the mean of the per-problem differences (simple_grpo/evaluation.py).
--model names the one whose gains are shown, --against the models it is compared with. Prints markdown (a table
of accuracies, a table of gains), then the whole as one JSON line. The interval across seeds (across_seeds:
Student's t with seeds - 1 degrees of freedom) is the one to read for "does it hold from seed to seed"; the
per-problem one only says how sure one seed's figure is on these problems.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import across_seeds, details_accuracy, paired_gain, read_details  # noqa: E402


def one_start(run_dirs):
    """The start every run directory's report.json names (its cache key); refuses directories from different
    starts, or a report that names none, naming them."""
    starts = {}
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "report.json")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} not found: each directory needs the demo's report.json, which names its start")
        with open(path) as f:
            start = json.load(f).get("start_made")
        if not start:
            raise SystemExit(f"{path} names no start (a demo from before report.json recorded it): run the seed again "
                             "to compare it with the others")
        starts[run_dir] = start
    if len({s["key"] for s in starts.values()}) > 1:
        raise SystemExit("these directories come from different starts; a table across seeds needs one start:\n"
                         + "\n".join(f"  {d}: {s['dir']} (key {s['key']})" for d, s in starts.items()))
    return next(iter(starts.values()))


def interval(figure):
    return f"{figure['mean']:.3f} [{figure['ci95'][0]:.3f}, {figure['ci95'][1]:.3f}]"


def signed(figure):
    return f"{100 * figure['mean']:+.1f} [{100 * figure['ci95'][0]:+.1f}, {100 * figure['ci95'][1]:+.1f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", help="one demo run directory per seed (2 or more)")
    ap.add_argument("--models", default="base,start,control,raft,grpo", help="the rows, in order")
    ap.add_argument("--model", default="grpo", help="the model whose paired gains are shown")
    ap.add_argument("--against", default="start,raft,control", help="the models it is compared with")
    args = ap.parse_args()
    if len(args.run_dirs) < 2:
        raise SystemExit("give 2 or more run directories: an interval across seeds needs 2 seeds at least")
    models, against = args.models.split(","), args.against.split(",")
    start = one_start(args.run_dirs)
    evals = {}
    for run_dir in args.run_dirs:
        for name in dict.fromkeys([*models, args.model, *against]):  # each once, in order
            path = os.path.join(run_dir, f"eval_{name}.jsonl")
            if not os.path.isfile(path):
                raise SystemExit(f"{path} not found: each directory needs eval_NAME.jsonl for every model named")
            evals[run_dir, name] = read_details(path)
    seeds = [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]

    report = {"runs": seeds, "start": start, "accuracy": {}, "gains": {}}
    print("| model | " + " | ".join(seeds) + " | mean [95% across seeds] | strict integer, mean |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for name in models:
        acc = [details_accuracy(evals[d, name], "correctness") for d in args.run_dirs]
        strict = [details_accuracy(evals[d, name], "strict") for d in args.run_dirs]
        figure, strict_figure = across_seeds(acc), across_seeds(strict)
        report["accuracy"][name] = {"per_seed": acc, **figure, "strict_per_seed": strict,
                                    "strict_mean": strict_figure["mean"], "strict_ci95": strict_figure["ci95"]}
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in acc) + f" | {interval(figure)} | "
              f"{interval(strict_figure)} |")

    print(f"\n| {args.model} minus, points | " + " | ".join(f"{s} [95% per problem] (won / lost)" for s in seeds)
          + " | mean [95% across seeds] | strict integer, mean |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for other in against:
        per_seed = [paired_gain(evals[d, other], evals[d, args.model]) for d in args.run_dirs]
        strict = [paired_gain(evals[d, other], evals[d, args.model], key="strict")["gain"] for d in args.run_dirs]
        figure, strict_figure = across_seeds([g["gain"] for g in per_seed]), across_seeds(strict)
        report["gains"][other] = {"per_seed": per_seed, **figure, "strict_mean": strict_figure["mean"],
                                  "strict_ci95": strict_figure["ci95"]}
        cells = [f"{100 * g['gain']:+.1f} [{100 * g['ci95'][0]:+.1f}, {100 * g['ci95'][1]:+.1f}] "
                 f"({g['won']} / {g['lost']})" for g in per_seed]
        print(f"| {other} | " + " | ".join(cells) + f" | **{signed(figure)}** | {signed(strict_figure)} |")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
