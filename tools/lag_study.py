"""tools/lag_study.py: issue 74's pre-registered study (docs/benchmarks.md, "What staleness costs in accuracy"):
does the full trainer lose greedy test accuracy at --max_policy_lag 2 or 4 against lag 1, with TIS on (--tis_cap 2)
and off (--tis_cap 0)?

    python tools/lag_study.py                 # all of it (hours on 2 cores); run it again to go on where it stopped
    python tools/lag_study.py --dry_run       # the commands, in order, and nothing run
    python tools/lag_study.py --analyse_only  # the registered comparisons from the runs done so far

The runs, in the registered order (seed by seed; in each, --tis_cap 2 then 0; in each, lag 1, 2, 4): `make demo`'s
setting (tools/demo.py --trainer full: the tiny world, its own reference server) with --max_policy_lag LAG --tis_cap CAP
--seed SEED --save_every 25, lag 1 for --steps_lag1 steps, lags 2 and 4 for --steps_lagk. Each run waits for a quiet
machine first (under a quarter of the cores busy over 5 s, said while it waits, 10 minutes at most; the share it
started at is kept). A run whose last checkpoint exists is not run again; an evaluation whose details file exists is
not made again.

Evaluated (evaluate.py's defaults: greedy, 64 new tokens, the 500 test problems, one details file each):
  steps   every run's step_650 checkpoint (the same number of steps);
  budget  a lag-2 or lag-4 run's last checkpoint whose summed step_s over steps 2..N is at most B, B the lag-1 run's
          (same seed and cap) summed step_s over steps 2..650 (the same wall-clock budget).
The comparisons (lag k - lag 1, paired per problem, each problem's difference averaged over the seeds, 95% normal
interval over the 500 problems), their wording (`wording`) and the secondary ones are the plan's, word for word.
Everything lands in runs/NAME/ (runs.json as the runs finish; report.json and curves.png, training accuracy against
the clock, at the end).
"""
import argparse
import json
import math
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import across_seeds, paired_gain, problem_score, read_details  # noqa: E402
from simple_grpo.run.checkpoints import checkpoint_dirs, runs_root  # noqa: E402
from tools.launch import (ROOT, TEST, TINY_WORLD_FLAGS, TRAINER_ARGS, child_env, evaluate, free_port,  # noqa: E402
                          git_commit, run_child, start_ref_server, stop)

LAGS, CAPS = (1, 2, 4), (2, 0)
MARGIN = 1.5  # points: "no loss" and "level" are read against it
SAVE_EVERY = 25
SAME_STEPS = 650  # the step every run is compared at
QUIET_SHARE, QUIET_WAIT_S = 0.25, 600  # half a core of 2: nothing else running


def run_name(args, lag, cap, seed):
    return f"{args.name}_lag{lag}_cap{cap}_seed{seed}"


def train_command(args, name, lag, cap, seed, port):
    """The full trainer's command line (after python): tools/demo.py's for the full trainer, with the study's flags."""
    steps = args.steps_lag1 if lag == 1 else args.steps_lagk
    return [*TRAINER_ARGS["full"], "--ref_url", f"http://127.0.0.1:{port}", *TINY_WORLD_FLAGS, "--run_name", name,
            "--overwrite", "--seed", str(seed), "--steps", str(steps), "--max_policy_lag", str(lag),
            "--tis_cap", str(cap), "--save_every", str(SAVE_EVERY), *args.train_args]


def busy_share(seconds=5.0):
    """The share of all cores busy over `seconds` (/proc/stat: 1 - idle and iowait time / all time)."""
    def times():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]
    total0, idle0 = times()
    time.sleep(seconds)
    total1, idle1 = times()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet_machine():
    """Waits (saying so) until less than QUIET_SHARE of the cores is busy over 5 s, QUIET_WAIT_S at most; returns
    the share it started at."""
    deadline = time.time() + QUIET_WAIT_S
    share = busy_share()
    while share >= QUIET_SHARE and time.time() < deadline:
        print(f"lag study: waiting for a quiet machine ({100 * share:.0f}% of the cores busy, the study starts a "
              f"run under {100 * QUIET_SHARE:.0f}%; {deadline - time.time():.0f} s more at most)", flush=True)
        time.sleep(25)
        share = busy_share()
    return share


