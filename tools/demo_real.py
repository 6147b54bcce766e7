"""`make demo-real`: does GRPO make a real pretrained model, SmolLM2-135M-Instruct, better than supervised
training does, on this CPU?

    python tools/demo_real.py [--seed 1] [--steps N] [--n 500] [-- extra trainer flags]

1. fetches SmolLM2-135M-Instruct and converts it (tools/fetch_smollm2.py; once, then cached), and trains it
   on the training problems' worked solutions until dev accuracy stops rising, keeping the checkpoint with
   the best dev accuracy: "before", the best supervised start (tools/warm_start.py; cached in .cache/models/);
2. probes "before": does GRPO get a signal from it? (tools/probe.py);
3. evaluates greedily on the held-out test split the untouched model ("base") and "before";
4. trains LoRA adapters with the full trainer (simple_grpo/train.py) from "before" into runs/demo_real_seedN/ (the
   settings: tools/smollm2_recipe.py; the search for them: docs/real_model.md), and times it;
5. the control: supervised training continued from "before" (tools/warm_start.py), into
   runs/demo_real_seedN/control, for a budget fixed in steps: round(GRPO's steps x
   smollm2_recipe.CONTROL_STEPS_PER_GRPO_STEP), the supervised steps a GRPO step costs as measured once on this
   machine (1.5: 60 for GRPO's 40), so the same command trains the same control on any day and under any load;
6. evaluates both ("after": the last checkpoint GRPO saved, so --steps after -- is followed; "control");
7. prints a table, GRPO's paired gains (the same problems, with 95% intervals) against "before" and against
   the control, and one last JSON line {"base", "before", "control", "after", "gain_vs_before",
   "gain_vs_control", "grpo_minutes", "minutes", "steps", "control_steps_derivation", "commit", "start_made",
   "flags"}; beside math-verify's accuracy, each row and gain has the strict one (accuracy_strict: a plain
   integer in the <answer> tags, simple_grpo/task/rewards.py); the same report is written to
   runs/demo_real_seedN/report.json. "steps" holds the steps each arm trained (the control's as its
   warm_start.json counts them), "commit" git's HEAD (null outside git), "start_made" the start's directory,
   cache key and every flag that made it, "flags" each arm's command line.
The base's and the start's evaluations are cached in the start's directory (evals/, keyed by the model and the
evaluation flags): made once per start, not for every seed.
GRPO learns from final answers only; the supervised start and the control learn from worked solutions.

--setting answers: worked solutions for a few problems (smollm2_recipe.FEW_SOLUTIONS, 300), final answers only
for the rest, as most RL data comes. The start is supervised on the few (a linearly decaying lr, the best dev
checkpoint; cached); then, from it, on the answers-only problems, the same GRPO recipe, RAFT on the same samples
(--advantage_estimator raft: supervised training on the model's own correct answers each step), and supervised
training continued on the few solutions for the control's steps (as above); the table has base, start, GRPO, RAFT,
control and GRPO's paired gains over the start, RAFT and the control. A start whose flags would train it on more
than the few (no --train_n, or one above FEW_SOLUTIONS, or another --train) is refused: it would have seen worked
solutions of the problems GRPO and RAFT get as answers only.
The trainer is stopped at the end, on errors, on Ctrl-C and on SIGTERM.
"""
import argparse
import json
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import paired_gain, print_before_after, read_details  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402
from tools.launch import (ROOT, TEST, TRAINER_ARGS, cached_evaluate, child_env, evaluate, git_commit,  # noqa: E402
                          run_child, smollm2_warm_start, trained_checkpoint)
from tools.smollm2_recipe import (CONTROL_FLAGS, CONTROL_STEPS_PER_GRPO_STEP, EVAL_FLAGS,  # noqa: E402
                                            FEW_SOLUTIONS, FEW_START_FLAGS, SAMPLING_FLAGS, STEPS, SYSTEM_PROMPT, TRAIN,
                                            TRAIN_FLAGS, WARM_START_FLAGS, write_answers_only)

