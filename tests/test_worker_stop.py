"""stop_workers on a worker that does not heed the stop event (inside vLLM's start-up, say): SIGTERM lets it
exit through Python, so the multiprocessing objects it made are released, and the run's own last line stays
its last (killed outright, the worker leaves the resource tracker a "leaked semaphore" warning to print
after it). Real spawned processes and Python's own resource tracker."""
import multiprocessing
import subprocess
import sys
import time
import types

from tools.launch import ROOT

PARENT = """
from tests.test_worker_stop import stop_a_busy_worker
stop_a_busy_worker()
"""


def busy(cfg, k, channels):
    """A worker that holds a named semaphore (registered with the resource tracker) and never looks at
    channels.stop."""
    lock = multiprocessing.get_context("spawn").Lock()  # noqa: F841 - held, never released, while it sleeps
    channels.status.put(("ready", 0.0))
    time.sleep(600)


def stop_a_busy_worker():
    from simple_grpo.generation.workers import start_workers, stop_workers
    cfg = types.SimpleNamespace(gen_workers=1, gen_device=-1, gen_memory=0.0, gen_threads=1)
    workers = start_workers(busy, cfg)
    assert workers[0][1].status.get(timeout=120) == ("ready", 0.0)
    started = time.time()
    stop_workers(workers, grace=5)
    print(f"worker exit code {workers[0][0].exitcode} after {time.time() - started:.1f} s")
    print("the run's last line")


def test_a_worker_that_ignores_the_stop_event_exits_on_sigterm_and_leaks_nothing():
    out = subprocess.run([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-3000:]
    assert lines[-1] == "the run's last line", lines[-5:]
    assert lines[-2].startswith("worker exit code 143 after "), lines[-5:]  # sys.exit(143) from the SIGTERM handler
    assert "leaked" not in out.stdout, out.stdout[-3000:]
