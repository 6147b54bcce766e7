"""The lesson's reading path, counted whole (tools/reading_path.py): every line of grpo_vllm_one.py, and each function
of grpo_math.py and ref_server.py that make demo's step runs, traced (server start-up included), with the code those
files run on import. The fast tests count it from the record and the code as it is now; a slow test traces the step
again and compares."""
import ast
import json
import os
import subprocess
import sys

import pytest

from tools import reading_path
from tools.reading_path import BUDGET, ROOT, TRAINERS, count, recorded, report, totals

LESSON = "grpo_vllm_one.py"
RECORD_AGAIN = "python tools/reading_path.py --record (traces make demo's step again, ~2 minutes)"


def entered(file, name):
    return {"file": file, "name": name}


def trace(*entries, worker=()):
    """A trace of the trainer's process (and a generation process's, given its entries), the server's empty."""
    steps = {"trainer": {"entered": list(entries)}, "server": {"entered": []}}
    if worker:
        steps["trainer.SpawnProcess-1"] = {"entered": list(worker)}
    return steps


def span(file, name):
    node = reading_path.definitions(file)[0][name]
    return node.end_lineno - node.lineno + 1


def file_lines(file):
    with open(os.path.join(ROOT, file)) as f:
        return f.read().splitlines()


@pytest.fixture(scope="module")
def lesson():
    rows = count(recorded("grpo_vllm_one"))
    print(f"\n{report(rows, 'grpo_vllm_one')}")
    return rows


def test_the_lessons_path_is_every_line_of_its_file_and_what_its_step_runs_of_grpo_math_and_ref_server(lesson):
    assert set(lesson) == {LESSON, "grpo_math.py", "ref_server.py"}, (
        f"the lesson's step runs code of other project files: {sorted(lesson)}")
    with open(os.path.join(ROOT, LESSON)) as f:
        text = f.read()
    assert (lesson[LESSON]["lines"], lesson[LESSON]["characters"]) == (len(text.splitlines()), len(text))  # wc -l, -c
    assert {"completion_logps", "completion_mask", "group_advantages", "groups_with_signal", "grpo_loss",
            "capped_is_weight"} <= set(lesson["grpo_math.py"]["functions"])
    # the server's start-up (flags, model, fingerprint) and its request path (check, queue, reference log-probs)
    server = set(lesson["ref_server.py"]["functions"])
    assert {"parse_flags", "main", "make_app", "model_fingerprint", "decode", "check_rollout", "encode",
            "make_app.<locals>.upload", "make_app.<locals>.get", "ref_worker"} <= server


def test_every_grpo_math_function_the_lesson_imports_is_in_its_traced_step():
    """A function the lesson starts to import and call is not in the record until the step is traced again."""
    tree = ast.parse(open(os.path.join(ROOT, LESSON)).read())
    imported = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "grpo_math"
                for alias in node.names}
    traced = {e["name"] for process in recorded("grpo_vllm_one").values() for e in process["entered"]
              if e["file"] == "grpo_math.py"}
    assert imported <= traced, f"{LESSON} imports {sorted(imported - traced)} from grpo_math: {RECORD_AGAIN}"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 73's budget is not met yet: ref_server.py (budget 200 lines) is being trimmed; the assertion's message "
    "has the counts. Strict: once the path fits, this test fails until the mark "
    "is removed"))
def test_the_lessons_reading_path_is_within_issue_73s_budget(lesson):
    path = totals(lesson)
    assert all(path[k] <= BUDGET[k] for k in BUDGET), (
        f"the lesson's reading path is {path['lines']} lines, {path['characters']:,} characters in {path['files']} "
        f"files; issue 73's budget: {BUDGET['lines']} lines, {BUDGET['characters']:,} characters, {BUDGET['files']} "
        f"files\n{report(lesson, 'grpo_vllm_one')}")


