"""tools/reading_path.py: what one default step of grpo_train.py runs, traced, counted as the lines a reader reads.

    python tools/reading_path.py            # the table docs/guide.md holds, counted from tools/reading_path.json
    python tools/reading_path.py --record   # trace the step again first, and rewrite it (1-2 minutes on a CPU)

It starts ref_server.py and runs `grpo_train.py --steps 1` (the default step: the tiny model, beta 0.04, the
reference server), each under a tracer (sys.settrace and threading.settrace, every thread) that notes each
function of the project's own files the process enters. Then it counts, file by file:
  - each function entered: its whole span, first decorator to last line (docstring and comments included);
  - each module constant a function entered reads (LOAD_GLOBAL of a name a module of ours assigns): its lines;
  - each config field the run reads (cfg.name, through the config dataclass): its declaration's lines.
A file's lines counted are the union of these (a nested function sits inside its parent's span). LEFT_OUT
below names, with why, what is entered but not counted; the table prints it. The trace is saved in
tools/reading_path.json, so that tests/test_reading_path.py recounts the guide's table from the code as it is
now in a second (a slow test traces the step again and compares the record).
"""
import argparse
import ast
import dis
import functools
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tools", "reading_path.json")
RUN_NAME = "reading_path_trace"
CONFIG_CLASSES = (("simple_grpo.task.config", "DataConfig"), ("simple_grpo.protocol", "ServerConfig"))

# entered, not counted: (file, or file:function, why). A function listed here is left out with what it calls
# from files of its own (the trace notes who called whom).
LEFT_OUT = [
    ("simple_grpo/flags.py", "turns the config's fields into flags; the fields read are counted where declared"),
    ("simple_grpo/run/", "the run directory, the logs, checkpoints and the run doctor: they record the step's "
                         "figures, and none of the step's numbers comes from them"),
    ("simple_grpo/trainer/memory_plan.py", "--plan's memory plan: prints and stops only with --plan"),
    ("simple_grpo/reference/fingerprint.py", "the check that the server holds our model; changes no number"),
    ("simple_grpo/reference/http_server.py", "the server's HTTP: checks each upload, bounds connections"),
    ("grpo_train.py:check_one_process", "refuses the flags only grpo_vllm_one.py has"),
    ("simple_grpo/trainer/config.py:check_values", "refuses bad values, sets nothing"),
    ("simple_grpo/trainer/config.py:first_process", "whether this process prints the start-up lines"),
    ("simple_grpo/task/config.py:check_task", "refuses bad task values, sets nothing"),
    ("simple_grpo/trainer/deepspeed_engine.py:leave_process_group", "after the last step"),
]
# counted though the traced run does not enter it: (file, function, why)
ALSO_COUNTED = [("simple_grpo/trainer/config.py", "default_ref_url",
                 "a default run enters it; the traced run passes --ref_url, a free port, to reach its own server")]


# ------------------------------------------------------------------------------ tracing a script (one process)
def trace_script(out, script, args):
    """Run script with args as `python script args` would, tracing every thread, and write what it entered
    to out when it ends (normally, by SystemExit or by SIGTERM)."""
    callers, codes, fields = {}, {}, set()  # code -> the codes of ours it was called from; code -> its globals

    def tracer(frame, event, arg):
        code = frame.f_code
        if code in codes or ours(code.co_filename):
            codes[code] = frame.f_globals
            caller = frame.f_back  # the nearest caller of ours (torch's forward calls our ChunkedLogProbs, say)
            while caller is not None and not ours(caller.f_code.co_filename):
                caller = caller.f_back
            callers.setdefault(code, set()).add(caller and caller.f_code)
        return None  # no line events: the calls are all we need

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = [script, *args]
    sys.path.insert(0, ROOT)
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        record_field_reads(fields)
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.settrace(None)
        threading.settrace(None)
        entered = [{"file": relative(code.co_filename), "name": code.co_qualname,
                    "callers": sorted([relative(c.co_filename), c.co_qualname] if c else [] for c in callers[code]),
                    "globals": sorted(global_names(code, codes[code]))} for code in codes]
        with open(out, "w") as f:
            json.dump({"entered": sorted(entered, key=lambda e: (e["file"], e["name"])), "fields": sorted(fields)}, f)


@functools.lru_cache(maxsize=None)
def ours(filename):
    """Whether filename is one of the project's own files (not the virtual environment's, not this tool)."""
    path = os.path.abspath(filename)
    return (path.startswith(ROOT + os.sep) and path.endswith(".py") and os.sep + ".venv" + os.sep not in path
            and path != os.path.abspath(__file__))


def relative(filename):
    return os.path.relpath(os.path.abspath(filename), ROOT)