def step_seconds(run_dir):
    """{step: step_s} from a run's metrics.jsonl (the trainer's wall time of each step)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["step_s"] for row in map(json.loads, f) if "step_s" in row}


def budget(seconds, upto=SAME_STEPS):
    """B: the summed step_s over steps 2..upto (step 1 holds vLLM's start-up)."""
    missing = [s for s in range(2, upto + 1) if s not in seconds]
    if missing:
        raise ValueError(f"the budget needs step_s of steps 2..{upto}; {len(missing)} missing, from step {missing[0]}")
    return sum(seconds[s] for s in range(2, upto + 1))


def budget_step(seconds, b, saved_steps):
    """(N, reached_last): the last saved step N whose summed step_s over steps 2..N is at most b; reached_last when N
    is the run's last saved step (the run may have had budget to spare). None when no saved step fits."""
    saved, total, last_fit = set(saved_steps), 0.0, None
    for n in range(2, max(saved) + 1):  # one running sum: step times are never negative
        if n not in seconds or total + seconds[n] > b:
            break
        total += seconds[n]
        last_fit = n if n in saved else last_fit
    return None if last_fit is None else (last_fit, last_fit == max(saved))


def saved_steps(run_dir):
    """The steps of a run's complete checkpoints (checkpoints.checkpoint_dirs), oldest first."""
    return [int(d.rsplit("_", 1)[1]) for d in checkpoint_dirs(run_dir)]


def evaluate_once(model, details, env, dry_run):
    if dry_run:
        print(f"  evaluate.py --model {model} --dataset {TEST} --details {details} --json")
    elif not os.path.isfile(details):
        evaluate(model, env, TEST, ["--details", details + ".part"])
        os.replace(details + ".part", details)  # a details file exists only once it is whole
    return details


def run_study(args, env):
    """Every run and evaluation the study needs that is not on disk yet; returns runs.json's dict."""
    out = os.path.join(ROOT, runs_root(), args.name)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "runs.json")
    done = {}
    if os.path.isfile(path):
        with open(path) as f:
            done = json.load(f)
    for seed in args.seeds:
        for cap in CAPS:
            for lag in LAGS:
                name = run_name(args, lag, cap, seed)
                run_dir = os.path.join(ROOT, runs_root(), name)
                steps = args.steps_lag1 if lag == 1 else args.steps_lagk
                entry = done.get(name, {"lag": lag, "cap": cap, "seed": seed, "steps": steps})
                if args.dry_run:
                    print(f"run {name}: python {' '.join(train_command(args, name, lag, cap, seed, 'PORT'))}")
                elif not os.path.isdir(os.path.join(run_dir, f"step_{steps}")):
                    entry["busy_at_start"] = round(wait_for_quiet_machine(), 3)
                    entry["commit"] = git_commit()
                    port = free_port()
                    server = start_ref_server(port, env)
                    try:
                        run_child(train_command(args, name, lag, cap, seed, port), env, f"simple_grpo.train ({name})")
                    finally:
                        stop(server)
                entry["steps_details"] = evaluate_once(os.path.join(run_dir, f"step_{SAME_STEPS}"),
                                                       os.path.join(out, f"{name}_step{SAME_STEPS}.jsonl"), env,
                                                       args.dry_run)
                if lag != 1 and not args.dry_run:
                    lag1_dir = os.path.join(ROOT, runs_root(), run_name(args, 1, cap, seed))
                    b = budget(step_seconds(lag1_dir))
                    found = budget_step(step_seconds(run_dir), b, saved_steps(run_dir))
                    if found is None:
                        raise SystemExit(f"{name}: no checkpoint within the lag-1 run's budget of {b:.1f} s")
                    n, reached_last = found
                    entry.update(budget_s=round(b, 3), budget_step=n, budget_reached_last=reached_last)
                    entry["budget_details"] = evaluate_once(os.path.join(run_dir, f"step_{n}"),
                                                            os.path.join(out, f"{name}_step{n}.jsonl"), env, False)
                done[name] = entry
                if not args.dry_run:  # what is done so far, for --analyse_only while the study goes on
                    with open(path, "w") as f:
                        json.dump(done, f, indent=1)
    return done