KEEP = ("accuracy", "accuracy_strict", "format_rate", "accuracy_in_format", "mean_tokens", "n")
MODELS = ("base", "before", "control", "after")


def start_flags(args, recipe):
    """tools/warm_start.py's flags for the start: --warm_start_flags, else the recipe's; --start_seed K > 0 adds
    --seed K (seed 0 adds nothing, so the default start keeps its cache key)."""
    flags = args.warm_start_flags.split() if args.warm_start_flags is not None else list(recipe)
    return flags + (["--seed", str(args.start_seed)] if args.start_seed else [])


def start_tag(args):
    return f"_start{args.start_seed}" if args.start_seed else ""


def flag_values(flags):
    """{name: value} of a command line's --name value and --name=value flags, the last of each (as argparse
    reads them); a flag with no value gets None."""
    values, i = {}, 0
    while i < len(flags):
        if flags[i].startswith("--"):
            name, eq, value = flags[i][2:].partition("=")
            if not eq and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                value, i = flags[i + 1], i + 1
            values[name] = value if (eq or value) else None
        i += 1
    return values


def check_few_solutions_start(flags):
    """--setting answers: refuses start flags that would train the start on worked solutions beyond the first
    FEW_SOLUTIONS problems of TRAIN, which GRPO and RAFT get as answers only."""
    values = flag_values(flags)
    if values.get("train", TRAIN) != TRAIN:
        raise SystemExit(f"--setting answers: the start's flags give --train {values['train']}; the setting's problems "
                         f"are {TRAIN}'s (worked solutions for its first {FEW_SOLUTIONS}): drop --train from "
                         "--warm_start_flags")
    train_n = int(values.get("train_n") or 0)
    if not 0 < train_n <= FEW_SOLUTIONS:
        given = f"--train_n {train_n}" if train_n else "no --train_n"
        raise SystemExit(f"--setting answers: the start's flags ({given}) train it on the worked solutions of "
                         f"{'all' if not train_n else train_n} training problems, answers-only problems included (the "
                         f"setting gives solutions for the first {FEW_SOLUTIONS} only): add --train_n {FEW_SOLUTIONS} "
                         "to --warm_start_flags")


def control_steps(grpo_steps):
    """The control's supervised steps beside GRPO's grpo_steps: what those GRPO steps cost in supervised steps
    (smollm2_recipe.CONTROL_STEPS_PER_GRPO_STEP, measured once), fixed in steps, not timed in this run."""
    return max(1, round(grpo_steps * CONTROL_STEPS_PER_GRPO_STEP))


def control_steps_derivation(grpo_steps):
    return (f"round({grpo_steps} GRPO steps x {CONTROL_STEPS_PER_GRPO_STEP} supervised steps a GRPO step costs "
            f"(smollm2_recipe.CONTROL_STEPS_PER_GRPO_STEP)) = {control_steps(grpo_steps)}")


def provenance(start, control, commands, trained):
    """What report.json records beside the figures, to tell one run from another: the commit; the start's
    directory, cache key and every flag that made it (its warm_start.json; under "start_made", apart from the
    start's figures under "start"); each arm's command line (commands: {arm: argv}); the steps each arm trained
    (trained: {arm: step} of the trainers, the control's counted in its warm_start.json), and how the control's
    were derived from GRPO's."""
    with open(os.path.join(ROOT, start, "warm_start.json")) as f:
        record = json.load(f)
    with open(os.path.join(ROOT, control, "warm_start.json")) as f:
        control_trained = len(json.load(f)["history"])
    def shown(arg):  # a path inside the repository, relative to it
        return os.path.relpath(arg, ROOT) if arg.startswith(ROOT + os.sep) else arg
    return {"steps": {**trained, "control": control_trained},
            "control_steps_derivation": control_steps_derivation(trained["grpo"]), "commit": git_commit(),
            "start_made": {"dir": shown(start), "key": record["key"], "recipe": record["recipe"]},
            "flags": {arm: [shown(arg) for arg in argv] for arm, argv in commands.items()}}


