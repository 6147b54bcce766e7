"""The guide's reading paths are a step of make demo for each trainer, traced (tools/reading_path.py): the whole trace
and the reader's subset, counted from the code as it is. The guide's copies are checked against them in a second,
and a slow test traces the steps again."""
import json
import subprocess
import sys

import pytest

from tools import reading_path
from tools.reading_path import FILES, GUIDE, ROOT, TRAINERS, count, recorded, table

RECORD_AGAIN = ("python tools/reading_path.py --record (traces both trainers' step again, ~5 minutes, and rewrites "
                "tools/reading_path*.json and docs/guide.md's tables)")
# entered only when the full trainer waits for its batch, which is timing: a trace may hold them or not
WAITING = {("trainer", "simple_grpo/train.py", "main.<locals>.take.<locals>.waiting"),
           ("trainer", "simple_grpo/train.py", "main.<locals>.<lambda>"),
           ("trainer", "simple_grpo/generation/workers.py", "check_workers"),
           ("trainer", "simple_grpo/generation/workers.py", "WorkerProgress.describe"),
           ("trainer", "simple_grpo/generation/workers.py", "WorkerProgress.check_deadline")}


def entered(file, name, *callers, globals=()):
    """A trace's entry: file's function name, entered from callers [(file, name)] (none: the script's top)."""
    return {"file": file, "name": name, "callers": [list(c) for c in callers] or [[]], "globals": list(globals)}


def trace(*entries, fields=(), copied_fields=(), worker=()):
    """A trace of the trainer's process (and a generation worker's, given its entries), the server's empty."""
    steps = {"trainer": {"entered": list(entries), "fields": [list(f) for f in fields],
                         "copied_fields": [list(f) for f in copied_fields]},
             "server": {"entered": [], "fields": [], "copied_fields": []}}
    if worker:
        steps["gen_worker_0"] = {"entered": list(worker), "fields": [], "copied_fields": []}
    return steps


def span(file, name):
    node = reading_path.definitions(file)[0][name]
    return node.end_lineno - node.lineno + 1


def docstring_lines(file):
    node = reading_path.definitions(file)[2].body[0]
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_guides_table_is_the_traced_step_counted_from_the_code_as_it_is(trainer):
    marker, pattern = reading_path.guide_block(trainer)
    copy = pattern.search(open(GUIDE).read())
    assert copy, f"docs/guide.md has no block {marker} ... <!-- /reading-path -->"
    assert copy.group(1) == table(recorded(trainer), trainer), (
        f"docs/guide.md's reading path of {FILES[trainer]} is not the recorded trace counted from the code as it is now. "
        f"After a change to the code a step runs: {RECORD_AGAIN}. Where only the tool or the guide changed: "
        "python tools/reading_path.py --guide")


def test_the_guides_tables_show_both_counts_and_what_the_subset_leaves_out_with_why():
    text = table(recorded("full"), "full")
    assert "lines: the reader's / the whole trace's / the file's" in text
    assert "- `simple_grpo/run/`: the run directory, the logs" in text
    assert "`gen_worker`" in text  # the generation worker's process is traced too


def test_a_function_entered_counts_its_whole_span_and_its_files_docstring():
    rows, _ = count(trace(entered("grpo_math.py", "grpo_objective")))
    assert rows["grpo_math.py"]["functions"] == {"grpo_objective": span("grpo_math.py", "grpo_objective")}
    assert rows["grpo_math.py"]["lines"] == span("grpo_math.py", "grpo_objective") + docstring_lines("grpo_math.py")


def test_a_module_constant_read_is_counted_where_it_is_assigned_through_imports():
    rows, _ = count(trace(entered("simple_grpo/trainer/config.py", "default_ref_url", globals=["DEFAULT_REF_URL"])))
    assert "DEFAULT_REF_URL" in rows["simple_grpo/protocol.py"]["constants"]  # imported from there
    assert rows["simple_grpo/protocol.py"]["lines"] == 1 + docstring_lines("simple_grpo/protocol.py")


def test_a_config_field_read_counts_its_declaration_unless_left_out_code_or_only_a_copy_read_it():
    fields = [("simple_grpo/trainer/config.py", "TrainerConfig", "beta", "grpo_train.py", "main"),
              ("simple_grpo/trainer/config.py", "TrainerConfig", "save_every", "simple_grpo/run/checkpoints.py", "x")]
    copied = [("simple_grpo/trainer/config.py", "TrainerConfig", "epsilon", "grpo_train.py", "main")]
    rows, left_out = count(trace(entered("grpo_train.py", "main"), fields=fields, copied_fields=copied))
    assert rows["simple_grpo/trainer/config.py"]["fields"] == {"beta": 1}
    assert reading_path.COPIED_FIELDS in left_out
    whole, _ = count(trace(entered("grpo_train.py", "main"), fields=fields, copied_fields=copied), whole=True)
    assert set(whole["simple_grpo/trainer/config.py"]["fields"]) == {"beta", "save_every", "epsilon"}


