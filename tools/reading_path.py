"""tools/reading_path.py: what a step of `make demo` runs, traced, for each trainer: the whole trace, and the part
of it a reader reads.

    python tools/reading_path.py [--trainer full]  # the guide's tables, counted from the records
    python tools/reading_path.py --record   # trace both again; rewrite the records and the guide's tables
                                            # (~5 minutes on a CPU; after any change to a step's code)
    python tools/reading_path.py --guide    # rewrite the guide's tables from the records (no tracing)

The records: tools/reading_path.json (grpo_train.py's step) and tools/reading_path_vllm_one.json (the full
trainer's, simple_grpo/train.py, run as python -m simple_grpo.train).

The step is make demo's (tools/demo.py): ref_server.py started as the demo starts it, then the trainer against it
with the demo's flags and --steps 1 (grpo_train.py, TRAINER=grpo_train) or 2 (simple_grpo/train.py, the default:
its first step sends its generation worker new weights, as every step but the last does). Each process runs under a
tracer (sys.settrace and threading.settrace) that notes each function of the project's files it enters and whom
from; a process the traced one starts with multiprocessing (the worker: a spawned interpreter) traces itself into
a record of its own (trace_call). Then two counts, file by file:
  - the whole trace: each function entered, whole (first decorator to last line: docstring and comments too);
    each module constant it reads (LOAD_GLOBAL of a name a module of ours assigns); each config field the run
    reads (cfg.name: its declaration); the module-level code that ran (docstring, imports, assignments, class
    bodies, `if __name__`). A file's lines are their union (a closure is inside its parent's).
  - the reader's subset: the same less module-level code (but the docstring) and what LEFT_OUT names, with why.
tests/test_reading_path.py recounts the guide's tables from the record and the code as it is now (a second), and
a slow test traces again and compares.
"""
import argparse
import ast
import contextlib
import dis
import functools
import glob
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # as `python script.py` has it for the scripts traced; tools.launch for this one
RECORD = os.path.join(ROOT, "tools", "reading_path.json")  # grpo_train's (tests/test_step_numbers.py reads it too)
RECORDS = {"full": os.path.join(ROOT, "tools", "reading_path_vllm_one.json"), "grpo_train": RECORD}
GUIDE = os.path.join(ROOT, "docs", "guide.md")
TRAINERS = ("full", "grpo_train")  # make demo's default first
FILES = {"full": "simple_grpo/train.py", "grpo_train": "grpo_train.py"}  # each trainer's file
COMMANDS = {"full": ["-m", "simple_grpo.train"], "grpo_train": ["grpo_train.py"]}  # what follows `python`
# steps traced: the full trainer sends the worker new weights after every step but the last (GRPO 5.), and the worker
# loads them before it samples the batch after next: two steps run both
STEPS = {"full": 2, "grpo_train": 1}
RUN_NAME = "reading_path_trace"
CONFIG_CLASSES = (("simple_grpo.task.problems", "DataConfig"), ("simple_grpo.protocol", "ServerConfig"))

# entered, not in the reader's subset: (file, or file:function, why). A function listed here is left out with what
# it calls from files of its own (the trace notes who called whom). The whole trace counts them all.
LEFT_OUT = [
    ("simple_grpo/flags.py", "turns the config's fields into flags; the fields read are counted where declared"),
    ("simple_grpo/run/", "the run directory, the logs, checkpoints and the run doctor: they record the step's "
                         "figures, and none of the step's numbers comes from them"),
    ("simple_grpo/trainer/memory_plan.py", "--plan's memory plan: prints and stops only with --plan"),
    ("simple_grpo/protocol.py:check_reference", "the check that the server holds our model; changes no number"),
    ("simple_grpo/http_server.py", "the server's HTTP: checks each upload, bounds connections"),
    ("grpo_train.py:check_one_process", "refuses the flags only simple_grpo/train.py has"),
    ("simple_grpo/trainer/config.py:check_values", "refuses bad values, sets nothing"),
    ("simple_grpo/task/problems.py:check_task", "refuses bad task values, sets nothing"),
    ("simple_grpo/trainer/deepspeed_engine.py:leave_process_group", "after the last step"),
    ("simple_grpo/train.py:Config.__post_init__", "refuses --gen_* values that cannot run"),
    *((f"simple_grpo/generation/workers.py:WorkerProgress.{name}", "the progress bar's text and the deadlines of the "
       "trainer's waits; changes no number") for name in ("__init__", "update", "describe", "check_deadline")),
    ("simple_grpo/generation/workers.py:check_workers", "stops the run, naming a worker that died"),
    ("simple_grpo/generation/workers.py:wait_for_vllm", "on a GPU vLLM shares, the trainer loads after it; "
                                                        "here it returns at once"),
    ("simple_grpo/generation/workers.py:stop_workers", "after the last step"),
]
COPIED_FIELDS = ("config fields read by a copy of the config (`dataclasses.replace`, `asdict`)",
                 "copying a field is not using it; each field the code reads itself is counted")