def global_names(code, module_globals):
    """The module-level names code (and the comprehensions inside it) loads that hold a value, not a
    function, class or module: the constants it reads (constant_home finds the module that assigns each)."""
    names = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and instruction.argval in module_globals:
            names.add(instruction.argval)
    for const in code.co_consts:
        if hasattr(const, "co_code") and const.co_name.startswith("<"):  # a comprehension or lambda
            names |= global_names(const, module_globals)
    return {name for name in names if not callable(module_globals[name])
            and type(module_globals[name]).__name__ != "module"}


def record_field_reads(fields):
    """Note every read of a config dataclass's field (cfg.name) from the project's code, as (the file and class
    that declare the field, the field, the file and function that read it). The config classes are the roots
    in CONFIG_CLASSES and their subclasses."""
    import dataclasses
    import importlib

    def declared_in(cls, name):
        return next(c for c in cls.__mro__ if name in getattr(c, "__annotations__", {}))

    def getattribute(self, name):
        value = object.__getattribute__(self, name)
        cls = type(self)
        if name in {f.name for f in dataclasses.fields(cls)}:
            frame = sys._getframe(1)
            while frame is not None and not ours(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:  # read by our code (asdict inside dataclasses, say, counts for its caller)
                owner = declared_in(cls, name)
                fields.add((relative(sys.modules[owner.__module__].__file__), owner.__qualname__, name,
                            relative(frame.f_code.co_filename), frame.f_code.co_qualname))
        return value

    for module, name in CONFIG_CLASSES:
        getattr(importlib.import_module(module), name).__getattribute__ = getattribute


# ------------------------------------------------------------------------------ one default step, traced
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace_default_step(workdir):
    """Trace ref_server.py and one default step of grpo_train.py against it: {"server": ..., "trainer": ...}."""
    import requests
    port, env = free_port(), {**os.environ, "PYTHONPATH": ROOT}
    server_out, trainer_out = os.path.join(workdir, "server.json"), os.path.join(workdir, "trainer.json")
    server_log = open(os.path.join(workdir, "server.log"), "w")  # a file: a pipe nobody reads could fill and stall it
    server = subprocess.Popen([sys.executable, __file__, "--trace", server_out, "ref_server.py", "--port", str(port)],
                              cwd=ROOT, env=env, stdout=server_log, stderr=subprocess.STDOUT)
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
        trainer = subprocess.run([sys.executable, __file__, "--trace", trainer_out, "grpo_train.py", "--steps", "1",
                                  "--run_name", RUN_NAME, "--overwrite", "--ref_url", f"http://127.0.0.1:{port}"],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
        if trainer.returncode != 0:
            raise SystemExit(f"reading_path: the traced step failed: {trainer.stderr[-3000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
        server_log.close()
        shutil.rmtree(os.path.join(ROOT, "runs", RUN_NAME), ignore_errors=True)
    return {name: json.load(open(path)) for name, path in (("server", server_out), ("trainer", trainer_out))}


# ------------------------------------------------------------------------------ counting a trace
def left_out_why(file, name=None):
    """(the LEFT_OUT entry, why) if file (or file:name) is left out, or None."""
    for what, why in LEFT_OUT:
        if what.endswith("/") and file.startswith(what) or what == file or (name and what == f"{file}:{name}"):
            return what, why
    return None


@functools.lru_cache(maxsize=None)
def definitions(file):
    """{qualified name: node} of every function in file (as a code object's co_qualname: "Finished.put",
    "make_app.<locals>.upload"; a class's name: None), {name: node} of its module-level assignments, its tree."""
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
    assigned = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    assigned[name.id] = node
    return functions, assigned, tree


def lines_of(node):
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return set(range(first, node.end_lineno + 1))


def imported_from(tree, name):
    """The module a file's `from X import name` brings name from, or None."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return node.module
    return None


def constant_home(file, name, seen=()):
    """(file, node) of the module-level assignment name refers to in file, following `from X import name`
    into the project's modules; None for a name no module of ours assigns."""
    _, assigned, tree = definitions(file)
    if name in assigned:
        return file, assigned[name]
    module = imported_from(tree, name)
    if module is None:
        return None
    path = module.replace(".", "/") + ".py"
    if not os.path.isfile(os.path.join(ROOT, path)) or path in seen:
        return None
    return constant_home(path, name, (*seen, file))


def count(trace):
    """The reading path of a trace: {file: {"functions": {name: lines}, "constants": {name: lines},
    "fields": {name: lines}, "lines": n, "total": n}}, and [(what, why)] of what was entered and left out."""
    rows, left_out = {}, {}

    def add(file, kind, name, node):
        """Count node's lines under file's kind ("functions", "constants" or "fields")."""
        r = rows.setdefault(file, {"functions": {}, "constants": {}, "fields": {}, "lines": set()})
        r[kind][name] = (min(lines_of(node)), len(lines_of(node)))
        r["lines"] |= lines_of(node)

    def excluded(entry, by_name, path=()):
        """Why entry is left out: it is, or each caller it was entered from is (transitively): (why, what);
        None where some chain of calls reaches it from code that is counted."""
        key = (entry["file"], entry["name"])
        why = left_out_why(*key)
        if why:
            return why
        parent = entry["name"].rpartition(".<locals>.")[0]
        if parent and (entry["file"], parent) in by_name:  # a closure (a route, a callback) is read with its parent
            return excluded(by_name[(entry["file"], parent)], by_name, (*path, key))
        if key in path:  # a cycle: counted only through another caller
            return f"{key[0]}:{key[1]}", "cycle"
        reasons = []
        for caller in entry["callers"]:
            if not caller or tuple(caller) not in by_name:
                return None  # entered from the script's top level, or from code run on import
            reason = excluded(by_name[tuple(caller)], by_name, (*path, key))
            if reason is None:
                return None
            reasons.append(reason)
        return next((r for r in reasons if r[1] != "cycle"), reasons[0] if reasons else None)

    for process in ("trainer", "server"):
        entries = trace[process]["entered"]
        by_name = {(e["file"], e["name"]): e for e in entries}
        for entry in entries:
            file, name = entry["file"], entry["name"]
            if name == "<module>":
                left_out.setdefault(("module-level code: imports, definitions, `if __name__`",
                                     "runs once on import; each function it defines is counted where entered"), None)
                continue
            functions, _, _ = definitions(file)
            if name.rpartition(".")[2].startswith("<"):  # a lambda or comprehension: inside its function's lines
                continue
            if name not in functions:
                raise SystemExit(f"reading_path: {file} has no {name} now: trace the step again "
                                 "(python tools/reading_path.py --record)")
            node = functions[name]
            if node is None:  # a class body
                continue
            why = excluded(entry, by_name)
            if why:
                left_out.setdefault(why, None)
                continue
            add(file, "functions", name, node)
            for constant in entry["globals"]:
                home = constant_home(file, constant)
                if home is not None:
                    add(*home[:1], "constants", constant, home[1])
        for class_file, class_name, field, reader_file, reader in trace[process]["fields"]:
            entry = by_name.get((reader_file, reader))
            if left_out_why(reader_file, reader) or (entry is not None and excluded(entry, by_name)):
                continue
            _, _, tree = definitions(class_file)
            cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
            node = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == field)
            add(class_file, "fields", field, node)
    for file, name, _ in ALSO_COUNTED:
        add(file, "functions", name, definitions(file)[0][name])
    for file, r in rows.items():
        r["lines"], r["total"] = len(r["lines"]), len(open(os.path.join(ROOT, file)).read().splitlines())
        for kind in ("functions", "constants", "fields"):  # in the file's order: {name: lines}
            r[kind] = {name: n for name, (_, n) in sorted(r[kind].items(), key=lambda item: item[1])}
    return rows, sorted(left_out)


def table(trace):
    """The guide's table: a line per file, the totals, then what was left out and why."""
    rows, left_out = count(trace)
    order = sorted(rows, key=lambda f: (f != "grpo_train.py", f != "grpo_math.py", f))
    lines = ["| # | file | functions entered (lines) | constants; config fields read | lines / file |",
             "|---|---|---|---|---|"]
    for i, file in enumerate(order, 1):
        r = rows[file]
        functions = ", ".join(f"`{name}` ({n})" for name, n in r["functions"].items()
                              if "<locals>" not in name) or "-"  # a nested function is inside its parent's lines
        data = ", ".join([f"`{name}`" for name in r["constants"]] + [f"`{name}`" for name in r["fields"]]) or "-"
        lines.append(f"| {i} | `{file}` | {functions} | {data} | {r['lines']} / {r['total']} |")
    lines.append(f"\n{len(rows)} files, {sum(r['lines'] for r in rows.values())} lines "
                 "(`python tools/reading_path.py`).\n\nEntered and not counted:")
    lines += [f"- {what if what.startswith('module-level') else f'`{what}`'}: {why}" for what, why in left_out]
    lines += [f"- counted though not entered here: `{file}`'s `{name}`: {why}" for file, name, why in ALSO_COUNTED]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="trace the step again and rewrite " + RECORD)
    ap.add_argument("--trace", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # OUT SCRIPT ARGS...: one process
    args = ap.parse_args()
    if args.trace:
        out, script, *script_args = args.trace
        return trace_script(out, script, script_args)
    if args.record or not os.path.isfile(RECORD):
        import tempfile
        with tempfile.TemporaryDirectory() as workdir:
            trace = trace_default_step(workdir)
        with open(RECORD, "w") as f:
            json.dump(trace, f, indent=0, sort_keys=True)
    print(table(json.load(open(RECORD))))


if __name__ == "__main__":
    main()
