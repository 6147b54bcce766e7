"""notebooks/one_grpo_step.ipynb, the lesson of one GRPO step, runs cell by cell in a fresh kernel: its own
asserts check that grpo_loss equals grpo_objective and that one step moves each completion's log-probability
with its advantage. A few seconds of compute on the tiny model, ~20 s with the kernel's start."""
import json
import os
import sys

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "one_grpo_step.ipynb")


def this_python_kernel(tmp_path):
    """A kernel manager whose kernel is this interpreter's (the venv's) ipykernel, whatever kernelspecs
    the user or the system has: a kernelspec made for it in tmp_path."""
    kernels = tmp_path / "kernels"
    (kernels / "this-python").mkdir(parents=True)
    (kernels / "this-python" / "kernel.json").write_text(json.dumps(
        {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "this Python", "language": "python"}))
    return KernelManager(kernel_name="this-python", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with_outputs = [k for k, cell in enumerate(notebook.cells) if cell.get("outputs") or cell.get("execution_count")]
    assert not with_outputs, f"cells {with_outputs} of {NOTEBOOK} hold outputs: clear them before committing " \
                             "(Jupyter: Edit > Clear Outputs of All Cells) so its diffs stay small"


def test_the_notebook_runs_one_grpo_step_cell_by_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no user profile or startup files
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, km=this_python_kernel(tmp_path), timeout=300, startup_timeout=120,
                            resources={"metadata": {"path": ROOT}})  # the kernel's working directory
    client.execute()  # a cell that raises raises CellExecutionError here, with its source and traceback
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code")