def wording(low, high, margin=MARGIN):
    """The registered phrases for a difference's 95% interval [low, high] in points: every one that applies."""
    phrases = []
    if low <= 0 <= high:
        phrases.append("no difference detected")
    if -margin < low and high < margin:
        phrases.append("level")
    if low > -margin:
        phrases.append("no loss")
    if high < 0:
        phrases.append("a loss")
    if low > 0:
        phrases.append("a gain")
    if low <= 0 <= high and low < -margin:
        phrases.append(f"undecided: a loss of up to {abs(low):.1f} points is not ruled out")
    return phrases


def paired_over_seeds(pairs):
    """The registered difference: pairs = [(rows of B, rows of A)], one per seed, every file on the same problems
    in the same order. d_p = the mean over seeds of [A's score on p - B's]; D = 100 x mean(d_p), its 95% interval
    D +- 1.96 x 100 x sd(d_p) / sqrt(problems)."""
    questions = [r["question"] for r in pairs[0][0]]
    for b_rows, a_rows in pairs:
        if [r["question"] for r in b_rows] != questions or [r["question"] for r in a_rows] != questions:
            raise ValueError("the evaluations are not on the same problems in the same order")
    d = [sum(problem_score(a[p]) - problem_score(b[p]) for b, a in pairs) / len(pairs) for p in range(len(questions))]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return 100 * mean, [100 * (mean - half), 100 * (mean + half)]


def compare(files_a, files_b):
    """A - B from {seed: details file} of each, over the seeds both have: the registered difference and wording,
    and beside it each seed's own paired difference and the seeds' Student-t interval."""
    seeds = sorted(set(files_a) & set(files_b))
    if not seeds:
        return {"seeds": []}
    pairs = [(read_details(files_b[s]), read_details(files_a[s])) for s in seeds]
    diff, interval = paired_over_seeds(pairs)
    per_seed = {s: paired_gain(b, a) for s, (b, a) in zip(seeds, pairs)}
    entry = {"seeds": seeds, "points": round(diff, 2), "ci95": [round(x, 2) for x in interval],
             "wording": wording(*interval),
             "per_seed": {str(s): {"points": round(100 * g["gain"], 2), "ci95": [round(100 * x, 2) for x in g["ci95"]]}
                          for s, g in per_seed.items()}}
    if len(seeds) >= 2:
        t = across_seeds([100 * g["gain"] for g in per_seed.values()])
        entry["across_seeds"] = {"points": round(t["mean"], 2), "ci95": [round(x, 2) for x in t["ci95"]]}
    return entry


def files(runs, lag, cap, key):
    return {r["seed"]: r[key] for r in runs.values() if r["lag"] == lag and r["cap"] == cap and key in r}


def analyse(runs):
    """The 8 registered comparisons (lag 2 and 4 against lag 1, each cap, at the same steps and the same budget) and
    the secondary ones (--tis_cap 2 against 0 at each lag, at the same steps), as a dict (report.json)."""
    report = {"margin_points": MARGIN, "registered": {}, "secondary": {}, "budget_steps": {}}
    for cap in CAPS:
        for lag in LAGS[1:]:
            report["registered"][f"lag {lag} - lag 1, tis_cap {cap}, same steps ({SAME_STEPS})"] = compare(
                files(runs, lag, cap, "steps_details"), files(runs, 1, cap, "steps_details"))
            # lag 1 at the same budget is its own step 650: its steps_details
            report["registered"][f"lag {lag} - lag 1, tis_cap {cap}, same budget"] = compare(
                files(runs, lag, cap, "budget_details"), files(runs, 1, cap, "steps_details"))
            report["budget_steps"][f"lag {lag}, tis_cap {cap}"] = {
                str(r["seed"]): [r["budget_step"], r["budget_reached_last"]] for r in runs.values()
                if r["lag"] == lag and r["cap"] == cap and "budget_step" in r}
    for lag in LAGS:
        report["secondary"][f"tis_cap 2 - tis_cap 0, lag {lag}, same steps ({SAME_STEPS})"] = compare(
            files(runs, lag, 2, "steps_details"), files(runs, lag, 0, "steps_details"))
    report["complete"] = all(len(e["seeds"]) == 3 for e in report["registered"].values())
    return report