def test_what_only_left_out_code_calls_is_left_out_and_named_with_why():
    checks = ("simple_grpo/trainer/config.py", "check_values")
    rows, left_out = count(trace(entered(*checks), entered("grpo_math.py", "group_advantages", checks),
                                 entered("grpo_math.py", "grpo_loss", checks, ("grpo_train.py", "main")),
                                 entered("grpo_train.py", "main")))
    assert "group_advantages" not in rows["grpo_math.py"]["functions"]  # only check_values called it
    assert "grpo_loss" in rows["grpo_math.py"]["functions"]  # main called it too
    assert ("simple_grpo/trainer/config.py:check_values", "refuses bad values, sets nothing") in left_out
    assert "- `simple_grpo/trainer/config.py:check_values`: refuses bad values, sets nothing" in table(
        trace(entered(*checks)), "grpo_train")


def test_the_whole_trace_leaves_nothing_out_and_counts_the_code_run_on_import():
    checks = ("simple_grpo/trainer/config.py", "check_values")
    steps = trace(entered(*checks), entered("grpo_math.py", "group_advantages", checks),
                  entered("grpo_math.py", "<module>"))
    whole, _ = count(steps, whole=True)
    assert set(whole["grpo_math.py"]["functions"]) == {"group_advantages"}
    assert set(whole["simple_grpo/trainer/config.py"]["functions"]) == {"check_values"}
    module_code = whole["grpo_math.py"]["lines"] - span("grpo_math.py", "group_advantages")
    assert docstring_lines("grpo_math.py") < module_code  # its docstring, imports and constants
    assert "| 0 / " in table(steps, "grpo_train")  # a file only the whole trace counts: none of it in the subset


def test_a_closure_is_read_with_the_function_around_it():
    route = entered("ref_server.py", "make_app.<locals>.get", ("simple_grpo/http_server.py", "serve"))
    rows, _ = count(trace(entered("ref_server.py", "make_app"), route,
                          entered("ref_server.py", "Finished.get", ("ref_server.py", "make_app.<locals>.get")),
                          entered("simple_grpo/http_server.py", "serve")))
    assert "Finished.get" in rows["ref_server.py"]["functions"]  # the route's call, though HTTP code called the route


def test_a_worker_process_is_counted_with_its_own_callers():
    worker = [entered("simple_grpo/generation/workers.py", "run_on_cores"),
              entered("simple_grpo/train.py", "gen_worker", ("simple_grpo/generation/workers.py", "run_on_cores"))]
    rows, _ = count(trace(entered("simple_grpo/train.py", "main"), worker=worker))
    assert set(rows["simple_grpo/train.py"]["functions"]) == {"gen_worker", "main"}


def test_a_recorded_function_that_is_gone_is_named_with_the_command_that_traces_again():
    with pytest.raises(SystemExit, match=r"grpo_math.py has no no_such_function now: .*--record"):
        count(trace(entered("grpo_math.py", "no_such_function")))


@pytest.mark.slow  # ~25 s on two busy cores: torch's import in both processes
def test_a_process_the_traced_script_starts_traces_itself_into_its_own_record(tmp_path):
    script = tmp_path / "spawns.py"  # outside the repository: not counted itself
    script.write_text("import multiprocessing\n"
                      "from simple_grpo.task.rewards import extract_answer\n"
                      "if __name__ == '__main__':\n"
                      "    child = multiprocessing.get_context('spawn').Process(target=extract_answer, "
                      "args=('<answer>3</answer>',), name='child')\n"
                      "    child.start()\n"
                      "    child.join()\n")
    out = tmp_path / "script.json"
    subprocess.run([sys.executable, "tools/reading_path.py", "--trace", str(out), str(script)], cwd=ROOT, check=True,
                   timeout=300)
    child = json.loads((tmp_path / "script.child.json").read_text())
    assert ["simple_grpo/task/rewards.py", "extract_answer", [[]]] in [
        [e["file"], e["name"], e["callers"]] for e in child["entered"]]
    assert "extract_answer" not in {e["name"] for e in json.loads(out.read_text())["entered"]}


def subset(steps):
    """The reader's subset as the guide shows it: each file's lines, functions (a nested one is inside its
    parent's lines), constants and fields."""
    return {file: (r["lines"], [name for name in r["functions"] if "<locals>" not in name], r["constants"],
                   r["fields"]) for file, r in count(steps)[0].items()}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_tracing_the_step_again_gives_the_recorded_trace(trainer, tmp_path):
    fresh = json.loads(json.dumps(reading_path.trace_step(trainer, str(tmp_path))))  # as the record stores it
    names = lambda t: {(p, e["file"], e["name"]) for p in t for e in t[p]["entered"]}  # noqa: E731
    assert names(fresh) ^ names(recorded(trainer)) <= WAITING, \
        f"the step of {FILES[trainer]} runs other functions than its record says: {RECORD_AGAIN}"
    assert subset(fresh) == subset(recorded(trainer))  # the wait's functions are left out of it, or nested
    if names(fresh) == names(recorded(trainer)):
        assert table(fresh, trainer) == table(recorded(trainer), trainer)
