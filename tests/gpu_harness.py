"""How tests/test_gpu.py runs a script and reads its result; apart from it so that a CPU checks them
(tests/test_gpu_harness.py), since tests/test_gpu.py skips whole where CUDA is absent.

A script's result is the JSON object it prints on stdout. Other lines may follow it: on CUDA, torch warns
at exit when a process group was never destroyed. So stdout and stderr are read apart, and the result is
the last stdout line that parses as a JSON object, not simply the last line.
"""
import json
import subprocess
import sys

from tools.launch import ROOT


def run_script(args, env=None, timeout=900):
    """python ARGS in the repository, to its end: the CompletedProcess, stdout and stderr apart."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def json_result(stdout):
    """The JSON object a script printed as its result: the last line of stdout that parses as one."""
    for line in reversed(stdout.splitlines()):
        try:
            found = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict):
            return found
    raise ValueError(f"no line of stdout is a JSON object; stdout ends with:\n{stdout[-2000:]}")


def check_clean_exit(done):
    """The script exited 0, and tore down what it set up: torch did not warn about a process group left."""
    tail = f"exit code {done.returncode}\nstdout ends:\n{done.stdout[-2000:]}\nstderr ends:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, tail
    assert "destroy_process_group" not in done.stderr, tail
