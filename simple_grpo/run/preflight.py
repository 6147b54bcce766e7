"""--preflight: before a trainer loads anything, ask tools/probe.py whether GRPO will get a signal."""
import json
import os
import subprocess
import sys


def preflight(cfg):
    """--preflight: tools/probe.py on the first preflight_n problems, in a process of its own (its vLLM
    engine and memory go when it ends). Stops here when no group would have any reward variance."""
    flags = ["model", "dataset", "dataset_config", "split", "question_field", "answer_field", "prompt_format",
             "num_generations", "max_new_tokens", "temperature", "dtype", "seed", "reward_funcs", "reward_weights",
             "reward_file"]
    args = [f"--{flag}={getattr(cfg, flag)}" for flag in flags] + [f"--n={cfg.preflight_n}"]
    print(f"pre-flight: probing {cfg.preflight_n} problems x {cfg.num_generations} completions (tools/probe.py)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    probe = os.path.join(root, "tools", "probe.py")
    out = subprocess.run([sys.executable, probe, *args], stdout=subprocess.PIPE, text=True)
    print(out.stdout, end="")
    if out.returncode != 0:
        raise SystemExit(f"pre-flight probe failed with exit code {out.returncode} (its output is above)")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["zero_var_frac"] >= 1.0:
        raise SystemExit(f"pre-flight: {result['verdict']}. Not training (run without --preflight to train anyway)")