def test_the_lesson_is_within_issue_73s_budget_for_its_file():
    lines = file_lines(LESSON)
    assert len(lines) <= 420, f"{LESSON} is {len(lines)} lines; issue 73's budget: 420"
    assert max(map(len, lines)) <= 110, [n for n, line in enumerate(lines, 1) if len(line) > 110]


def test_the_trainers_file_counts_whole_and_another_files_function_its_whole_span():
    rows = count(trace(entered(LESSON, "main"), entered("grpo_math.py", "grpo_objective")))
    assert rows[LESSON]["lines"] == len(file_lines(LESSON))
    assert rows["grpo_math.py"]["lines"] == span("grpo_math.py", "grpo_objective")
    node = reading_path.definitions("grpo_math.py")[0]["grpo_objective"]
    lines = file_lines("grpo_math.py")[node.lineno - 1:node.end_lineno]
    assert rows["grpo_math.py"]["characters"] == sum(len(line) + 1 for line in lines)


def test_a_file_imported_counts_the_code_it_runs_on_import_but_not_its_functions():
    rows = count(trace(entered("grpo_math.py", "<module>")))
    tree = reading_path.definitions("grpo_math.py")[1]
    docstring = tree.body[0].end_lineno - tree.body[0].lineno + 1
    functions = sum(span("grpo_math.py", n.name) for n in tree.body if isinstance(n, ast.FunctionDef))
    assert docstring < rows["grpo_math.py"]["lines"] <= len(file_lines("grpo_math.py")) - functions


def test_a_closure_or_comprehension_is_read_with_the_function_around_it():
    alone = count(trace(entered("ref_server.py", "make_app")))["ref_server.py"]["lines"]
    rows = count(trace(entered("ref_server.py", "make_app"), entered("ref_server.py", "make_app.<locals>.upload"),
                       entered("ref_server.py", "make_app.<locals>.queued_bytes.<locals>.<genexpr>")))
    assert rows["ref_server.py"]["lines"] == alone == span("ref_server.py", "make_app")


def test_the_generation_process_counts_with_the_trainers():
    rows = count(trace(entered(LESSON, "main"), worker=[entered("grpo_math.py", "group_advantages")]))
    assert rows["grpo_math.py"]["functions"] == ["group_advantages"]


def test_a_recorded_function_that_is_gone_is_named_with_the_command_that_traces_again():
    with pytest.raises(SystemExit, match=r"grpo_math.py has no no_such_function now: .*--record"):
        count(trace(entered("grpo_math.py", "no_such_function")))


@pytest.mark.slow  # ~25 s on two busy cores: torch's import in both processes
def test_a_process_the_traced_script_starts_traces_itself_into_its_own_record(tmp_path):
    script = tmp_path / "spawns.py"  # outside the repository: not counted itself
    script.write_text("import multiprocessing\n"
                      "from grpo_math import group_advantages\n"
                      "import torch\n"
                      "if __name__ == '__main__':\n"
                      "    child = multiprocessing.get_context('spawn').Process(target=group_advantages, "
                      "args=(torch.zeros(4), 2), name='child')\n"
                      "    child.start()\n"
                      "    child.join()\n")
    out = tmp_path / "script.json"
    subprocess.run([sys.executable, "tools/reading_path.py", "--trace", str(out), str(script)], cwd=ROOT, check=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    child = json.loads((tmp_path / "script.child.json").read_text())
    assert entered("grpo_math.py", "group_advantages") in child["entered"]
    assert "group_advantages" not in {e["name"] for e in json.loads(out.read_text())["entered"]}


@pytest.mark.slow  # ~1.5 minutes (the lesson), ~3 (grpo_train) on two busy cores
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_tracing_the_step_again_gives_the_recorded_count(trainer, tmp_path):
    fresh = json.loads(json.dumps(reading_path.trace_step(trainer, str(tmp_path))))  # as the record stores it
    assert count(fresh, trainer) == count(recorded(trainer), trainer), (
        f"the step of {TRAINERS[trainer][0]} runs other functions than its record says: "
        f"{RECORD_AGAIN.replace('--record', f'--record --trainer {trainer}')}")