def gain_row(before, after):
    """paired_gain of two evaluations' details files, rounded for the JSON line; the strict integer score's
    gain beside math-verify's."""
    before, after = read_details(before), read_details(after)
    g, strict = paired_gain(before, after), paired_gain(before, after, key="strict")
    return {"accuracy": round(g["gain"], 4), "ci95": [round(x, 4) for x in g["ci95"]], "won": g["won"],
            "lost": g["lost"], "n": g["n"], "accuracy_strict": round(strict["gain"], 4),
            "ci95_strict": [round(x, 4) for x in strict["ci95"]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed of GRPO's problem draws and sampling, and of the "
                                                        "control's draws")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help="GRPO steps (and RAFT's); --steps after -- wins: the last checkpoint saved is evaluated")
    ap.add_argument("--n", type=int, default=500, help="held-out test problems evaluated (500: all)")
    ap.add_argument("--run_name", default=None,
                    help="default: demo_real_seedN (demo_answers_seedN with --setting answers; _startK before _seed "
                         "with --start_seed K)")
    ap.add_argument("--warm_start_flags", default=None,
                    help="tools/warm_start.py flags for the supervised start, as one string (default: the "
                         "recipe's, to the dev plateau); the tests give a short one")
    ap.add_argument("--start_seed", type=int, default=0,
                    help="seed of the supervised start's problem draws: another seed, another start (cached apart; "
                         "its runs are named demo_*_startK_seedN)")
    ap.add_argument("--setting", default="solutions", choices=["solutions", "answers"],
                    help="solutions: worked solutions for every training problem; answers: for a few only, final "
                         "answers for the rest (GRPO against RAFT and supervised training)")
    ap.add_argument("train_args", nargs="*", help="extra flags of the full trainer, after --")
    args = ap.parse_args()
    if args.setting == "answers":
        return answers_demo(args)
    run_name = args.run_name or f"demo_real{start_tag(args)}_seed{args.seed}"
    run_dir = os.path.join(ROOT, runs_root(), run_name)
    env = child_env()  # two busy processes on two cores: OpenMP threads sleep, not spin, while they wait
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` runs the clean-up too
    t0 = time.time()
    prompt = ["--system_prompt", SYSTEM_PROMPT]

    print("\n== 1/6 SmolLM2-135M-Instruct (fetched and converted once), and its best supervised start "
          "(cached)", flush=True)
    warm_flags = start_flags(args, WARM_START_FLAGS)
    base, before = smollm2_warm_start(env, warm_flags)
    with open(os.path.join(ROOT, before, "warm_start.json")) as f:
        best = json.load(f)["best"]
    if best:
        print(f"before = step {best['step']} of the supervised start, dev accuracy {best['accuracy']:.3f}")

    print("\n== 2/6 probe: will GRPO get a signal from it?", flush=True)
    run_child(["tools/probe.py", "--model", before, "--n", "32", *prompt, *SAMPLING_FLAGS], env, "the probe")

    print(f"\n== 3/6 evaluate the untouched model (base) and the supervised start (before) on {args.n} test "
          "problems", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    eval_args = [*prompt, *EVAL_FLAGS, "--n", str(args.n)]
    details = {name: os.path.join(run_dir, f"eval_{name}.jsonl") for name in MODELS}
    figures = {name: cached_evaluate(name, model, before, env, eval_args, details[name])
               for name, model in (("base", base), ("before", before))}

    print(f"\n== 4/6 GRPO with simple_grpo.train from before, seed {args.seed}, {args.steps} steps -> "
          f"runs/{run_name}", flush=True)
    t_grpo = time.time()
    # a group's completions every 2 steps for report.html
    commands = {"grpo": [*TRAINER_ARGS["full"], "--model", before, *prompt, *TRAIN_FLAGS, "--save_every", "1000",
                         "--log_completions_every", "2", "--run_name", run_name, "--overwrite", "--seed",
                         str(args.seed), "--steps", str(args.steps), *args.train_args]}
    run_child(commands["grpo"], env, "simple_grpo.train")
    grpo_minutes = (time.time() - t_grpo) / 60
    after, grpo_steps = trained_checkpoint(run_dir)
    run_child(["tools/view_run.py", run_dir], env, "tools/view_run.py")  # report.html

    print(f"\n== 5/6 the control: supervised training continued from before, {control_steps(grpo_steps)} steps "
          f"for GRPO's {grpo_steps} ({control_steps_derivation(grpo_steps)})", flush=True)
    control = os.path.join(run_dir, "control")
    if os.path.isdir(control):  # an earlier demo's control in this run directory, which the trainer replaced
        shutil.rmtree(control)
    # its own problem draws (seed 1000 + S), not the supervised start's again
    commands["control"] = ["tools/warm_start.py", "--model", before, "--out", control, *prompt, *CONTROL_FLAGS,
                           "--steps", str(control_steps(grpo_steps)), "--seed", str(1000 + args.seed)]
    run_child(commands["control"], env, "the supervised control")

    print("\n== 6/6 evaluate GRPO's model (after) and the control", flush=True)
    figures["after"] = evaluate(after, env, TEST, [*eval_args, "--details", details["after"]])
    figures["control"] = evaluate(control, env, TEST, [*eval_args, "--details", details["control"]])

    report = {name: {k: figures[name][k] for k in KEEP} for name in MODELS}
    report["gain_vs_before"] = gain_row(details["before"], details["after"])
    report["gain_vs_control"] = gain_row(details["control"], details["after"])
    report["grpo_minutes"] = round(grpo_minutes, 2)
    report["minutes"] = round((time.time() - t0) / 60, 2)
    commands.update(start=warm_flags, evaluation=eval_args)
    report.update(provenance(before, control, commands, {"grpo": grpo_steps}))
    print_before_after(report, MODELS, summary(report, run_name))
    write_report(report, run_dir)


ANSWERS_MODELS = ("base", "start", "control", "raft", "grpo")


def answers_demo(args):
    """--setting answers: the start from a few worked solutions, then GRPO, RAFT and supervised training."""
    warm_flags = start_flags(args, FEW_START_FLAGS)
    check_few_solutions_start(warm_flags)
    run_name = args.run_name or f"demo_answers{start_tag(args)}_seed{args.seed}"
    run_dir = os.path.join(ROOT, runs_root(), run_name)
    env = child_env()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0, prompt = time.time(), ["--system_prompt", SYSTEM_PROMPT]
    os.makedirs(run_dir, exist_ok=True)

    print(f"\n== 1/5 the data: worked solutions for the first {FEW_SOLUTIONS} training problems, final answers only "
          "for the rest", flush=True)
    answers_only = os.path.join(run_dir, "answers_only.jsonl")
    n_answers_only = write_answers_only(answers_only)

    print(f"\n== 2/5 SmolLM2-135M-Instruct and its start: supervised on the {FEW_SOLUTIONS} solutions (cached)",
          flush=True)
    base, start = smollm2_warm_start(env, warm_flags)

    print("\n== 3/5 from the start, on the answers-only problems: GRPO, then RAFT on the same recipe", flush=True)
    minutes, trained, steps, commands = {}, {}, {}, {"start": warm_flags}
    for name, extra in (("grpo", []), ("raft", ["--advantage_estimator", "raft"])):
        t = time.time()
        commands[name] = [*TRAINER_ARGS["full"], "--model", start, "--dataset", answers_only, *prompt, *TRAIN_FLAGS,
                          *extra, "--save_every", "1000", "--run_name", f"{run_name}_{name}", "--overwrite", "--seed",
                          str(args.seed), "--steps", str(args.steps), *args.train_args]
        run_child(commands[name], env, f"simple_grpo.train ({name})")
        minutes[name] = (time.time() - t) / 60
        trained[name], steps[name] = trained_checkpoint(os.path.join(ROOT, runs_root(), f"{run_name}_{name}"))

    print(f"\n== 4/5 the control: supervised training continued on the {FEW_SOLUTIONS} solutions, "
          f"{control_steps(steps['grpo'])} steps for GRPO's {steps['grpo']} ({control_steps_derivation(steps['grpo'])})"
          ", the lr falling to 0 over them", flush=True)
    control = os.path.join(run_dir, "control")
    if os.path.isdir(control):  # an earlier demo's control in this run directory
        shutil.rmtree(control)
    commands["control"] = ["tools/warm_start.py", "--model", start, "--out", control, *prompt, *CONTROL_FLAGS,
                           "--train_n", str(FEW_SOLUTIONS), "--lr_schedule", "linear", "--steps",
                           str(control_steps(steps["grpo"])), "--seed", str(1000 + args.seed)]
    run_child(commands["control"], env, "the supervised control")

    print(f"\n== 5/5 evaluate the five models on {args.n} test problems (base and start: once per start, cached)",
          flush=True)
    eval_args = [*prompt, *EVAL_FLAGS, "--n", str(args.n)]
    details = {name: os.path.join(run_dir, f"eval_{name}.jsonl") for name in ANSWERS_MODELS}
    models = {"base": base, "start": start, "control": control, **trained}
    figures = {name: (cached_evaluate(name, models[name], start, env, eval_args, details[name])
                      if name in ("base", "start") else
                      evaluate(models[name], env, TEST, [*eval_args, "--details", details[name]]))
               for name in ANSWERS_MODELS}
    report = {name: {k: figures[name][k] for k in KEEP} for name in ANSWERS_MODELS}
    for other in ("start", "raft", "control"):
        report[f"gain_vs_{other}"] = gain_row(details[other], details["grpo"])
    report["grpo_minutes"], report["raft_minutes"] = round(minutes["grpo"], 2), round(minutes["raft"], 2)
    report["minutes"] = round((time.time() - t0) / 60, 2)
    commands["evaluation"] = eval_args
    report.update(provenance(start, control, commands, steps))
    lines = [gain_line(other, report[key]) for key, other in
             (("gain_vs_start", "the start"), ("gain_vs_raft", "RAFT"), ("gain_vs_control", "the control"))]
    lines.append(f"The start and the control learned from {FEW_SOLUTIONS} worked solutions; GRPO and RAFT from the "
                 f"final answers of the other {n_answers_only}. GRPO trained {steps['grpo']} steps in "
                 f"{minutes['grpo']:.1f} minutes, RAFT {steps['raft']} in {minutes['raft']:.1f}, the control "
                 f"{report['steps']['control']} supervised steps; the demo took {report['minutes']:.1f}.")
    print_before_after(report, ANSWERS_MODELS, "\n".join(lines))
    write_report(report, run_dir)


def write_report(report, run_dir):
    """The JSON line the demo prints last, kept in the run directory too (tools/seed_table.py reads the
    evaluations beside it, and the start it names)."""
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


def gain_line(other, g):
    """One paired gain of GRPO (gain_row's figures) as a sentence, the strict integer score's beside it."""
    return (f"GRPO's gain over {other} on the same {g['n']} problems: {g['accuracy']:+.3f}, 95% interval "
            f"[{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}] (won {g['won']}, lost {g['lost']}); strict "
            f"(a plain integer answer) {g['accuracy_strict']:+.3f} [{g['ci95_strict'][0]:+.3f}, "
            f"{g['ci95_strict'][1]:+.3f}]")


def summary(report, run_name):
    """The lines under the table: GRPO's paired gains, what each side learned from, the steps and minutes."""
    steps = report["steps"]
    lines = [gain_line(other, report[key]) for key, other in
             (("gain_vs_before", "before (the best supervised start)"),
              ("gain_vs_control", f"the control ({steps['control']} supervised steps more)"))]
    lines.append(f"GRPO learned from final answers only; the supervised start and the control from worked "
                 f"solutions. GRPO trained {steps['grpo']} steps in {report['grpo_minutes']:.1f} minutes, the control "
                 f"{steps['control']} supervised steps ({report['control_steps_derivation']}); the demo took "
                 f"{report['minutes']:.1f}. Curves: runs/{run_name}/curves.png, report: runs/{run_name}/report.html")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
