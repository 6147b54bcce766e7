"""tools/reading_path.py: the lesson's reading path, counted whole: what a student reads to follow one default step of
`make demo`, grpo_vllm_one.py (or of grpo_train.py: --trainer grpo_train).

    python tools/reading_path.py            # the count, from the record and the code as it is now (a second)
    python tools/reading_path.py --record   # trace the step again and rewrite the record (~2 minutes on a CPU;
                                            # after a change to which functions a step runs)

The step is make demo's (tools/demo.py): ref_server.py started as the demo starts it, then the trainer against it
with the demo's flags and --steps 2 (grpo_vllm_one.py: its first step sends vLLM new weights, as every step but the
last does) or 1 (grpo_train.py). Each process runs under a tracer (sys.settrace and threading.settrace) that notes
each function of the project's files it enters; a process the traced one starts with multiprocessing (the
generation process: a spawned interpreter) traces itself into a record of its own (trace_call). The records:
tools/reading_path_vllm_one.json, tools/reading_path.json (grpo_train.py's).

The count, file by file: every line of the trainer's file; in each other file of the project the step runs
(grpo_math.py, ref_server.py), each function entered, whole (first decorator to last line: docstring and comments
too), and the code that ran on import (docstring, imports, constants, class bodies, `if __name__`). Characters as
`wc -c` counts them, each line's newline included. tests/test_reading_path.py holds the lesson's count to issue
73's budget (BUDGET), and a slow test traces the step again and compares.
"""
import argparse
import ast
import contextlib
import functools
import glob
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # as `python script.py` has it for the scripts traced; tools.launch for this one
TRAINERS = {  # the trainer's file, its record, the steps traced
    "grpo_vllm_one": ("grpo_vllm_one.py", os.path.join(ROOT, "tools", "reading_path_vllm_one.json"), 2),
    "grpo_train": ("grpo_train.py", os.path.join(ROOT, "tools", "reading_path.json"), 1)}
# issue 73's budget for the lesson's path (simple_GRPO's: 350 lines, 15,828 characters, 2 files)
BUDGET = {"lines": 800, "characters": 55_000, "files": 3}
RUN_NAME = "reading_path_trace"


# ------------------------------------------------------------------------------ tracing a process
@contextlib.contextmanager
def tracing(out):
    """Trace every thread while the block runs, and write what it entered to out when it ends (normally, by an
    exception or SystemExit): {"entered": [{"file", "name"}]}, each function of the project's files once."""
    codes = set()

    def tracer(frame, event, arg):
        if frame.f_code not in codes and ours(frame.f_code.co_filename):
            codes.add(frame.f_code)
        return None  # no line events: the calls are all we need

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        entered = {(relative(code.co_filename), code.co_qualname) for code in codes}
        with open(out, "w") as f:
            json.dump({"entered": [{"file": file, "name": name} for file, name in sorted(entered)]}, f)


def trace_script(out, script, args):
    """Run script with args as `python script args` would, traced into out. A process it starts with multiprocessing
    runs trace_call instead of its target: traced too, into out's name with the process's."""
    from multiprocessing.process import BaseProcess
    from tools.reading_path import trace_call  # by its module's name: the child imports it from there
    start = BaseProcess.start

    def start_traced(process):
        out_child = f"{out[:-len('.json')]}.{process.name}.json"
        process._target, process._args = trace_call, (out_child, process._target, *process._args)
        start(process)

    BaseProcess.start = start_traced
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = [script, *args]
    with tracing(out):
        runpy.run_path(script, run_name="__main__")


def trace_call(out, target, *args):
    """In a process started by a traced one (the generation process): target(*args), traced into out. The modules
    the child imported before (its parent's script as __mp_main__, with its imports) ran untraced; the parent's
    trace has their module-level code. A daemon process, ended by SIGTERM as its parent exits, writes its record too."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with tracing(out):
        target(*args)


@functools.lru_cache(maxsize=None)
def ours(filename):
    """Whether filename is one of the project's own files (not the virtual environment's, not this tool)."""
    path = os.path.abspath(filename)
    return (path.startswith(ROOT + os.sep) and path.endswith(".py") and os.sep + ".venv" + os.sep not in path
            and path != os.path.join(ROOT, "tools", "reading_path.py") and os.path.isfile(path))


def relative(filename):
    return os.path.relpath(os.path.abspath(filename), ROOT)


def trace_step(trainer, workdir):
    """Trace ref_server.py and make demo's step of trainer against it, each started as make demo starts them
    (tools/demo.py, tools/launch.py): {process: its record} for "server", "trainer" and each process the trainer
    started."""
    import requests
    from tools.launch import MODEL, TINY_WORLD_FLAGS, child_env, free_port  # not in a traced process: untraced
    file, _, steps = TRAINERS[trainer]
    port, env = free_port(), {**child_env(), "PYTHONPATH": ROOT}
    out = {name: os.path.join(workdir, f"{trainer}.{name}.json") for name in ("server", "trainer")}
    server_log = open(os.path.join(workdir, "server.log"), "w")  # a file: a pipe nobody reads could fill and stall it
    server = subprocess.Popen([sys.executable, __file__, "--trace", out["server"], "ref_server.py", "--model", MODEL,
                               "--port", str(port), "--threads", "2"],
                              cwd=ROOT, env=env, stdout=server_log, stderr=subprocess.STDOUT)
    runs = os.path.join(workdir, "runs")  # the trainer's run directory: $SIMPLE_GRPO_RUNS/RUN_NAME
    try:
        deadline = time.time() + 300
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("reading_path: the traced ref server did not start: "
                                 + open(server_log.name).read()[-2000:])
            time.sleep(0.5)
        run = subprocess.run([sys.executable, __file__, "--trace", out["trainer"], file, *TINY_WORLD_FLAGS,
                              "--ref_url", f"http://127.0.0.1:{port}", "--run_name", RUN_NAME, "--overwrite",
                              "--seed", "0", "--steps", str(steps)], cwd=ROOT, env={**env, "SIMPLE_GRPO_RUNS": runs},
                             capture_output=True, text=True, timeout=1200)
        if run.returncode != 0:
            raise SystemExit(f"reading_path: the traced step of {file} failed: {run.stderr[-3000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
        server_log.close()
        shutil.rmtree(runs, ignore_errors=True)
    stem = out["trainer"][:-len(".json")]
    for path in glob.glob(stem + ".*.json"):  # the processes it started: grpo_vllm_one.trainer.Process-1.json
        out["trainer." + path[len(stem) + 1:-len(".json")]] = path
    return {name: json.load(open(path)) for name, path in sorted(out.items())}


# ------------------------------------------------------------------------------ counting a trace
@functools.lru_cache(maxsize=None)
def definitions(file):
    """{qualified name: node} of every function in file (as a code object's co_qualname: "Finished.put",
    "make_app.<locals>.upload"; a class's name: None), and its tree."""
    tree = ast.parse(open(os.path.join(ROOT, file)).read())
    functions = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[prefix + child.name] = child
                walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                functions[prefix + child.name] = None  # its body runs once, on import
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)
    walk(tree, "")
    return functions, tree