MODULE_LEVEL = ("module-level code but the docstring: imports, definitions, `if __name__`",
                "runs once on import; each function it defines is counted where entered")
# counted though the traced run does not enter it: {trainer: [(file, function, why)]}
ALSO_COUNTED = {"grpo_train": [
    ("simple_grpo/trainer/config.py", "default_ref_url",
     "`python grpo_train.py` enters it; make demo's step passes --ref_url, its own server's free port")]}


# ------------------------------------------------------------------------------ tracing a process
@contextlib.contextmanager
def tracing(out):
    """Trace every thread while the block runs, and write what it entered to out when it ends (normally, by an
    exception or SystemExit): {"entered": [{"file", "name", "callers", "globals"}], "fields": [...],
    "copied_fields": [...]}."""
    callers, codes = {}, {}  # code -> the codes of ours it was called from; code -> its globals
    fields = {"fields": set(), "copied_fields": set()}

    def tracer(frame, event, arg):
        code = frame.f_code
        if code in codes or ours(code.co_filename):
            codes[code] = frame.f_globals
            caller = frame.f_back  # the nearest caller of ours (torch's forward calls our ChunkedLogProbs, say)
            while caller is not None and not ours(caller.f_code.co_filename):
                caller = caller.f_back
            callers.setdefault(code, set()).add(caller and caller.f_code)
        return None  # no line events: the calls are all we need

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        record_field_reads(fields)
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        entered = [{"file": relative(code.co_filename), "name": code.co_qualname,
                    "callers": sorted([relative(c.co_filename), c.co_qualname] if c else [] for c in callers[code]),
                    "globals": sorted(global_names(code, codes[code]))} for code in codes]
        with open(out, "w") as f:
            json.dump({"entered": sorted(entered, key=lambda e: (e["file"], e["name"])),
                       **{kind: sorted(reads) for kind, reads in fields.items()}}, f)


def trace_script(out, script, args):
    """Run script with args as `python script args` would (script "-m": args start with a module, as `python -m
    module args`), traced into out. A process it starts with multiprocessing runs trace_call instead of its
    target: traced too, into out's name with the process's."""
    from multiprocessing.process import BaseProcess
    from tools.reading_path import trace_call  # by its module's name: the child imports it from there
    start = BaseProcess.start

    def start_traced(process):
        out_child = f"{out[:-len('.json')]}.{process.name}.json"
        process._target, process._args = trace_call, (out_child, process._target, *process._args)
        start(process)

    BaseProcess.start = start_traced
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if script == "-m":  # the module is __main__, with its __spec__: a spawned child imports it by its name
        module, *args = args
        sys.argv = [module, *args]
        with tracing(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *args]
    with tracing(out):
        runpy.run_path(script, run_name="__main__")


