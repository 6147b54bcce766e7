"""Every import of a project module names something that module has, read from the source (ast: nothing is
imported or run). `from simple_grpo.task.rewards import true_answer` needs a `true_answer` at the top level of
simple_grpo/task/rewards.py (a def, a class, an assignment or an import there, under an `if` or `try` too) or a
submodule simple_grpo/task/rewards/true_answer.py; `import a.b` needs the module a.b.

Read: every .py file of the repository (imports inside functions too: an import in a child process, such as
bench/compare_trl.py's TRL child, or in a rarely taken branch fails only there, where no other test reaches), the
code a file runs with `python -c` (a string constant that parses as Python and holds an import), the Makefile's
`python -c "..."` and the notebooks' code cells. A project module is one whose first name is a folder or a .py
file at the repository root; every script and test puts the root on sys.path. Other imports (the standard
library, torch...) are not checked here.
"""
import ast
import json
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {".git", ".venv", ".cache", "runs", "__pycache__", "models", "data", "docs", "configs", "shared"}


def source_files(root=ROOT):
    """The repository's .py files and notebooks, paths relative to root."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith((".py", ".ipynb"))]
    return found


def code_of(path, root=ROOT):
    """[(where, Python source)] for one file: the file itself, or a notebook's code cells (its %magic and !shell
    lines left out)."""
    text = open(os.path.join(root, path), encoding="utf-8").read()
    if not path.endswith(".ipynb"):
        return [(path, text)]
    cells = [c for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
    return [(f"{path} cell {i}", "".join(line for line in (c["source"] if isinstance(c["source"], list)
                                                            else c["source"].splitlines(keepends=True))
                                         if not line.lstrip().startswith(("%", "!"))))
            for i, c in enumerate(cells)]


def embedded_code(tree):
    """The string constants of a tree that are Python holding an import: what it runs with `python -c`."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value
                and id(node) not in docstrings):
            try:
                inner = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(inner)):
                found.append((node.lineno, inner))
    return found


def makefile_code(root=ROOT):
    """The Makefile's `python -c "..."` snippets."""
    path = os.path.join(root, "Makefile")
    if not os.path.isfile(path):
        return []
    return [(f"Makefile line {text[:m.start()].count(chr(10)) + 1}", m.group(1))
            for text in [open(path).read()] for m in re.finditer(r'-c "([^"]*)"', text)]


