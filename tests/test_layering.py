"""The house's layering, read from the imports (ast, nothing is run): the root holds the card's scripts;
no script imports another script; the package (simple_grpo/) never imports a script, nor names one to run
(starting the project's processes is the tools' job: tools/launch.py); its one entry point, simple_grpo/train.py
(the full trainer, run with -m), is imported by no other package module; its generation side and its trainer side
never import each other; no module imports itself back through others.

A script is a file outside the package with an `if __name__ == "__main__":` block (the trainers, the ref
server, evaluate.py, tools/, bench/, regroup_ver/). Module names are dotted paths from the repository root,
where every script and test puts itself on sys.path.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "simple_grpo"
SKIP = {".git", ".venv", ".cache", "runs", "tests", "__pycache__", "models", "data", "docs", "configs"}
ROOT_SCRIPTS = {"grpo_math.py", "grpo_train.py", "grpo_vllm_one.py", "ref_server.py", "evaluate.py"}
COMING = {"grpo_vllm_one.py"}  # the lesson, written anew now that the full trainer is simple_grpo/train.py
ENTRY_POINTS = {f"{PACKAGE}.train"}  # the package modules run as a command: python -m simple_grpo.train


def modules():
    """{dotted name: path} of every .py file in the repository but the tests."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, name)
    return found


def is_script(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def imports(name, path, known):
    """The repository modules that module `name` imports, anywhere in it (functions too)."""
    tree, found = ast.parse(open(path, encoding="utf-8").read()), set()
    package = name.rsplit(".", 1)[0] if "." in name and not path.endswith("__init__.py") else name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its own package
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` uses a.b.c, or the nearest module above it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                break
    return found


def graph():
    known = modules()
    return known, {name: imports(name, path, known) for name, path in known.items()}


def side(name):
    """'trainer', 'generation' or None: the part of the package a module belongs to."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == PACKAGE and parts[1] in ("trainer", "generation") else None


def test_the_root_holds_the_cards_scripts_and_the_package_holds_the_rest():
    root_files = {f for f in os.listdir(ROOT) if f.endswith(".py")}
    assert root_files <= ROOT_SCRIPTS, f"at the root beyond the card: {sorted(root_files - ROOT_SCRIPTS)}"
    assert ROOT_SCRIPTS - COMING <= root_files, f"missing at the root: {sorted(ROOT_SCRIPTS - COMING - root_files)}"
    assert os.path.isfile(os.path.join(ROOT, PACKAGE, "__init__.py"))


def test_no_script_imports_a_script():
    known, edges = graph()
    scripts = {name for name, path in known.items() if not name.startswith(PACKAGE) and is_script(path)}
    bad = sorted(f"{a} -> {b}" for a in scripts for b in edges[a] if b in scripts)
    assert not bad, "scripts import scripts: " + ", ".join(bad)


def test_the_package_imports_no_script():
    known, edges = graph()
    scripts = {name for name, path in known.items() if not name.startswith(PACKAGE) and is_script(path)}
    package = [name for name in known if name.split(".")[0] == PACKAGE]
    assert package, "no package simple_grpo/ yet"
    bad = sorted(f"{a} -> {b}" for a in package for b in edges[a] if b in scripts)
    assert not bad, "package modules import scripts: " + ", ".join(bad)
    mains = sorted(name for name in package if is_script(known[name]) and name not in ENTRY_POINTS)
    assert not mains, "package modules run as scripts (their command belongs to a script): " + ", ".join(mains)
    assert all(is_script(known[name]) for name in ENTRY_POINTS), "an entry point without its __main__ block"


def test_no_package_module_imports_the_entry_point():
    """simple_grpo/train.py sits on top of the package: the tools, benches and tests may import it (its Config,
    gen_worker), the package's other modules may not."""
    known, edges = graph()
    bad = sorted(f"{a} -> {b}" for a in known if a.split(".")[0] == PACKAGE and a not in ENTRY_POINTS
                 for b in edges[a] if b in ENTRY_POINTS)
    assert not bad, "package modules import the entry point: " + ", ".join(bad)


def script_names(name, path):
    """The strings a module would start a script by: its path from the root (tools/probe.py), its file name
    (probe.py, as in os.path.join(ROOT, "tools", "probe.py")), and its dotted name (tools.probe, for -m)."""
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    return {rel, os.path.basename(rel), *([name] if "." in name else [])}


def named_scripts(path, scripts):
    """[(line, string)] for each string in the module (docstrings left out: they may say which script does
    what) that names one of `scripts` (script_names' strings), whole or at the end of a path (an f-string's
    pieces too), or that is a path to any .py file: a file to start."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value.strip()
            if " " in text:  # a sentence (an error message that tells the user what to run), not a path
                continue
            if text in scripts or text.endswith(tuple("/" + s for s in scripts)) or text.endswith(".py"):
                found.append((node.lineno, node.value))
    return sorted(found)


def test_the_package_names_no_script_to_run():
    """simple_grpo/ never starts a script (tools/*.py, bench/*.py, evaluate.py, ref_server.py...): the tools,
    benches and tests start processes; a package module that runs code in a process of its own runs its own
    functions there."""
    known = modules()
    scripts = set().union(*(script_names(name, path) for name, path in known.items()
                            if not name.startswith(PACKAGE) and is_script(path)))
    bad = sorted((os.path.relpath(path, ROOT), line, text) for name, path in known.items()
                 if name.split(".")[0] == PACKAGE for line, text in named_scripts(path, scripts))
    assert not bad, "package modules name scripts to run: " + ", ".join(f"{p}:{n}: {t!r}" for p, n, t in bad)


def test_the_generation_side_and_the_trainer_side_never_import_each_other():
    _, edges = graph()
    bad = sorted(f"{a} -> {b}" for a in edges for b in edges[a] if side(a) and side(b) and side(a) != side(b))
    assert not bad, "generation <-> trainer imports: " + ", ".join(bad)


def test_no_import_cycle():
    _, edges = graph()
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_the_checker_sees_a_script_importing_a_script(tmp_path):
    """The rules above can fail: a script that imports another is found."""
    (tmp_path / "a.py").write_text("import b\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "b.py").write_text("x = 1\nif __name__ == '__main__':\n    pass\n")
    known = {"a": str(tmp_path / "a.py"), "b": str(tmp_path / "b.py")}
    assert imports("a", known["a"], known) == {"b"} and is_script(known["b"])


def test_the_checker_sees_a_package_module_naming_a_script_to_run(tmp_path):
    """A script's path, its file name among a path's pieces, its dotted name for -m, or an f-string's .py are
    found; a docstring or an error message that names a script is not."""
    module = tmp_path / "launch.py"
    module.write_text('''"""Starts tools/probe.py."""
import os, subprocess, sys
def run(root, name):
    """Runs evaluate.py."""
    subprocess.run([sys.executable, "tools/probe.py"])
    subprocess.run([sys.executable, os.path.join(root, "tools", "probe.py")])
    subprocess.run([sys.executable, "-m", "tools.probe"])
    subprocess.run([sys.executable, f"{name}.py"])
    raise SystemExit("is `python ref_server.py` running?")
''')
    scripts = script_names("tools.probe", os.path.join(ROOT, "tools", "probe.py"))
    assert scripts == {"tools/probe.py", "probe.py", "tools.probe"}
    assert named_scripts(str(module), scripts) == [(5, "tools/probe.py"), (6, "probe.py"), (7, "tools.probe"),
                                                   (8, ".py")]
