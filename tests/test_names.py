"""Every name the code uses is defined: pyflakes' undefined-name check over every tracked Python file. A name
left over from a refactor fails only when its line runs, which for the demos' last lines is after an hour of
training (tools/demo_real.py's report once named a variable that had moved)."""
import os
import subprocess

import pyflakes.api
import pyflakes.messages
import pyflakes.reporter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNDEFINED = (pyflakes.messages.UndefinedName, pyflakes.messages.UndefinedLocal, pyflakes.messages.UndefinedExport)


class Collect(pyflakes.reporter.Reporter):
    """Keeps pyflakes' messages instead of printing them."""

    def __init__(self):
        self.messages, self.errors = [], []

    def flake(self, message):
        self.messages.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.errors.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.errors.append(f"{filename}: {msg}")


def python_files():
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f"{ROOT}/{path}" for path in out.split()]


def test_no_python_file_uses_an_undefined_name():
    files = python_files()
    assert len(files) > 50  # the repository's own files, found
    reporter = Collect()
    for path in files:
        pyflakes.api.checkPath(path, reporter)
    undefined = [str(m) for m in reporter.messages if isinstance(m, UNDEFINED)]
    assert not reporter.errors and not undefined, "\n".join(reporter.errors + undefined)


def test_the_check_finds_an_undefined_name(tmp_path):
    path = tmp_path / "leftover.py"
    path.write_text("def report(n):\n    return len(train) - n\n")
    reporter = Collect()
    pyflakes.api.checkPath(str(path), reporter)
    assert [m.message_args for m in reporter.messages if isinstance(m, UNDEFINED)] == [("train",)]