class Project:
    """The repository's modules, found from their files: a module a.b is a/b.py or a package a/b/ (with or
    without __init__.py: a folder of .py files is a namespace package)."""

    def __init__(self, root=ROOT):
        self.root = root
        self.tops = {name[:-3] if name.endswith(".py") else name for name in os.listdir(root)
                     if name not in SKIP and not name.startswith(".")
                     and (name.endswith(".py") or self._is_package(os.path.join(root, name)))}
        self._names = {}

    @staticmethod
    def _is_package(folder):
        return os.path.isdir(folder) and any(f.endswith(".py") for f in os.listdir(folder))

    def is_project(self, module):
        return module.split(".")[0] in self.tops

    def file(self, module):
        """The module's .py file (a package's __init__.py), "" for a namespace package, None if there is none."""
        base = os.path.join(self.root, *module.split("."))
        if os.path.isfile(base + ".py"):
            return base + ".py"
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return os.path.join(base, "__init__.py")
        return "" if self._is_package(base) else None

    def top_level_names(self, module):
        """The names a module binds at its top level; '*' among them when it does `from x import *` of a module
        outside the project (which could bind anything)."""
        if module not in self._names:
            self._names[module] = set()  # a module that star-imports itself back adds nothing more
            path = self.file(module)
            self._names[module] = self._bound(module, ast.parse(open(path, encoding="utf-8").read())) if path else set()
        return self._names[module]

    def _bound(self, module, tree):
        names = set()

        def targets(node):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, (ast.Tuple, ast.List)):
                for elt in node.elts:
                    targets(elt)
            elif isinstance(node, ast.Starred):
                targets(node.value)

        def visit(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        targets(target)
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets(node.target)
                elif isinstance(node, ast.Import):
                    names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if alias.name != "*":
                            names.add(alias.asname or alias.name)
                            continue
                        source = self.resolve(module, node, is_package=self.file(module).endswith("__init__.py"))
                        names.update(self.top_level_names(source) if self.is_project(source) else {"*"})
                elif isinstance(node, (ast.For, ast.AsyncFor)):
                    targets(node.target)
                elif isinstance(node, (ast.With, ast.AsyncWith)):
                    for item in node.items:
                        if item.optional_vars is not None:
                            targets(item.optional_vars)
                for field in ("body", "orelse", "finalbody", "handlers"):  # if, try, for, while, with blocks
                    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        visit(getattr(node, field, []))
                if isinstance(node, ast.ExceptHandler) and node.name:
                    names.add(node.name)
            return names

        visit(tree.body)
        # `global name` in a function binds name at the top level too
        names.update(n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names)
        return names

    @staticmethod
    def resolve(module, node, is_package=False):
        """The absolute module name of an ImportFrom in `module` (relative imports from its package)."""
        if not node.level:
            return node.module
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))

    def problems(self, module, tree, where):
        """What the imports in `tree` (the code of `module`, found at `where`) name that does not exist."""
        found = []
        is_package = where.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not self.is_project(alias.name):
                        continue
                    parts = alias.name.split(".")
                    for i in range(1, len(parts) + 1):  # import a.b.c: a, a.b and a.b.c are modules
                        if self.file(".".join(parts[:i])) is None:
                            found.append(f"{where}:{node.lineno}: import {alias.name}: there is no module "
                                         f"{'.'.join(parts[:i])}")
                            break
            elif isinstance(node, ast.ImportFrom):
                source = self.resolve(module, node, is_package)
                if not source or not self.is_project(source):
                    continue
                if self.file(source) is None:
                    found.append(f"{where}:{node.lineno}: from {source} import ...: there is no module {source}")
                    continue
                has = self.top_level_names(source)
                for alias in node.names:
                    if alias.name == "*" or alias.name in has or "*" in has:
                        continue
                    if self.file(f"{source}.{alias.name}") is None:
                        found.append(f"{where}:{node.lineno}: from {source} import {alias.name}: "
                                     f"{source} has no {alias.name}")
        return found


def missing_names(root=ROOT):
    """Every import in the repository that names a project module or name that does not exist."""
    project, found = Project(root), []
    for path in source_files(root):
        module = path[:-len(".py")].replace(os.sep, ".") if path.endswith(".py") else "__notebook__"
        if module.endswith(".__init__"):
            module = module[:-len(".__init__")]
        for where, code in code_of(path, root):
            tree = ast.parse(code, filename=where)
            found += project.problems(module, tree, where)
            for lineno, inner in embedded_code(tree):
                found += project.problems("__main__", inner, f"{where}:{lineno} (code run by `python -c`)")
    for where, code in makefile_code(root):
        found += project.problems("__main__", ast.parse(code), where)
    return found


def test_every_import_of_a_project_module_names_something_it_has():
    found = missing_names()
    assert not found, "imports of names that do not exist:\n" + "\n".join(found)


def test_the_check_sees_an_import_of_a_missing_name_inside_a_function(tmp_path):
    """The check can fail: the old bench/compare_trl.py's TRL child imported a renamed function, in a function."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "rewards.py").write_text("import re\nif True:\n    PATTERN = re.compile('x')\n"
                                                 "def true_answer(a):\n    return a\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "compare.py").write_text(
        "from pkg.rewards import PATTERN, re\n"
        "def child():\n    from pkg.rewards import reference_answer, true_answer\n"
        "CODE = 'from pkg import rewards, nothing_here'\n")
    assert missing_names(str(tmp_path)) == [
        "bench/compare.py:3: from pkg.rewards import reference_answer: pkg.rewards has no reference_answer",
        "bench/compare.py:4 (code run by `python -c`):1: from pkg import nothing_here: pkg has no nothing_here"]


def test_the_check_sees_a_missing_module_and_resolves_relative_imports(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("from .sub.a import f\n")
    (tmp_path / "pkg" / "sub" / "a.py").write_text("from . import b\nfrom .b import g, h\ndef f():\n    pass\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("g = 1\n")
    (tmp_path / "main.py").write_text("import pkg.sub.c\nimport pkg.sub.a\nfrom pkg import f\n")
    assert missing_names(str(tmp_path)) == ["main.py:1: import pkg.sub.c: there is no module pkg.sub.c",
                                            "pkg/sub/a.py:2: from pkg.sub.b import h: pkg.sub.b has no h"]
