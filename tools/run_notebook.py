"""tools/run_notebook.py: runs notebooks/one_grpo_step.ipynb in a fresh kernel and writes its executed form,
notebooks/one_grpo_step_executed.ipynb (its printed outputs and the plot; stderr's progress bars and warnings
left out), which GitHub shows without running anything.

    python tools/run_notebook.py            # (make notebook) after editing the notebook; commit both files

The lesson itself stays committed without outputs (small diffs); tests/test_notebook.py runs it afresh and
checks that the executed form matches that run: the same text with every number within tolerance, and a plot
where the run made one.
"""
import json
import os
import re
import sys
import tempfile

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "one_grpo_step.ipynb")
EXECUTED = os.path.join(ROOT, "notebooks", "one_grpo_step_executed.ipynb")
NUMBER = re.compile(r"[-+]?\d+\.?\d*(?:e[-+]?\d+)?")


def this_python_kernel(kernel_dir):
    """A kernel manager whose kernel is this interpreter's (the venv's) ipykernel, whatever kernelspecs the
    user or the system has: a kernelspec made for it in kernel_dir."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    kernels = os.path.join(kernel_dir, "kernels")
    os.makedirs(os.path.join(kernels, "this-python"), exist_ok=True)
    with open(os.path.join(kernels, "this-python", "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "this Python", "language": "python"}, f)
    return KernelManager(kernel_name="this-python", kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels]))


def execute(path=NOTEBOOK):
    """The notebook at path run cell by cell in a fresh kernel (working directory: the repository), with its
    outputs; a cell that raises raises nbclient's CellExecutionError, with its source and traceback."""
    from nbclient import NotebookClient
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["IPYTHONDIR"] = os.path.join(tmp, "ipython")  # no user profile or startup files
        NotebookClient(notebook, km=this_python_kernel(tmp), timeout=300, startup_timeout=120,
                       resources={"metadata": {"path": ROOT}}).execute()
    return notebook


def without_stderr(notebook):
    """The notebook less its stderr streams (progress bars, library warnings naming this machine's paths)."""
    for cell in (c for c in notebook.cells if c.cell_type == "code"):
        cell.outputs = [out for out in cell.get("outputs", []) if out.get("name") != "stderr"]
    return notebook


def outputs(notebook):
    """Each code cell's outputs as (text, has an image): its stdout and its results' text, joined."""
    cells = []
    for cell in (c for c in notebook.cells if c.cell_type == "code"):
        text, image = "", False
        for out in cell.get("outputs", []):
            if out.get("name") == "stdout":
                text += out.get("text", "")
            elif out.get("output_type") == "execute_result":
                text += out.get("data", {}).get("text/plain", "")
            image = image or "image/png" in out.get("data", {})
        cells.append((text, image))
    return cells


def differences(expected, got, rel=1e-3, abs_=1e-4):
    """Where two runs' outputs differ beyond tolerance: a cell's text apart from its numbers, a number further
    than rel (relative) and abs_ (absolute), or a plot in one and not the other. [] when they agree."""
    found = []
    if len(expected) != len(got):
        return [f"{len(expected)} code cells against {len(got)}"]
    for k, ((text_a, image_a), (text_b, image_b)) in enumerate(zip(expected, got)):
        if NUMBER.sub("#", text_a) != NUMBER.sub("#", text_b):
            found.append(f"code cell {k}: the text differs:\n{text_a}\n---\n{text_b}")
            continue
        for a, b in zip(NUMBER.findall(text_a), NUMBER.findall(text_b)):
            if abs(float(a) - float(b)) > abs_ + rel * abs(float(a)):
                found.append(f"code cell {k}: {a} against {b}")
        if image_a != image_b:
            found.append(f"code cell {k}: a plot in one run and not the other")
    return found


if __name__ == "__main__":
    nbformat.write(without_stderr(execute()), EXECUTED)
    print(f"wrote {os.path.relpath(EXECUTED, ROOT)}")