def lines_of(node):
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return set(range(first, node.end_lineno + 1))


def module_level(tree):
    """The lines of a file that run on import: its statements but functions (docstring, imports, assignments,
    `if __name__`), and each class's header and the statements of its body but functions."""
    lines = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines |= set(range(first, max(first, node.body[0].lineno - 1) + 1)) | module_level(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= lines_of(node)
    return lines


def count(trace, trainer="grpo_vllm_one"):
    """A trace's reading path, file by file: {file: {"functions": [names entered], "lines": n, "characters": n,
    "file_lines": n}}, the trainer's file whole."""
    counted = {TRAINERS[trainer][0]: None}  # file -> its line numbers counted (None: every line)
    functions = {}
    for process in sorted(trace):  # "server", "trainer" and the processes the trainer started
        for entry in trace[process]["entered"]:
            file, name = entry["file"], entry["name"]
            nodes, tree = definitions(file)
            if counted.get(file, ()) is None:  # the trainer's file: every line counts already
                functions.setdefault(file, set()).add(name)
                continue
            lines = counted.setdefault(file, set())
            if name == "<module>":
                lines |= module_level(tree)
            elif name.rpartition(".")[2].startswith("<"):  # a lambda or comprehension: inside its function's lines
                continue
            elif name not in nodes:
                raise SystemExit(f"reading_path: {file} has no {name} now: trace the step again "
                                 f"(python tools/reading_path.py --record --trainer {trainer})")
            elif nodes[name] is not None:  # a class body runs on import: module-level code
                lines |= lines_of(nodes[name])
                functions.setdefault(file, set()).add(name)
    rows = {}
    for file, lines in counted.items():
        text = open(os.path.join(ROOT, file)).read().splitlines()
        lines = range(1, len(text) + 1) if lines is None else sorted(lines)
        order = {name: node.lineno for name, node in definitions(file)[0].items() if node is not None}
        rows[file] = {"functions": sorted(functions.get(file, ()), key=lambda n: (order.get(n, 0), n)),
                      "lines": len(lines), "characters": sum(len(text[i - 1]) + 1 for i in lines),
                      "file_lines": len(text)}
    return rows


def totals(rows):
    return {"lines": sum(r["lines"] for r in rows.values()), "characters": sum(r["characters"] for r in rows.values()),
            "files": len(rows)}


def report(rows, trainer):
    """The count as text: a line per file, then the totals."""
    lines = []
    for file, r in rows.items():
        entered = [name for name in r["functions"] if "<" not in name]
        what = ("every line" if file == TRAINERS[trainer][0] else f"entered: {', '.join(entered)}" if entered
                else "the code run on import")
        lines.append(f"  {file}: {r['lines']} of its {r['file_lines']} lines, {r['characters']:,} characters ({what})")
    t = totals(rows)
    lines.append(f"  {TRAINERS[trainer][0]}'s reading path: {t['lines']} lines, {t['characters']:,} characters, "
                 f"{t['files']} files")
    return "\n".join(lines)


def recorded(trainer):
    with open(TRAINERS[trainer][1]) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=list(TRAINERS), default="grpo_vllm_one")
    ap.add_argument("--record", action="store_true", help="trace the step again and rewrite its record")
    ap.add_argument("--trace", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # OUT SCRIPT ARGS...: one process
    args = ap.parse_args()
    if args.trace:
        out, script, *script_args = args.trace
        return trace_script(out, script, script_args)
    if args.record:
        import tempfile
        with tempfile.TemporaryDirectory() as workdir:
            trace = trace_step(args.trainer, workdir)
        with open(TRAINERS[args.trainer][1], "w") as f:
            json.dump(trace, f, indent=0, sort_keys=True)
    print(report(count(recorded(args.trainer), args.trainer), args.trainer))
    if args.trainer == "grpo_vllm_one":
        print(f"  issue 73's budget: {BUDGET['lines']} lines, {BUDGET['characters']:,} characters, "
              f"{BUDGET['files']} files")


if __name__ == "__main__":
    main()
