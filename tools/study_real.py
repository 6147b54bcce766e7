"""tools/study_real.py: issue 50's pre-registered study (docs/real_model.md): GRPO, RAFT and Reinforce-Rej on
answers-only problems, SmolLM2-135M-Instruct, two starts x three seeds, and the verdict decided before it ran.

    python tools/study_real.py                 # all of it: ~7 hours on 2 cores; run it again to continue
    python tools/study_real.py --dry_run       # the commands, in order, and nothing run
    python tools/study_real.py --analyse_only  # the table, verdict and plot from the runs done so far

For each start (tools/warm_start.py on the first 300 worked solutions, --start_seed 0 and 1, cached), each seed
and each arm, simple_grpo.train trains --steps steps (80) on the other 19,700 problems' final answers with the
recipe (tools/smollm2_recipe.py) on the correctness reward alone, saving step --steps/2 and --steps;
both and the start are evaluated greedily on the 500 test problems, and step --steps and the start by pass@k
(8 samples at the training temperature on the first 200). A run, an evaluation, a start whose files exist is not
done again: the study goes on where it stopped. Everything lands in runs/study50/ (runs/study50/report.json at the end).

The verdict (pre-registered): D = GRPO - RAFT at step --steps, greedy, in points, one per run; the mean of the
runs' D with its 90% interval across runs (Student's t); "equivalent" inside +-3 points, "GRPO ahead" above 0,
"RAFT ahead" below 0, else "undecided". pass@k (k = 1..8, step --steps and the starts) is compared as registered:
paired per problem within each run, then the runs' mean with the same 90% interval; the plot's curves are pooled
means, a description with no interval. The arms:
  grpo           --advantage_estimator grpo --scale_rewards group
  raft           --advantage_estimator raft (the correct completions, advantage 1)
  reinforce_rej  --advantage_estimator grpo --scale_rewards none (r - mean(r); all-alike groups dropped)
"""
import argparse
import functools
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import (details_accuracy, equivalence_verdict, interval_across,  # noqa: E402
                                    pass_at_k, pass_at_k_curve, read_details)
from tools.launch import ROOT, TRAINER_ARGS, cached_evaluate, child_env, run_child, smollm2_warm_start  # noqa: E402
from tools.smollm2_recipe import (EVAL_FLAGS, FEW_START_FLAGS, SYSTEM_PROMPT, TRAIN_FLAGS,  # noqa: E402
                                            write_answers_only)
from simple_grpo.task.problems import TaskConfig  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402

ARMS = {"grpo": ["--advantage_estimator", "grpo", "--scale_rewards", "group"],
        "raft": ["--advantage_estimator", "raft"],
        "reinforce_rej": ["--advantage_estimator", "grpo", "--scale_rewards", "none"]}
CORRECTNESS_ONLY = ["--reward_funcs", "correctness", "--reward_weights", "1.0"]  # RAFT selects on it alone too
MARGIN, COVERAGE = 3.0, 0.90  # points; the interval across runs
PASSK_SAMPLES = 8


def study_dir(args):
    return os.path.join(ROOT, runs_root(), args.name)


def start_of(start_seed, env, dry_run):
    """(base, start) directories: the supervised start on the 300 solutions for this start seed (cached)."""
    flags = FEW_START_FLAGS + (["--seed", str(start_seed)] if start_seed else [])
    if dry_run:
        print(f"start {start_seed}: tools/warm_start.py {' '.join(flags)}  (cached after the first time)")
        return "BASE", f"START{start_seed}"
    return smollm2_warm_start(env, flags)