def trace_call(out, target, *args):
    """In a process started by a traced one (the generation worker): target(*args), traced into out. The modules
    the child imported before (its parent's script as __mp_main__, with its imports) ran untraced; the parent's
    trace has their module-level code."""
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
    that declare the field, the field, the file and function that read it), in fields["fields"], or where a library
    read it for that function (a copy: dataclasses.replace, asdict) in fields["copied_fields"]. The config classes
    are the roots in CONFIG_CLASSES and their subclasses."""
    import dataclasses
    import importlib

    def declared_in(cls, name):
        return next(c for c in cls.__mro__ if name in getattr(c, "__annotations__", {}))

    def getattribute(self, name):
        value = object.__getattribute__(self, name)
        cls = type(self)
        if name in {f.name for f in dataclasses.fields(cls)}:
            frame = sys._getframe(1)
            kind = "fields" if ours(frame.f_code.co_filename) else "copied_fields"  # dataclasses.replace, asdict
            while frame is not None and not ours(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:  # read by our code (asdict inside dataclasses, say, counts for its caller)
                owner = declared_in(cls, name)
                fields[kind].add((relative(sys.modules[owner.__module__].__file__), owner.__qualname__, name,
                                  relative(frame.f_code.co_filename), frame.f_code.co_qualname))
        return value

    for module, name in CONFIG_CLASSES:
        getattr(importlib.import_module(module), name).__getattribute__ = getattribute


# ------------------------------------------------------------------------------ make demo's step, traced
def trace_step(trainer, workdir):
    """Trace ref_server.py and one step of trainer against it, each started as make demo starts it (tools/demo.py,
    tools/launch.py): {process: its record} for "server", "trainer" and each process the trainer started."""
    import requests
    from tools.launch import MODEL, TINY_WORLD_FLAGS, child_env, free_port  # not in a traced process: untraced
    from simple_grpo.run.checkpoints import runs_root
    port, env = free_port(), {**child_env(), "PYTHONPATH": ROOT}
    out = {name: os.path.join(workdir, f"{trainer}.{name}.json") for name in ("server", "trainer")}
    server_log = open(os.path.join(workdir, "server.log"), "w")  # a file: a pipe nobody reads could fill and stall it
    server = subprocess.Popen([sys.executable, __file__, "--trace", out["server"], "ref_server.py", "--model", MODEL,
                               "--port", str(port), "--threads", "2"],
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
        run = subprocess.run([sys.executable, __file__, "--trace", out["trainer"], *COMMANDS[trainer],
                              *TINY_WORLD_FLAGS, "--ref_url", f"http://127.0.0.1:{port}", "--run_name", RUN_NAME,
                              "--overwrite", "--seed", "0", "--steps", str(STEPS[trainer])], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"reading_path: the traced step of {FILES[trainer]} failed: {run.stderr[-3000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
        server_log.close()
        shutil.rmtree(os.path.join(ROOT, runs_root(), RUN_NAME), ignore_errors=True)
    stem = out["trainer"][:-len(".json")]
    for path in glob.glob(stem + ".*.json"):  # the processes it started: full.trainer.gen_worker_0.json
        out[path[len(stem) + 1:-len(".json")]] = path
    return {name: json.load(open(path)) for name, path in sorted(out.items())}


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


def module_level(tree):
    """What of a file runs on import: its statements but functions (docstring, imports, assignments, `if __name__`),
    and each class's header (first, last line) and the statements of its body but functions."""
    nodes = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            nodes += [(first, max(first, node.body[0].lineno - 1)), *module_level(node)]
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append(node)
    return nodes


def count(trace, whole=False, also_counted=()):
    """A trace's lines, file by file: {file: {"functions": {name: lines}, "constants": {name: lines},
    "fields": {name: lines}, "lines": n, "total": n}}, and [(what, why)] of what was entered and left out.
    whole: nothing left out, module-level code counted; else the reader's subset (LEFT_OUT left out)."""
    rows, left_out = {}, {}

    def add(file, kind, name, node):
        """Count node's lines (or a (first, last) range) under file's kind ("functions", "constants", "fields",
        "module")."""
        lines = set(range(node[0], node[1] + 1)) if isinstance(node, tuple) else lines_of(node)
        r = rows.setdefault(file, {"functions": {}, "constants": {}, "fields": {}, "module": {}, "lines": set()})
        r[kind][name] = (min(lines), len(lines))
        r["lines"] |= lines

    def excluded(entry, by_name, path=()):
        """Why entry is left out: it is, or each caller it was entered from is (transitively): (why, what);
        None where some chain of calls reaches it from code that is counted (always, for the whole trace)."""
        if whole:
            return None
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

    for process in sorted(trace):  # "server", "trainer" and the processes the trainer started
        entries = trace[process]["entered"]
        by_name = {(e["file"], e["name"]): e for e in entries}
        for entry in entries:
            file, name = entry["file"], entry["name"]
            functions, _, tree = definitions(file)
            if name == "<module>":
                if not whole:
                    left_out.setdefault(MODULE_LEVEL, None)
                for i, node in enumerate(module_level(tree) if whole else []):
                    add(file, "module", i, node)
                continue
            if name.rpartition(".")[2].startswith("<"):  # a lambda or comprehension: inside its function's lines
                continue
            if name not in functions:
                raise SystemExit(f"reading_path: {file} has no {name} now: trace the steps again "
                                 "(python tools/reading_path.py --record)")
            node = functions[name]
            if node is None:  # a class body: module-level code
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
        copied = [(*read, True) for read in trace[process].get("copied_fields", [])]
        for class_file, class_name, field, reader_file, reader, *copy in trace[process]["fields"] + copied:
            entry = by_name.get((reader_file, reader))
            if not whole and (left_out_why(reader_file, reader) or (entry is not None and excluded(entry, by_name))):
                continue
            if not whole and copy:
                left_out.setdefault(COPIED_FIELDS, None)
                continue
            _, _, tree = definitions(class_file)
            cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
            node = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == field)
            add(class_file, "fields", field, node)
    for file, name, _ in also_counted:
        add(file, "functions", name, definitions(file)[0][name])
    for file in list(rows):  # each file counted says what it is: its docstring
        tree = definitions(file)[2]
        if ast.get_docstring(tree) is not None:
            add(file, "module", "docstring", tree.body[0])
    for file, r in rows.items():
        r["lines"], r["total"] = len(r["lines"]), len(open(os.path.join(ROOT, file)).read().splitlines())
        for kind in ("functions", "constants", "fields", "module"):  # in the file's order: {name: lines}
            r[kind] = {name: n for name, (_, n) in sorted(r[kind].items(), key=lambda item: item[1])}
    return rows, sorted(left_out)


