"""--preflight: before a trainer loads anything, ask tools/probe.py whether GRPO will get a signal."""
import contextlib
import json
import os
import signal
import subprocess
import sys


def preflight(cfg):
    """--preflight: tools/probe.py on the first preflight_n problems, in a process of its own (its vLLM
    engine and memory go when it ends). Stops here when no group would have any reward variance, and
    when the probe has not finished in preflight_timeout seconds (it is ended, with any process it started)."""
    flags = ["model", "dataset", "dataset_config", "split", "question_field", "answer_field", "prompt_format",
             "num_generations", "max_new_tokens", "temperature", "dtype", "seed", "reward_funcs", "reward_weights",
             "reward_file"]
    args = [f"--{flag}={getattr(cfg, flag)}" for flag in flags] + [f"--n={cfg.preflight_n}"]
    print(f"pre-flight: probing {cfg.preflight_n} problems x {cfg.num_generations} completions (tools/probe.py)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    probe = subprocess.Popen([sys.executable, os.path.join(root, "tools", "probe.py"), *args], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # a process group of its own, to end it whole
    try:
        stdout, _ = probe.communicate(timeout=cfg.preflight_timeout)
    except subprocess.TimeoutExpired:
        end_group(probe)
        print(probe.communicate()[0], end="")
        raise SystemExit(f"pre-flight: tools/probe.py did not finish in {cfg.preflight_timeout:.0f} s "
                         f"(--preflight_timeout): it starts vLLM on {cfg.model} and samples {cfg.preflight_n} "
                         f"problems x {cfg.num_generations} completions. Raise --preflight_timeout, lower "
                         "--preflight_n, or run without --preflight; its output so far is above") from None
    finally:
        end_group(probe)  # on Ctrl-C too, and whatever a finished probe left running
    print(stdout, end="")
    if probe.returncode != 0:
        raise SystemExit(f"pre-flight probe failed with exit code {probe.returncode} (its output is above)")
    result = json.loads(stdout.strip().splitlines()[-1])
    if result["zero_var_frac"] >= 1.0:
        raise SystemExit(f"pre-flight: {result['verdict']}. Not training (run without --preflight to train anyway)")


def end_group(process):
    """Kill a process started with start_new_session=True and every process it started (its group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
