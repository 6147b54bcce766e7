"""notebooks/one_grpo_step.ipynb, the lesson of one GRPO step, runs cell by cell in a fresh kernel: its own
asserts check each claim of its prose (the server's function gives the reference log-probs computed there, the
trainers drop a group whose rewards are all equal, grpo_loss equals grpo_objective, the first step's loss is 0
up to rounding, Adam moves a weight by about lr, one step moves each completion's log-probability with its
advantage, a clipped token's gradient is the KL term's alone, ...). Its executed form,
notebooks/one_grpo_step_executed.ipynb (tools/run_notebook.py), is what a reader on GitHub sees: it must match a
fresh run. A few seconds of compute, ~25 s with the kernel's start."""
import pytest
import nbformat

from tools.run_notebook import EXECUTED, NOTEBOOK, differences, execute, outputs


@pytest.fixture(scope="module")
def fresh_run():
    return execute()  # a cell that raises (a failed assert among them) raises CellExecutionError here


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with_outputs = [k for k, cell in enumerate(notebook.cells) if cell.get("outputs") or cell.get("execution_count")]
    assert not with_outputs, f"cells {with_outputs} of {NOTEBOOK} hold outputs: clear them before committing " \
                             "(Jupyter: Edit > Clear Outputs of All Cells) so its diffs stay small"


def test_the_notebook_runs_one_grpo_step_cell_by_cell(fresh_run):
    assert all(cell.get("execution_count") for cell in fresh_run.cells if cell.cell_type == "code")


def test_the_executed_form_is_the_lesson_as_it_is_now():
    lesson, executed = nbformat.read(NOTEBOOK, as_version=4), nbformat.read(EXECUTED, as_version=4)
    assert [c.source for c in executed.cells] == [c.source for c in lesson.cells], \
        "notebooks/one_grpo_step_executed.ipynb is stale: run `python tools/run_notebook.py` (make notebook)"


def test_the_executed_form_matches_a_fresh_run_within_tolerance(fresh_run):
    published = outputs(nbformat.read(EXECUTED, as_version=4))
    assert any(image for _, image in published), "the executed form has no plot"
    found = differences(published, outputs(fresh_run))
    assert not found, "\n".join(found)


def test_a_number_that_moved_or_a_missing_plot_is_a_difference():
    run = [("loss +0.0000 -> -0.0030; kl 0.2498\n", True)]
    assert differences(run, [("loss +0.0000 -> -0.0030; kl 0.2498\n", True)]) == []
    assert differences(run, [("loss +0.0000 -> -0.0030; kl 0.2499\n", True)]) == []  # within 1e-3 relative
    assert differences(run, [("loss +0.0000 -> -0.0030; kl 0.3100\n", True)]) == ["code cell 0: 0.2498 against 0.3100"]
    assert differences(run, [("loss +0.0000 -> -0.0030; kl 0.2498\n", False)]) == \
        ["code cell 0: a plot in one run and not the other"]
    assert "the text differs" in differences(run, [("loss went down\n", True)])[0]