def table(trace, trainer):
    """The guide's table for trainer: a line per file of the whole trace, its lines in the reader's subset beside
    the whole trace's; the totals; then what the subset leaves out, and why."""
    also = ALSO_COUNTED.get(trainer, [])
    (subset, left_out), (whole, _) = count(trace, also_counted=also), count(trace, whole=True, also_counted=also)
    order = sorted(whole, key=lambda f: (f != FILES[trainer], f != "grpo_math.py", f))
    names = lambda functions, leave=(): ", ".join(f"`{name}` ({n})" for name, n in functions.items()  # noqa: E731
                                                   if "<locals>" not in name and name not in leave) or "-"
    lines = ["| # | file | functions entered: the reader's (lines) | constants; config fields read | "
             "functions entered, left out (lines) | lines: the reader's / the whole trace's / the file's |",
             "|---|---|---|---|---|---|"]
    for i, file in enumerate(order, 1):  # a nested function is inside its parent's lines
        r, w = subset.get(file, {"functions": {}, "constants": {}, "fields": {}, "lines": 0}), whole[file]
        data = ", ".join(f"`{name}`" for name in [*r["constants"], *r["fields"]]) or "-"
        lines.append(f"| {i} | `{file}` | {names(r['functions'])} | {data} | {names(w['functions'], r['functions'])} "
                     f"| {r['lines']} / {w['lines']} / {w['total']} |")
    lines.append(f"\nThe reader's: {len(subset)} files, {sum(r['lines'] for r in subset.values()):,} lines; the whole "
                 f"trace's: {len(whole)} files, {sum(r['lines'] for r in whole.values()):,} lines "
                 f"(`python tools/reading_path.py --trainer {trainer}`).\n\nEntered, and left out of the reader's:")
    lines += [f"- {what if what in (MODULE_LEVEL[0], COPIED_FIELDS[0]) else f'`{what}`'}: {why}"
              for what, why in left_out]
    lines += [f"- counted though not entered here: `{file}`'s `{name}`: {why}" for file, name, why in also]
    return "\n".join(lines)


def guide_block(trainer):
    """The guide's block that holds trainer's table: (its first marker, a pattern that finds the table)."""
    marker = f"<!-- reading-path: python tools/reading_path.py --trainer {trainer} -->"
    return marker, re.compile(re.escape(marker) + r"\n(.*?)\n<!-- /reading-path -->", re.S)


def recorded(trainer):
    with open(RECORDS[trainer]) as f:
        return json.load(f)


def write_guide():
    """Paste each trainer's table, counted from its record, into its block in docs/guide.md."""
    guide = open(GUIDE).read()
    for trainer in TRAINERS:
        marker, pattern = guide_block(trainer)
        if not pattern.search(guide):
            raise SystemExit(f"reading_path: docs/guide.md has no block {marker} ... <!-- /reading-path -->")
        table_now = table(recorded(trainer), trainer)
        guide = pattern.sub(lambda _: f"{marker}\n{table_now}\n<!-- /reading-path -->", guide)
    with open(GUIDE, "w") as f:
        f.write(guide)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=TRAINERS, help="this trainer only (default: both)")
    ap.add_argument("--record", action="store_true", help="trace the steps again; rewrite the records "
                                                          "(tools/reading_path*.json) and the guide's tables")
    ap.add_argument("--guide", action="store_true", help="rewrite docs/guide.md's tables from the records")
    ap.add_argument("--trace", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # OUT SCRIPT ARGS...: one process
    args = ap.parse_args()
    if args.trace:
        out, script, *script_args = args.trace
        return trace_script(out, script, script_args)
    trainers = [args.trainer] if args.trainer else TRAINERS
    for trainer in trainers if args.record else []:
        import tempfile
        with tempfile.TemporaryDirectory() as workdir:
            trace = trace_step(trainer, workdir)
        with open(RECORDS[trainer], "w") as f:
            json.dump(trace, f, indent=0, sort_keys=True)
    if args.record or args.guide:
        write_guide()
    for trainer in trainers:
        print(f"{FILES[trainer]}:\n{table(recorded(trainer), trainer)}\n")


if __name__ == "__main__":
    main()