def plot_curves(runs, path, window=50):
    """Training accuracy (each step's batch, a running mean over `window` steps) against the trainer's summed step_s,
    a panel per cap, a colour per lag, a line per seed: how fast each lag learns on the clock. A description
    beside the registered comparisons, with no interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(CAPS), figsize=(11, 4), sharey=True)
    for ax, cap in zip(axes, CAPS):
        for name, entry in sorted(((n, r) for n, r in runs.items() if r["cap"] == cap),
                                  key=lambda item: (item[1]["lag"], item[1]["seed"])):
            with open(os.path.join(ROOT, runs_root(), name, "metrics.jsonl")) as f:
                rows = [row for row in map(json.loads, f) if "step_s" in row]
            clock, accuracy, total = [], [], 0.0
            for i, row in enumerate(rows):
                total += row["step_s"] if row["step"] >= 2 else 0.0  # step 1 holds vLLM's start-up, as the budget
                recent = rows[max(0, i + 1 - window):i + 1]
                clock.append(total / 60)
                accuracy.append(sum(r["accuracy"] for r in recent) / len(recent))
            ax.plot(clock, accuracy, color=f"C{LAGS.index(entry['lag'])}", alpha=0.8, linewidth=1,
                    label=f"lag {entry['lag']}" if entry["seed"] == min(r["seed"] for r in runs.values()) else None)
        ax.set(title=f"--tis_cap {cap}", xlabel="trainer minutes (summed step_s, from step 2)")
        ax.legend()
    axes[0].set_ylabel(f"training accuracy, mean of {window} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(report):
    print("The registered comparisons (95% intervals in points, paired per problem; each read on its own, no "
          "correction for multiplicity):")
    for group in ("registered", "secondary"):
        if group == "secondary":
            print("Secondary (the same computation and wording):")
        for name, e in report[group].items():
            if not e["seeds"]:
                print(f"  {name:<44} no runs yet")
                continue
            t = e.get("across_seeds")
            print(f"  {name:<44} {e['points']:+6.2f} [{e['ci95'][0]:+.2f}, {e['ci95'][1]:+.2f}]  "
                  f"{'; '.join(e['wording'])}  (seeds {e['seeds']}; per seed "
                  + ", ".join(f"{p['points']:+.1f}" for p in e["per_seed"].values())
                  + (f"; across seeds {t['points']:+.2f} [{t['ci95'][0]:+.2f}, {t['ci95'][1]:+.2f}]" if t else "")
                  + ")")
    print("Budget checkpoints (step, reached its last step within the budget) by seed:",
          json.dumps(report["budget_steps"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps_lag1", type=int, default=SAME_STEPS, help="steps of each lag-1 run")
    ap.add_argument("--steps_lagk", type=int, default=700, help="steps of each lag-2 and lag-4 run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--name", default="lag_study", help="runs/NAME/ holds the study's files; its runs are runs/NAME_*")
    ap.add_argument("--dry_run", action="store_true", help="print the commands in order; run nothing")
    ap.add_argument("--analyse_only", action="store_true", help="no new run: the comparisons from the files on disk")
    ap.add_argument("train_args", nargs="*", help="extra trainer flags, after -- (not the registered study's)")
    args = ap.parse_args()
    if min(args.steps_lag1, args.steps_lagk) < SAME_STEPS or args.steps_lagk % SAVE_EVERY:
        raise SystemExit(f"--steps_lag1 and --steps_lagk: at least {SAME_STEPS} (every run is compared at step "
                         f"{SAME_STEPS}), --steps_lagk a multiple of {SAVE_EVERY} (a checkpoint at its last step)")
    if args.dry_run and args.analyse_only:
        raise SystemExit("--dry_run and --analyse_only: pick one")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = os.path.join(ROOT, runs_root(), args.name)
    if args.analyse_only:
        path = os.path.join(out, "runs.json")
        if not os.path.isfile(path):
            raise SystemExit(f"--analyse_only: {path} does not exist: no run of the study has finished yet")
        with open(path) as f:
            runs = json.load(f)
    else:
        runs = run_study(args, child_env())
        if args.dry_run:
            return
    report = analyse(runs)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_report(report)
    plot_curves(runs, os.path.join(out, "curves.png"))
    print(f"Training accuracy against the clock: {os.path.join(out, 'curves.png')}")
    print(json.dumps({"complete": report["complete"]}))


if __name__ == "__main__":
    main()
