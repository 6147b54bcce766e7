"""--preflight: before a trainer loads anything, the probe (probe.py) says whether GRPO will get a signal."""
import contextlib
import dataclasses
import multiprocessing
import os
import signal

from simple_grpo.task.problems import TaskConfig


def preflight(cfg):
    """--preflight: the probe on the first preflight_n problems, in a process of its own (its vLLM engine and
    memory go when it ends). Stops here when no group would have any reward variance, and when the probe has
    not finished in preflight_timeout seconds (it is ended, with any process it started)."""
    # the problems, prompts, rewards and sampling exactly as the trainer resolved them, and its dtype
    flags = {field.name: getattr(cfg, field.name) for field in dataclasses.fields(TaskConfig)} | {"dtype": cfg.dtype}
    print(f"pre-flight: probing {cfg.preflight_n} problems x {cfg.num_generations} completions "
          "(simple_grpo/run/probe.py)", flush=True)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the trainer's is in it
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=probe_in_own_group, args=(flags, cfg.preflight_n, send))
    process.start()
    send.close()  # the child holds its own end: a child that dies closes the pipe
    try:
        process.join(timeout=cfg.preflight_timeout)
        if process.is_alive():
            raise SystemExit(f"pre-flight: the probe did not finish in {cfg.preflight_timeout:.0f} s "
                             f"(--preflight_timeout): it starts vLLM on {cfg.model} and samples {cfg.preflight_n} "
                             f"problems x {cfg.num_generations} completions. Raise --preflight_timeout, lower "
                             "--preflight_n, or run without --preflight; its output so far is above")
    finally:
        end_group(process)  # on Ctrl-C too, and whatever a finished probe left running
    if process.exitcode != 0 or not receive.poll():
        raise SystemExit(f"pre-flight probe failed with exit code {process.exitcode} (its output is above)")
    result = receive.recv()
    if result["zero_var_frac"] >= 1.0:
        raise SystemExit(f"pre-flight: {result['verdict']}. Not training (run without --preflight to train anyway)")


def probe_in_own_group(flags, n, send):
    """The probe's process: a process group of its own first (so that end_group ends vLLM's processes too),
    then the probe, whose result goes back through `send`. Its report goes to the trainer's stdout."""
    os.setsid()
    from simple_grpo.run.probe import ProbeConfig, probe  # here: the trainer's process never imports vLLM for it
    send.send(probe(ProbeConfig(**flags, n=n)))


def end_group(process):
    """Kill a process that made itself a group's leader (os.setsid) and every process it started (its group);
    one killed before it did is killed alone (it had started nothing yet)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.kill()
    process.join()