def train_command(args, start, answers_only, start_seed, seed, arm):
    """The full trainer's command line (after python) for one arm of one run: the recipe, the correctness reward
    alone, the arm."""
    name = f"{args.name}_start{start_seed}_seed{seed}_{arm}"
    return name, [*TRAINER_ARGS["full"], "--model", start, "--dataset", answers_only, "--system_prompt", SYSTEM_PROMPT,
                  *TRAIN_FLAGS, *CORRECTNESS_ONLY, *ARMS[arm], "--steps", str(args.steps),
                  "--save_every", str(args.steps // 2), "--log_completions_every", "0", "--seed", str(seed),
                  "--run_name", name, "--overwrite"]


def greedy_args(args):
    return ["--system_prompt", SYSTEM_PROMPT, *EVAL_FLAGS, "--n", str(args.n)]


def passk_args(args):
    return ["--system_prompt", SYSTEM_PROMPT, *EVAL_FLAGS, "--n", str(args.passk_n), "--samples", str(PASSK_SAMPLES),
            "--temperature", str(TaskConfig().temperature)]


def evaluate_once(name, model, where, env, eval_args, dry_run):
    """cached_evaluate into where/evals/; the details file's path (where/NAME.jsonl)."""
    details = os.path.join(where, f"{name}.jsonl")
    if dry_run:
        print(f"  evaluate {name}: evaluate.py --model {model} {' '.join(eval_args)}")
    elif not os.path.isfile(details):
        cached_evaluate(name, model, where, env, eval_args, details)
    return details


def run_study(args, env):
    """Every start, run and evaluation the study needs that is not on disk yet; returns {run: details files}."""
    out = study_dir(args)
    os.makedirs(out, exist_ok=True)
    answers_only = os.path.join(out, "answers_only.jsonl")
    write_answers_only(answers_only)
    done = {}
    for start_seed in args.starts:
        _, start = start_of(start_seed, env, args.dry_run)
        where = os.path.join(out, f"start{start_seed}")
        os.makedirs(where, exist_ok=True)
        done[f"start{start_seed}"] = {
            "greedy": evaluate_once("greedy", start, where, env, greedy_args(args), args.dry_run),
            "passk": evaluate_once("passk", start, where, env, passk_args(args), args.dry_run)}
        for seed in args.seeds:
            for arm in ARMS:
                name, cmd = train_command(args, start, answers_only, start_seed, seed, arm)
                run_dir = os.path.join(ROOT, runs_root(), name)
                last = os.path.join(run_dir, f"step_{args.steps}")
                if args.dry_run:
                    print(f"run {name}: {' '.join(cmd)}")
                elif not os.path.isdir(last):
                    run_child(cmd, env, f"simple_grpo.train ({name})")
                half = os.path.join(run_dir, f"step_{args.steps // 2}")
                done[name] = {"start": f"start{start_seed}", "seed": seed, "arm": arm,
                              "greedy_half": evaluate_once("greedy_half", half, run_dir, env, greedy_args(args),
                                                           args.dry_run),
                              "greedy": evaluate_once("greedy", last, run_dir, env, greedy_args(args), args.dry_run),
                              "passk": evaluate_once("passk", last, run_dir, env, passk_args(args), args.dry_run)}
                if not args.dry_run:  # what is done so far, for --analyse_only while the study goes on
                    with open(os.path.join(out, "runs.json"), "w") as f:
                        json.dump(done, f, indent=1)
    return done


@functools.lru_cache(maxsize=None)
def details(path):
    """A details file's rows, read once: the analysis asks for a start's or a run's file in several pairs."""
    return read_details(path)


def accuracy(path):
    return details_accuracy(details(path))


def files_by_run(runs, key="greedy"):
    """[{model: details file}], one per (start, seed) in order: the run's arms at the evaluation `key` names
    (greedy, greedy_half or passk) and, as "start", its own start's evaluation of the same kind (greedy for
    greedy_half)."""
    start_key = "passk" if key == "passk" else "greedy"
    starts = {name: r[start_key] for name, r in runs.items() if "arm" not in r and start_key in r}
    pairs = {}
    for r in runs.values():
        if "arm" in r:
            files = pairs.setdefault((r["start"], r["seed"]), {})
            files[r["arm"]] = r[key]
            if r["start"] in starts:
                files["start"] = starts[r["start"]]
    return [files for _, files in sorted(pairs.items())]


def difference(runs, a, b, key="greedy"):
    """Arm a - arm b in points, one per (start, seed): the same problems, so each run's difference is paired.
    b = "start" is the run's own start (its greedy evaluation, whichever checkpoint `key` names for the arm)."""
    return [100 * (accuracy(f[a]) - accuracy(f[b])) for f in files_by_run(runs, key) if a in f and b in f]


def paired_pass_at_k(rows_a, rows_b, key="correctness"):
    """{k: pass@k of a - pass@k of b, in points} for k = 1 .. the samples per problem: the difference problem by
    problem (the same problems in the same order, each sampled as often in both), then its mean over problems."""
    if [r["question"] for r in rows_a] != [r["question"] for r in rows_b]:
        raise ValueError("pass@k paired per problem needs two evaluations of the same problems in the same order")
    n = {len(r["scores"]) for r in rows_a + rows_b}
    if len(n) != 1:
        raise ValueError(f"pass@k paired per problem needs the same number of samples per problem, got {sorted(n)}")
    n = n.pop()
    def correct(row):
        return sum(bool(s[key]) for s in row["scores"])
    return {k: 100 * sum(pass_at_k(n, correct(a), k) - pass_at_k(n, correct(b), k)
                         for a, b in zip(rows_a, rows_b)) / len(rows_a)
            for k in range(1, n + 1)}


def pass_at_k_difference(runs, a, b):
    """Model a - model b in pass@k points at step --steps, one curve {k: points} per (start, seed): the
    pre-registered pass@k measure, paired per problem within each run (paired_pass_at_k)."""
    return [paired_pass_at_k(details(f[a]), details(f[b])) for f in files_by_run(runs, "passk") if a in f and b in f]


def across_runs(diffs, names=None):
    """One comparison's per-run differences a - b, with their mean and COVERAGE interval across runs (Student's
    t) where there are 2 runs or more; names=(a, b): and the pre-registered rule's verdict on that interval."""
    entry = {"runs": len(diffs), "per_run": [round(d, 2) for d in diffs]}
    if len(diffs) >= 2:
        mean, low, high = interval_across(diffs, COVERAGE)
        entry.update(mean=round(mean, 2), interval=[round(low, 2), round(high, 2)])
        if names:
            entry["verdict"] = equivalence_verdict(low, high, MARGIN).replace("A ahead", f"{names[0]} ahead") \
                .replace("B ahead", f"{names[1]} ahead")
    return entry


def entries_of(runs, label):
    """runs.json's entries of one model: an arm's runs, or (label "start") the starts."""
    return [r for r in runs.values() if (r.get("arm") == label if label in ARMS else "arm" not in r)]


def analyse(runs, args):
    """The pre-registered verdict and the secondary figures, as a dict (report.json), and the pass@k plot."""
    report = {"steps": args.steps, "margin_points": MARGIN, "coverage": COVERAGE, "comparisons": {},
              "pass_at_k_paired": {}}
    pairs = (("grpo", "raft"), ("reinforce_rej", "raft"), ("grpo", "reinforce_rej"), *((arm, "start") for arm in ARMS))
    for a, b in pairs:
        for key in ("greedy", "greedy_half"):
            report["comparisons"][f"{a} - {b} ({key})"] = across_runs(difference(runs, a, b, key), names=(a, b))
        curves = pass_at_k_difference(runs, a, b)  # the registered pass@k analysis: one paired curve per run
        if curves:
            report["pass_at_k_paired"][f"{a} - {b}"] = {str(k): across_runs([c[k] for c in curves]) for k in curves[0]}
    report["accuracy"] = {}  # each model's greedy accuracy, the mean over its runs (the starts': over the starts)
    for label in ("start", *ARMS):
        for key in ("greedy", "greedy_half") if label in ARMS else ("greedy",):
            files = [r[key] for r in entries_of(runs, label) if key in r]
            if files:
                report["accuracy"][f"{label} ({key})"] = round(sum(map(accuracy, files)) / len(files), 4)
    primary = report["comparisons"]["grpo - raft (greedy)"]
    report["verdict"] = primary.get("verdict", "undecided: fewer than 2 runs")
    report["complete"] = primary["runs"] == len(args.starts) * len(args.seeds)
    curves = {}  # pooled: each model's mean curve over its runs, a description with no interval (the plot)
    for label in ("start", *ARMS):
        per_file = [pass_at_k_curve(details(r["passk"])) for r in entries_of(runs, label)]
        if per_file:
            curves[label] = {k: sum(c[k] for c in per_file) / len(per_file) for k in per_file[0]}
    report["pass_at_k"] = {label: {str(k): round(v, 4) for k, v in c.items()} for label, c in curves.items()}
    plot_pass_at_k(curves, os.path.join(study_dir(args), "pass_at_k.png"))
    return report


def plot_pass_at_k(curves, path):
    """pass@k against k, one line per model, pooled over the runs: single-sample accuracy (k = 1) against what
    k samples reach."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=label)
    ax.set(xlabel="k (samples per problem)", ylabel="pass@k", title="pass@k, pooled over runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80, help="steps per run; --steps/2 is evaluated too (even number)")
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 1], help="start seeds (tools/warm_start.py --seed)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds of each start")
    ap.add_argument("--n", type=int, default=500, help="test problems for greedy accuracy")
    ap.add_argument("--passk_n", type=int, default=200, help="test problems for pass@k (8 samples each)")
    ap.add_argument("--name", default="study50", help="runs/NAME/ holds the study; its runs are runs/NAME_*")
    ap.add_argument("--dry_run", action="store_true", help="print the commands in order; run nothing")
    ap.add_argument("--analyse_only", action="store_true", help="no new run: the table from the runs on disk")
    args = ap.parse_args()
    if args.steps < 2 or args.steps % 2:
        raise SystemExit(f"--steps {args.steps}: the study evaluates step --steps/2 too; give an even number >= 2")
    if args.dry_run and args.analyse_only:
        raise SystemExit("--dry_run and --analyse_only: pick one")
    env = child_env()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.analyse_only:
        path = os.path.join(study_dir(args), "runs.json")
        if not os.path.isfile(path):
            raise SystemExit(f"--analyse_only: {path} does not exist: no run of the study has finished yet")
        with open(path) as f:
            runs = json.load(f)
    else:
        runs = run_study(args, env)
        if args.dry_run:
            return
    report = analyse(runs, args)
    with open(os.path.join(study_dir(args), "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    for name, entry in report["comparisons"].items():
        shown = f"{entry['mean']:+.1f} [{entry['interval'][0]:+.1f}, {entry['interval'][1]:+.1f}]" if "mean" in entry \
            else "-"
        print(f"{name:<36} {shown:<22} {entry.get('verdict', '')}  per run {entry['per_run']}")
    for name, value in report["accuracy"].items():
        print(f"{name:<36} {value:.3f}  (greedy accuracy, mean over its runs)")
    for label, curve in report["pass_at_k"].items():
        print(f"pass@k {label:<29} " + " ".join(f"{k}:{v:.3f}" for k, v in curve.items()) + "  (pooled mean)")
    for name, by_k in report["pass_at_k_paired"].items():  # the registered analysis, k by k
        for k, entry in by_k.items():
            shown = f"{entry['mean']:+.1f} [{entry['interval'][0]:+.1f}, {entry['interval'][1]:+.1f}]" \
                if "mean" in entry else "-"
            print(f"pass@{k} {name:<29} {shown:<22} points, paired per problem; per run {entry['per_run']}")
    print(json.dumps({"verdict": report["verdict"], "complete": report["complete"]}))


if __name__ == "__main__":
    main()
